"""The OpenAI-compatible server: `engine.py` (continuous batching, no HTTP), `app.py` (FastAPI routes
and the scheduler thread), `text.py` (stop strings), `metrics.py` (Prometheus text)."""
