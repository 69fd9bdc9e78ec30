"""The edge's round policy, in the order a generation consults it:

1. **Speculate or stream** (`stream.WayControl`): per session, from the cloud's fitted forward cost (the open
   answer's `forward_cost`, so the first decision comes before any round), the link's round trip and the
   session's acceptance, whether the next tokens come from verify rounds or from a stream of the target's own
   tokens on the same session; re-decided as rounds and streamed tokens are observed.
2. **The round's shape**: a chain of k drafts (`k.CostModelK`, the k with the most committed tokens a second;
   `k.KController`, fixed or moved by the last round's la/k), or a token tree (`tree.TreeControl`: how many of
   the grown tree's nodes to send, ranked by the session's acceptance by q, and how deep to grow the next).
3. **The cloud's budget**: each answer's `node_budget` caps the nodes the next round sends (`--node-budget`).
4. **How long to wait** (`deadline.VerifyDeadline`): a verify deadline that follows the path's measured times;
   past it the round is retried, or with `--timeout-fallback` its first draft token is committed unverified.
5. **Uncertainty gating** (`gating`, opt-in): a draft block the draft is sure of may be committed locally.

`from_settings` builds each from EdgeSettings. Only 4 with `--timeout-fallback` and 5 change the text's
distribution; both are off by default and counted when on.
"""
