"""The drafts' training as product code: data the target writes, the heads, the training loop, evaluation.

Modules, each one concern:
- `target`    the target model for data work: chat prefixes and batched sampling with the product's processing.
- `requests`  requests the target writes itself (Magpie, arXiv 2406.08464), by kind, filtered, deduplicated.
- `answers`   the target's answers to them, greedy and sampled, in batched forwards.
- `heldout`   the evaluation texts' 8-grams, which no training text may share.
- `shards`    the on-disk layout: committed shards of token ids under `data/head/`, one atomic file each.
- `states`    the target's states teacher-forced over the answers (outside the tree), and the FR-Spec output ids.
- `train`     the attention head's training loop (training-time test: unrolled on its own predictions).
- `evaluate`  held-out agreement by draft position and tokens per verify call; export of a trained head;
              greedy agreement and beta of a draft against its target.
- `loop`      the one training loop (AdamW, warm-up and cosine, a budget in steps or minutes, checkpoints).
- `corpus`    Python's own source as text, with one held-out rule (crc32 of the path).
- `teacher`   the target's answers and its states over them or over text, in work-directory shards.
- `feature_data`, `feature_train`, `cut_draft`  the feature-fed head and the tokens-only draft cut from
              the target, on those shards (`research/scripts/train_heads.py`).
- `distill_prompts`, `distill`  the small distilled Llama draft (`scripts/distill_draft.py`).
- `demo_pair` the bundled demo tokenizer, GPT-2 target and draft (`scripts/train_demo_models.py`).

The module being trained lives where the edge runs it (`research/heads/attention_head.py`). Every phase resumes
from the shards or checkpoint it finds, so a stopped or lost machine costs at most one shard's time. Nothing
here runs in setup (the demo pair's smoke run is a test); `research/scripts/head_data.py` (data),
`research/scripts/train_attention_head.py` (states, train, eval, export), `research/scripts/train_heads.py`,
`scripts/distill_draft.py` and `scripts/train_demo_models.py` are the entry points.
"""
