"""specsplit edge client: drafts on the device, has the cloud verify, commits the target's text.

    from edge import EdgeClient, EdgeSettings
    client = EdgeClient(EdgeSettings(cloud_url="http://127.0.0.1:8000", draft="models/demo-draft"))
    result = client.generate("def fib(n):", max_new_tokens=64)      # text, ids, rounds, metrics
    for tok in client.stream("Once upon a time"):                    # committed tokens as they come
        print(tok.token_id, tok.origin)

Layout: drafters/ (the Drafter interface, ModelDrafter, NGramDrafter, llama.cpp, trees), policy/ (the round
policy in the order a generation consults it: speculate or stream, a chain's k or a tree's size, the cloud's
budget, the verify deadline, uncertainty gating), prefetch.py (drafting while the cloud verifies), transport/
(REST and gRPC behind one interface, error mapping), exchange.py (a session's wire state, verify and recovery),
speculative.py (its rounds: chains, trees, streams, commits), client.py (modes, streaming) with generation.py,
solo_modes.py and states_hook.py, pairing.py (tokenizer and draft against the target's fingerprint), metrics.py,
settings.py (EdgeSettings, env prefix SPECSPLIT_EDGE_), cli.py (specsplit-edge) with report.py and
draft_choice.py; the OpenAI-compatible server of `specsplit-edge serve`: the server/ package, with prom.py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import EdgeClient, Generation, GenerationResult
    from .metrics import CommittedToken, EdgeMetrics, RoundRecord
    from .settings import EdgeSettings

# imported on first use: `specsplit-edge --help` and the settings alone never load torch
_WHERE = {"EdgeClient": "client", "Generation": "client", "GenerationResult": "client", "CommittedToken": "metrics",
          "EdgeMetrics": "metrics", "RoundRecord": "metrics", "EdgeSettings": "settings"}
__all__ = ["CommittedToken", "EdgeClient", "EdgeMetrics", "EdgeSettings", "Generation", "GenerationResult",
           "RoundRecord"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
