"""The Responses API (``POST /v1/responses``), translated onto the chat-completions path."""

from gateway.api.responses.routes import add_responses_routes

__all__ = ["add_responses_routes"]
