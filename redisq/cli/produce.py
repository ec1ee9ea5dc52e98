"""`redisq produce`: lines in, one message per line; message ids from the input, so that a
re-run stores nothing twice."""

from __future__ import annotations

import hashlib
import json
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any

import click

from redisq.cli.common import (
    FAILED,
    INTERRUPTED,
    OK,
    Progress,
    connect,
    connection_options,
    plural,
    warn,
)
from redisq.cli.messages import StopRequest
from redisq.errors import MessageTooLarge

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # the producer's default
MAX_MESSAGE_BYTES_LIMIT = 512 << 20  # Redis's largest bulk string


def _parse_headers(values: Iterable[str]) -> dict[str, str]:
    headers = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r}: expected NAME=VALUE", param_hint="--header")
        headers[name] = value
    return headers


class LineRefused(Exception):
    """One input line that cannot be sent; the message says why (its number is added)."""


class MessageIdSource(click.ParamType):
    """--message-id field:NAME | key | hash: where each line's message id comes from, so that
    sending the same input again stores nothing twice."""

    name = "field:NAME|key|hash"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        kind, sep, field = str(value).partition(":")
        if kind in ("key", "hash") and not sep:
            return (kind, "")
        if kind == "field" and field:
            return (kind, field)
        self.fail(f"{value!r}: expected field:NAME, key or hash", param, ctx)


def message_id_of(source: tuple[str, str], line: bytes, key: bytes | None, value: bytes) -> str:
    """The message id of one line (LineRefused when the line has none)."""
    kind, field = source
    if kind == "hash":  # the whole line, key and value: identical lines are one message
        return hashlib.sha256(line).hexdigest()[:32]
    if kind == "key":
        if not key:
            raise LineRefused("no key for --message-id key")
        return key.decode("utf-8", errors="surrogateescape")
    try:
        record = json.loads(value)
    except ValueError:
        raise LineRefused(f"not a JSON object (--message-id field:{field})") from None
    found = record.get(field) if isinstance(record, dict) else None
    if isinstance(found, bool) or not isinstance(found, str | int) or found == "":
        raise LineRefused(f"no string or integer field {field!r} for the message id")
    return str(found)


@dataclass
class Tally:
    """What became of the lines: written (acknowledged), duplicates skipped, failed."""

    written: int = 0
    duplicates: int = 0
    failed: int = 0

    def settle(self, futures: list[Any]) -> None:
        for future in futures:
            error = future.exception()
            if error is not None:
                self.failed += 1
                warn(f"redisq: {type(error).__name__}: {error}")
            elif future.result().duplicate:
                self.duplicates += 1
            else:
                self.written += 1
        futures.clear()

    def __str__(self) -> str:
        return (
            f"{self.written:,} written, {plural(self.duplicates, 'duplicate')} skipped, "
            f"{self.failed:,} failed"
        )


