"""The cloud verifier (`specsplit-cloud`): REST and gRPC over one session store and one model.

Layout: settings (CloudSettings) -> model (TargetModel, every session's KV in one pool) -> engine
(the round on a session's KV) -> store (limits, eviction) -> scheduler (the model thread and its
continuous batching) -> eviction (who gives KV blocks back) -> core (the service's parts and shared
checks) -> opening / rounds / streaming / generate (one call's work each) -> service (what both
transports call) -> guards (checks before parsing) -> rest / grpc_server (the boundaries) -> app (one
asyncio loop, drain) -> cli.

Behaviour beyond docs/PROTOCOL.md, which clients may rely on:
- Replay cache: each session keeps its last `replay_cache_size` answers by request_id. A request
  whose request_id and body match a kept answer, while the session's context still contains that
  answer's result, gets the same answer again without a forward and without rolling the session
  back (a late duplicate of an applied round). Otherwise a round is recomputed by
  crop-then-append, which gives the same answer for the same request.
- An admitted round is applied even if its caller goes away (deadline, disconnect), so the retry
  of a timed-out round is answered from the replay cache.
- A 409 body carries `expected_ctx_len` and `expected_ctx_hash` (the cloud's committed S).
- Eviction: sessions idle past `session_ttl_s` expire; past `kv_budget_bytes` the least recently
  used sessions with nothing in flight are evicted; opening past `max_sessions` answers 429 unless
  an expired session can go. An evicted session answers 404 (reopen with the full context).
- gRPC errors carry the REST error body as JSON in the trailing metadata `specsplit-error`.
- POST /v1/generate with "stream": true sends `data: {"token_id", "index"}` per token, then
  `event: done` with `{"token_ids", "metrics"}`.
"""
