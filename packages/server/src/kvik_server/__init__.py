"""kvik's OpenAI-compatible HTTP server (FastAPI + uvicorn)."""
