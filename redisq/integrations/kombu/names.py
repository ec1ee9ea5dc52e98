"""Kombu names (queues, exchanges) as redisq topic names.

Topic names are 1-200 characters of ``A-Z a-z 0-9 . _ -`` (not ``.`` or ``..``); Kombu's are
free text (Celery's remote-control queues carry the worker's ``name@host``). A name that fits is
its own topic, so a Celery queue ``celery`` is the topic ``celery`` in `redisq topic list`. Any
other name becomes its allowed characters plus a digest of the whole name: two Kombu names never
share a topic.
"""

from __future__ import annotations

import hashlib
import re

#: The transport's own topics start with this; a queue named so is mapped like an invalid one.
RESERVED_PREFIX = "_kombu."
BINDINGS_TOPIC = RESERVED_PREFIX + "bindings"

_ALLOWED = re.compile(r"[A-Za-z0-9._-]{1,200}")
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._-]+")
_READABLE_PART = 150  # what is kept of an invalid name before its digest (200 at most in all)


def topic_for(name: str) -> str:
    """The topic that holds the Kombu queue `name`."""
    if (
        _ALLOWED.fullmatch(name)
        and name not in (".", "..")
        and not name.startswith(RESERVED_PREFIX)
    ):
        return name
    digest = hashlib.sha1(name.encode("utf-8")).hexdigest()[:16]
    readable = _NOT_ALLOWED.sub("-", name)[:_READABLE_PART].strip("-") or "q"
    if readable.startswith(RESERVED_PREFIX):
        readable = "q" + readable
    return f"{readable}.{digest}"
