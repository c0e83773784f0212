"""nanoserve's OpenAI-compatible HTTP server (`nanoserve serve`), a top floor over `AsyncLLM`.

protocol.py: the requests and responses; app.py: the routes, streaming, errors; metrics.py:
Prometheus; dashboard.py and dashboard.html: the live view of `--dashboard`; cli.py: the flags and
the process (uvicorn, signals). docs/serving.md explains how a request flows.
"""
