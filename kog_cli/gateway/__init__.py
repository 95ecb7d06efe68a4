"""`kog serve`'s HTTP gateway: OpenAI-compatible routes, /metrics and a playground page, as a client
of the coordinator (docs/serve.md)."""
from .app import Gateway, MAX_BODY_BYTES

__all__ = ["Gateway", "MAX_BODY_BYTES"]
