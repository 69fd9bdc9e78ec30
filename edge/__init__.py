"""specsplit edge client: drafts on the device, has the cloud verify, commits the target's text.

    from edge import EdgeClient, EdgeSettings
    client = EdgeClient(EdgeSettings(cloud_url="http://127.0.0.1:8000", draft="models/demo-draft"))
    result = client.generate("def fib(n):", max_new_tokens=64)      # text, ids, rounds, metrics
    for tok in client.stream("Once upon a time"):                    # committed tokens as they come
        print(tok.token_id, tok.origin)

Layout: drafters/ (the Drafter interface, ModelDrafter, NGramDrafter), gating.py (uncertainty
gate), kcontrol.py (the cost-model k), round_control.py (fixed and dynamic k), prefetch.py
(drafting while the cloud verifies), transport/ (REST and gRPC behind one interface, error
mapping), exchange.py (a session's wire state, verify and recovery), speculative.py (its rounds:
chains, trees, streams, commits), treecontrol.py and waycontrol.py (tree size, speculate or stream),
client.py (modes, streaming) with generation.py, run_controls.py, solo_modes.py and states_hook.py,
pairing.py (tokenizer and draft against the target's fingerprint), metrics.py, settings.py
(EdgeSettings, env prefix SPECSPLIT_EDGE_), cli.py (specsplit-edge); the OpenAI-compatible server
of `specsplit-edge serve`: the server/ package, with prom.py.
"""

from .client import EdgeClient, Generation, GenerationResult
from .metrics import CommittedToken, EdgeMetrics, RoundRecord
from .settings import EdgeSettings

__all__ = ["CommittedToken", "EdgeClient", "EdgeMetrics", "EdgeSettings", "Generation", "GenerationResult",
           "RoundRecord"]
