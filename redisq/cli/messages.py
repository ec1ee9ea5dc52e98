"""`redisq consume`: one message per line out (and the stop request `produce` shares)."""

from __future__ import annotations

import base64
import errno
import json
import re
import select
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import click

from redisq.cli.common import (
    OK,
    connect,
    connection_options,
    out,
    plural,
    warn,
)
from redisq.model.records import Message

POLL_MAX = 10_000  # messages per poll() (the consumer takes at most 100,000 per call)

# What would break "one message per line" or make the text ambiguous: the escape character,
# C0 and C1 controls (newlines, tabs, NEL), Unicode line/paragraph separators, and the
# surrogates that stand for bytes that are not UTF-8.
_ESCAPED = re.compile("[\\\\\x00-\x1f\x7f-\x9f\u2028\u2029\udc80-\udcff]")
_SHORT = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_JSON_LINE_BREAKS = re.compile("[\x85\u2028\u2029]")


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}"  # \\x80-\\xff: raw bytes


def escape(raw: bytes) -> str:
    """Text for one field of one line: UTF-8 as it is; backslash, tab, newlines and other
    control or line-separating characters escaped (\\\\, \\t, \\n, \\r, \\x00-\\x7f, \\uNNNN); bytes
    that are not UTF-8 as \\x80-\\xff. Unescaping gives the bytes back."""
    return _ESCAPED.sub(_escape_char, raw.decode("utf-8", errors="surrogateescape"))


def _json_bytes(raw: bytes | None) -> Any:
    """A JSON value for bytes: the string when it is UTF-8, else {"base64": "..."}."""
    if raw is None:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode()}


class Formatter:
    """One line per message (kafka-console-consumer's print.* properties):
    text  [Timestamp:ms] [Partition:p] [Offset:id] [headers] [key] value, tab-separated;
          headers as name=value,... (NO_HEADERS), a missing key as null, fields escaped
    hex   the same with key, header values and value in hex
    json  one object per line with every field (bytes: a string if UTF-8, else
          {"base64": ...}); the --print-* options do not apply."""

    def __init__(
        self,
        fmt: str = "text",
        *,
        key: bool = False,
        headers: bool = False,
        timestamp: bool = False,
        partition: bool = False,
        offset: bool = False,
    ) -> None:
        self.fmt = fmt
        self.key = key
        self.headers = headers
        self.timestamp = timestamp
        self.partition = partition
        self.offset = offset
        self._bytes = (lambda raw: raw.hex()) if fmt == "hex" else escape

    def line(self, message: Message) -> str:
        if self.fmt == "json":
            return self._json(message)
        fields = []
        if self.timestamp:
            fields.append(f"Timestamp:{message.timestamp_ms}")
        if self.partition:
            fields.append(f"Partition:{message.partition}")
        if self.offset:
            fields.append(f"Offset:{message.offset}")
        if self.headers:
            fields.append(
                ",".join(
                    f"{escape(k.encode())}={self._bytes(v)}" for k, v in message.headers.items()
                )
                or "NO_HEADERS"
            )
        if self.key:
            fields.append("null" if message.key is None else self._bytes(message.key))
        fields.append(self._bytes(message.value))
        return "\t".join(fields)

    @staticmethod
    def _json(message: Message) -> str:
        record = {
            "topic": message.topic,
            "partition": message.partition,
            "offset": message.offset,
            "timestamp_ms": message.timestamp_ms,
            "key": _json_bytes(message.key),
            "headers": {k: _json_bytes(v) for k, v in message.headers.items()},
            "value": _json_bytes(message.value),
        }
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        # JSON lets NEL, U+2028 and U+2029 stand unescaped; line-splitting readers cut there.
        return _JSON_LINE_BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


# -- consume -------------------------------------------------------------------------------------
class _ReadInterrupted(Exception):
    """Raised by the signal handler into a read that blocks (produce from a quiet stdin)."""


class StopRequest:
    """SIGINT, SIGTERM and SIGHUP ask for a clean stop (the consumer leaves its group, a
    temporary group is deleted; produce flushes what it sent and says so) instead of killing
    the process mid-way. With interrupt_reads, a signal that lands while next_or_none() waits
    for input ends that wait (nothing was sent of the line being read), and a second signal
    stops at once (KeyboardInterrupt)."""

    def __init__(self, interrupt_reads: bool = False) -> None:
        self.event = threading.Event()
        self.signal: int | None = None
        self._interrupt_reads = interrupt_reads
        self._reading = False

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def next_or_none(self, lines: Iterator[bytes]) -> bytes | None:
        """The next line, or None at the end of the input or once a stop is requested."""
        try:
            self._reading = True
            if self.requested:
                return None
            return next(lines, None)
        except _ReadInterrupted:
            return None
        finally:
            self._reading = False

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def request(signum: int, frame: object) -> None:
            if self._interrupt_reads and self.event.is_set():
                raise KeyboardInterrupt  # asked twice: stop now
            self.signal = signum
            self.event.set()
            if self._reading:
                self._reading = False  # raised once, never into the handler of this one
                raise _ReadInterrupted

        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {signum: signal.signal(signum, request) for signum in signals}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


