"""The OpenAI-compatible server of `specsplit-edge serve`.

serve.py (start-up), openai_api.py (routes), openai_bodies.py (request bodies), openai_engine.py
(one EdgeClient per request over a shared draft), openai_errors.py (OpenAI error bodies),
chat.py (chat templates), stop_text.py (stop strings), shared_draft.py (draft weights shared by
requests). Its Prometheus registry is edge/prom.py.
"""
