"""`gptforge serve`: an OpenAI-compatible HTTP server with continuous batching.

engine.py (the scheduler over per-sequence KV slots of `gptforge.generate.slots`), app.py
(FastAPI endpoints), protocol.py (request models, OpenAI errors), chat.py (chat template),
metrics.py (Prometheus), server.py (uvicorn with a graceful drain). Needs the `serve` extra.
"""
