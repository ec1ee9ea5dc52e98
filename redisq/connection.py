"""Re-exported from redisq.server.connection (its old place, which the README names)."""

from redisq.server.connection import (
    client_options,
    embedded_url,
    open_client,
    redact_url,
    resolve_url,
)

__all__ = ["client_options", "embedded_url", "open_client", "redact_url", "resolve_url"]
