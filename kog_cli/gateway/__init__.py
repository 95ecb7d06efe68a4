"""`kog serve`'s HTTP gateway: OpenAI-compatible routes, /metrics and a playground page, as a client
of the coordinator (docs/serve.md)."""
from .app import MAX_BODY_BYTES, Gateway, served_name

__all__ = ["Gateway", "MAX_BODY_BYTES", "served_name"]
