"""OpenAI-compatible API: protocol objects (protocol/, one module per endpoint) apart from the serving
code and the app."""