@click.command("consume")
@click.argument("topic")
@click.option(
    "--group",
    help="Consume as a member of this group (acks what it prints); default: a temporary "
    "group console-<random>, deleted afterwards (as Kafka's console consumer does).",
)
@click.option("--name", help="Member name (default: host-pid-random).")
@click.option(
    "--mode",
    type=click.Choice(["orderly", "concurrent"]),
    default="orderly",
    show_default=True,
    help="Group mode of a new group.",
)
@click.option(
    "--from",
    "from_position",
    type=click.Choice(["earliest", "latest"]),
    default="earliest",
    show_default=True,
    help="Where a new group starts.",
)
@click.option(
    "--partition",
    type=click.IntRange(min=0),
    help="Browse one partition without a group (reads only, changes nothing).",
)
@click.option(
    "--start",
    metavar="OFFSET",
    help="Browse from this offset (stream ID) without a group (reads only).",
)
@click.option(
    "--max",
    "max_messages",
    type=click.IntRange(min=1),
    help="Stop after this many messages (any number).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    help="Stop after this many seconds without a message.",
)
@click.option("--print-key", is_flag=True, help="Print the key (null when none).")
@click.option("--print-headers", is_flag=True, help="Print the headers (name=value,...).")
@click.option("--print-timestamp", is_flag=True, help="Print the timestamp (ms).")
@click.option("--print-partition", is_flag=True, help="Print the partition.")
@click.option("--print-offset", is_flag=True, help="Print the offset (stream ID).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "hex"]),
    default="text",
    show_default=True,
    help="text: escaped so that each message is one line; hex: bytes as hex; json: one "
    "object per line with every field.",
)
@connection_options
def consume(
    topic: str,
    group: str | None,
    name: str | None,
    mode: str,
    from_position: str,
    partition: int | None,
    start: str | None,
    max_messages: int | None,
    timeout: float | None,
    print_key: bool,
    print_headers: bool,
    print_timestamp: bool,
    print_partition: bool,
    print_offset: bool,
    fmt: str,
) -> int:
    """Print TOPIC's messages, one per line, as a consumer-group member, or browse them
    (--partition, --start) without a group."""
    formatter = Formatter(
        fmt,
        key=print_key,
        headers=print_headers,
        timestamp=print_timestamp,
        partition=print_partition,
        offset=print_offset,
    )
    if partition is not None or start is not None:
        if group is not None:
            raise click.UsageError("--partition and --start browse without a group: drop --group")
        return _browse(topic, partition, start, max_messages, formatter)
    with StopRequest().installed() as stop:
        count = _consume_group(
            topic, group, name, mode, from_position, max_messages, timeout, formatter, stop
        )
    warn(f"Processed a total of {plural(count, 'message')}")
    return OK


def _browse(
    topic: str, partition: int | None, start: str | None, limit: int | None, formatter: Formatter
) -> int:
    stream = out()
    with connect() as broker:
        config = broker.topic_config(topic, refresh=True)
        partitions = [partition] if partition is not None else list(range(config.partitions))
        printed = 0
        for p in partitions:
            for message in broker.read(topic, p, start=start or "-"):
                if stream is not None:
                    stream.write(formatter.line(message) + "\n")
                printed += 1
                if limit is not None and printed >= limit:
                    return OK
    return OK


def _consume_group(
    topic: str,
    group: str | None,
    name: str | None,
    mode: str,
    from_position: str,
    limit: int | None,
    timeout: float | None,
    formatter: Formatter,
    stop: StopRequest,
) -> int:
    temporary = group is None
    group = group or f"console-{uuid.uuid4().hex[:8]}"
    printed = 0
    stream = out()
    with connect() as broker:
        broker.topic_config(topic, refresh=True)  # TopicNotFound before a group is made
        try:
            with broker.consumer(topic, group, name, mode=mode, start=from_position) as consumer:
                idle_since = time.monotonic()
                while not stop.requested and (limit is None or printed < limit):
                    room = POLL_MAX if limit is None else min(POLL_MAX, limit - printed)
                    messages = consumer.poll(timeout=0.5, max_messages=room)
                    if messages:
                        if stream is not None:
                            stream.write("".join(formatter.line(m) + "\n" for m in messages))
                            stream.flush()
                        consumer.ack(messages)
                        printed += len(messages)
                        idle_since = time.monotonic()
                    elif timeout is not None and time.monotonic() - idle_since >= timeout:
                        break
                    elif stream is not None and _reader_gone(stream):
                        raise BrokenPipeError(errno.EPIPE, "the reader of stdout went away")
        finally:
            if temporary:
                _delete_temporary(broker, topic, group)
    return printed


def _reader_gone(stream: IO[str]) -> bool:
    """stdout is a pipe whose reader has exited (consume | head): poll() reports POLLERR on
    its write end. Checked while idle, so a consumer with nothing more to write stops too,
    as it would at its next write."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), 0)  # no events asked: only errors and hang-ups come
        return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno (captured), no poll()
        return False


def _delete_temporary(broker: Any, topic: str, group: str) -> None:
    """Nothing of a console group is left (positions, dead letters, settings)."""
    import redis

    from redisq.errors import RedisqError
    from redisq.protocol.groups import group_exists

    try:
        if broker.run(group_exists(broker.keys, topic, group)):
            broker.delete_group(topic, group, force=True)
    except (RedisqError, redis.RedisError) as exc:
        warn(f"redisq: could not delete the temporary group {group}: {exc}")
