"""The OpenAI Responses API (/v1/responses) on the chat generation path."""

from server.responses.routes import bp

__all__ = ["bp"]
