"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the AsyncEngine."""
