"""Malformed entries (not redisq messages, records.MalformedMessage) in the consumers' log: a
line per partition now and then, not one per entry (both consumer drivers)."""

from __future__ import annotations

import logging
import time

from redisq.consume.ownership import TopicPartition
from redisq.model.records import Message

log = logging.getLogger("redisq.consumer")

MALFORMED_LOG_INTERVAL_S = 10.0


class MalformedLog:
    """Malformed entries are logged at most once per partition per MALFORMED_LOG_INTERVAL_S,
    with how many came since the last line; the rest are reported at close (both consumer
    drivers)."""

    def __init__(self, member: str) -> None:
        self.member = member
        self._logged: dict[TopicPartition, float] = {}
        self._unreported: dict[TopicPartition, int] = {}

    def note(self, message: Message, what: str) -> None:
        tp = (message.topic, message.partition)
        now = time.monotonic()
        unreported = self._unreported.get(tp, 0)
        if now - self._logged.get(tp, -1e9) < MALFORMED_LOG_INTERVAL_S:
            self._unreported[tp] = unreported + 1
            return
        self._logged[tp] = now
        self._unreported[tp] = 0
        reason = getattr(message, "reason", "")
        more = f"; {unreported} more malformed entries since the last report" if unreported else ""
        log.error(
            "%s: %s/%d: 1 malformed entry %s (at %s: %s)%s",
            self.member,
            tp[0],
            tp[1],
            what,
            message.offset,
            reason,
            more,
        )

    def close(self) -> None:
        for (topic, partition), count in self._unreported.items():
            if count:
                log.error(
                    "%s: %s/%d: %d more malformed entries since the last report",
                    self.member,
                    topic,
                    partition,
                    count,
                )
        self._unreported.clear()
