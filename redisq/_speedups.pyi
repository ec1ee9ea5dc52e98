from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

from redisq.records import Message

def set_layout(
    message_type: type[Message], slot_names: tuple[str, ...], slow_decode: Callable[..., Any], /
) -> None: ...
def decode_entries(
    topic: str, partition: int, entries: Sequence[Any], deliveries: Any = None
) -> list[Message]: ...
def batch_messages(
    messages: list[Message],
    topic: str,
    partition: int,
    blob: bytes,
    n: int,
    ms: int,
    first_seq: int,
    start: int,
    stop: int,
    producer_id: int | None,
    base_seq: int | None,
    attempt: int,
    bitmap: bytes | None,
    /,
) -> bool: ...
@overload
def blob_from_resp(layout: str, count: int, body: bytes, /) -> bytes: ...
@overload
def blob_from_resp(
    layout: str, count: int, body: bytes, with_ids: Literal[True], /
) -> tuple[bytes, bytes]: ...
