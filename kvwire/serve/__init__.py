"""The OpenAI-compatible HTTP server over kvwire's engine (`kvwire serve`)."""
from .app import create_app, serve

__all__ = ["create_app", "serve"]