@click.command("produce")
@click.argument("topic")
@click.option(
    "--file",
    "-f",
    "path",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Read the lines from this file (default: stdin).",
)
@click.option(
    "--key-separator",
    metavar="SEP",
    help="Split each line at the first SEP into key and value (kafka-console-producer's "
    "parse.key); a line without SEP is an error.",
)
@click.option(
    "--header",
    "headers",
    multiple=True,
    metavar="NAME=VALUE",
    help="A header on every message (repeatable).",
)
@click.option(
    "--message-id",
    "message_id",
    type=MessageIdSource(),
    metavar="field:NAME|key|hash",
    help="Take each message's id from the input, so that a re-run stores nothing twice: "
    "field:NAME (a field of the line's JSON object), key (the key, with --key-separator) or "
    "hash (a SHA-256 of the line: identical lines are one message). Implies --idempotence "
    "message_id.",
)
@click.option(
    "--idempotence",
    type=click.Choice(["sequence", "message_id", "none"]),
    help="Producer idempotence mode (default: message_id with --message-id, else sequence; "
    "message_id needs --message-id).",
)
@click.option(
    "--acks",
    type=click.Choice(["leader", "replicas", "fsync"]),
    default="leader",
    show_default=True,
    help="When a message counts as written.",
)
@click.option("--producer-name", help="Name the producer (fences older instances of it).")
@click.option(
    "--delay-ms",
    type=click.IntRange(min=1),
    help="Deliver every message this many ms after it is stored (delayed messages; a consumer "
    "of the topic, the producer or `redisq scheduler` appends them when due).",
)
@click.option(
    "--max-message-bytes",
    type=click.IntRange(1, MAX_MESSAGE_BYTES_LIMIT),
    default=DEFAULT_MAX_MESSAGE_BYTES,
    show_default=True,
    help="The largest message (key, value and headers); a longer line fails, naming its number.",
)
@click.option(
    "--progress",
    is_flag=True,
    help="A progress bar shows on a terminal; with --progress, elsewhere (a log, a pipe) one "
    "summary line at the end.",
)
@connection_options
def produce(
    topic: str,
    path: str | None,
    key_separator: str | None,
    headers: tuple[str, ...],
    message_id: tuple[str, str] | None,
    idempotence: str | None,
    acks: str,
    producer_name: str | None,
    delay_ms: int | None,
    max_message_bytes: int,
    progress: bool,
) -> int:
    """Send lines from stdin (or --file) to TOPIC, one message per line. SIGINT, SIGTERM and
    SIGHUP stop reading; what was sent is then flushed and counted, and it exits 130."""
    mode = _idempotence(message_id, idempotence, key_separator)
    separator = key_separator.encode() if key_separator else None
    static_headers = _parse_headers(headers)
    total = None
    if path and path != "-":
        with open(path, "rb") as counting:
            total = sum(1 for _ in counting)
    tally = Tally()
    number = 0
    with connect() as broker:
        broker.topic_config(topic, refresh=True)  # TopicNotFound before reading anything
        source: IO[bytes] = open(path, "rb") if path and path != "-" else sys.stdin.buffer  # noqa: SIM115
        meter = Progress(f"produce {topic}", total, force=progress)
        stop = StopRequest(interrupt_reads=True)
        try:
            with (
                stop.installed(),
                broker.producer(
                    name=producer_name,
                    idempotence=None if mode == "none" else mode,
                    acks=acks,
                    max_message_bytes=max_message_bytes,
                    max_batch_bytes=max(max_message_bytes, 1 << 20),
                ) as producer,
            ):
                futures: list[Any] = []
                lines = iter(source)
                while (raw := stop.next_or_none(lines)) is not None:
                    number += 1
                    meter.update()
                    line = raw.rstrip(b"\r\n")
                    try:
                        key, value = _split(line, separator, key_separator)
                        mid = (
                            None
                            if message_id is None
                            else message_id_of(message_id, line, key, value)
                        )
                        futures.append(
                            producer.send_async(
                                topic,
                                value,
                                key or None,
                                static_headers or None,
                                message_id=mid,
                                delay_ms=delay_ms,
                            )
                        )
                    except (LineRefused, MessageTooLarge) as exc:
                        tally.failed += 1
                        warn(f"redisq: line {number:,}: {_why_refused(exc)}")
                        continue
                    if len(futures) >= 10_000:
                        tally.settle(futures)
                producer.flush()
                tally.settle(futures)
        finally:
            if source is not sys.stdin.buffer:
                source.close()
            meter.close()
    if stop.signal is not None:
        name = signal.Signals(stop.signal).name
        warn(
            f"redisq: stopped by {name} after line {number:,} (later lines were not read): {tally}"
        )
        return INTERRUPTED
    warn(str(tally))
    return FAILED if tally.failed else OK


def _why_refused(exc: Exception) -> str:
    if isinstance(exc, MessageTooLarge):
        return f"MessageTooLarge: {exc} (--max-message-bytes raises the limit)"
    return str(exc)


def _idempotence(
    message_id: tuple[str, str] | None, idempotence: str | None, key_separator: str | None
) -> str:
    """The producer's idempotence mode. message_id mode without ids from the input would give
    every line a fresh id on every run: a re-run would store everything again and report no
    duplicate, so it is refused."""
    if message_id is None:
        if idempotence == "message_id":
            raise click.UsageError(
                "--idempotence message_id needs --message-id field:NAME, key or hash (the ids "
                "of a re-run must be the same ids for duplicates to be skipped)"
            )
        return idempotence or "sequence"
    if idempotence not in (None, "message_id"):
        raise click.UsageError(f"--message-id needs --idempotence message_id, not {idempotence}")
    if message_id[0] == "key" and key_separator is None:
        raise click.UsageError("--message-id key needs --key-separator")
    return "message_id"


def _split(
    line: bytes, separator: bytes | None, key_separator: str | None
) -> tuple[bytes | None, bytes]:
    if separator is None:
        return None, line
    if separator not in line:
        raise LineRefused(f"no key separator {key_separator!r}")
    key, value = line.split(separator, 1)
    return key, value
