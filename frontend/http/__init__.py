"""The OpenAI-compatible HTTP server: one more client of the frontend (FastAPI on uvicorn)."""
