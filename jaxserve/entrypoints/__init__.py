"""The async engine and the OpenAI-compatible HTTP server (see async_llm.py, openai/server.py)."""
