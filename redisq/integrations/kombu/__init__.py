"""A Kombu transport on redisq (extra ``[celery]``): Celery and Kombu on ordered, deduplicated,
fenced topics.

    app.conf.broker_url = "redis://localhost:6379/0"
    app.conf.broker_transport = "redisq.integrations.kombu:Transport"

    kombu.Connection("redis://localhost:6379/0", transport="redisq.integrations.kombu:Transport")

Importing this module also registers the ``redisq://`` scheme with Kombu
(``kombu.Connection("redisq://localhost:6379/0")``). See docs/integrations/celery.md.
"""

from kombu.transport import TRANSPORT_ALIASES

from redisq.integrations.kombu.mapping import MESSAGE_ID_HEADER, ORDERING_HEADER
from redisq.integrations.kombu.transport import Channel, Transport, TransportOptions

TRANSPORT_ALIASES.setdefault("redisq", "redisq.integrations.kombu:Transport")

__all__ = ["MESSAGE_ID_HEADER", "ORDERING_HEADER", "Channel", "Transport", "TransportOptions"]
