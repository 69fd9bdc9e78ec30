"""The drafts' training as product code: data the target writes, the heads, the training loop, evaluation.

Modules, each one concern:
- `target`    the target model for data work: chat prefixes and batched sampling with the product's processing.
- `requests`  requests the target writes itself (Magpie, arXiv 2406.08464), by kind, filtered, deduplicated.
- `answers`   the target's answers to them, greedy and sampled, in batched forwards.
- `heldout`   the evaluation texts' 8-grams, which no training text may share.
- `shards`    the on-disk layout: committed shards of token ids under `data/head/`, one atomic file each.

Every phase resumes from the shards it finds, so a stopped or lost machine costs at most one shard's time.
Nothing here runs in setup or CI; `scripts/head_data.py` is the entry point.
"""
