"""The OpenAI-compatible HTTP server: protocol, FastAPI app, chat/completion serving, metrics."""
