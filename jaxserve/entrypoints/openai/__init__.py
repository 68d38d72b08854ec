"""OpenAI-compatible API: protocol objects (protocol.py) apart from the serving code and the app."""
