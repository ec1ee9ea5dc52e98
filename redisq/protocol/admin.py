"""Topic administration scripts: create, grow and delete topics (DESIGN §2)."""

from __future__ import annotations

from typing import Any

from redisq.model.keys import KeySpace
from redisq.model.topic import TopicConfig
from redisq.protocol import ScriptCall, text

# The metadata hash's fields, in the order create_topic writes them.
TOPIC_FIELDS = (
    "partitions",
    "retention_ms",
    "retention_messages",
    "dedup_window_ms",
    "producer_state_ttl_ms",
    "created_ms",
    "topic_id",
    "entry_format",
)


def create_partition(keys: KeySpace, topic: str, partition: int) -> ScriptCall[bool]:
    """create_partition.lua: an empty partition stream (True if created now)."""
    return ScriptCall(
        "create_partition", (keys.log(topic, partition),), (), lambda r: bool(int(r)), topic
    )


def create_topic(keys: KeySpace, config: TopicConfig) -> ScriptCall[Any]:
    """create_topic.lua: the metadata, written last (the partitions exist before it); raises
    TopicExists."""
    fields: list[Any] = []
    for name in TOPIC_FIELDS:
        fields += [name, getattr(config, name)]
    return ScriptCall(
        "create_topic",
        (keys.topics(), keys.topic_meta(config.name)),
        (config.name, *fields),
        topic=config.name,
        retry_safe=False,  # a second run answers TopicExists
    )


def grow_topic(keys: KeySpace, topic: str, partitions: int) -> ScriptCall[int]:
    """grow_topic.lua: raise the partition count (the new streams exist before it); returns the
    previous count. Error PARTITIONS_NOT_GREATER when grown concurrently."""
    return ScriptCall(  # a second run answers PARTITIONS_NOT_GREATER
        "grow_topic", (keys.topic_meta(topic),), (partitions,), int, topic, retry_safe=False
    )


def delete_topic(keys: KeySpace, topic: str) -> ScriptCall[int]:
    """delete_topic.lua: remove the metadata; returns the partition count it had."""
    return ScriptCall(  # a second run answers TopicNotFound
        "delete_topic",
        (keys.topics(), keys.topic_meta(topic)),
        (topic,),
        int,
        topic,
        retry_safe=False,
    )


def _count_reply(reply: Any) -> tuple[int, str]:
    return int(reply[0]), text(reply[1])


def count_range(
    keys: KeySpace,
    topic: str,
    partition: int,
    start: str,
    end: str,
    limit: int,
    messages: bool = False,
) -> ScriptCall[tuple[int, str]]:
    """count_range.lua: (entries in [start, end) up to limit, the ID of the last one counted);
    messages: a batch entry counts its messages (start inclusive, offsets inside entries)."""
    args: tuple[Any, ...] = (start, end, limit, "messages") if messages else (start, end, limit)
    return ScriptCall("count_range", (keys.log(topic, partition),), args, _count_reply, topic)
