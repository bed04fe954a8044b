"""The Responses API (``POST /v1/responses``), translated onto the chat-completions path."""

from gateway.routes.responses.routes import responses_router

__all__ = ["responses_router"]
