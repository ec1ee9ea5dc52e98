"""Producer and consumer processes that record their history:

    python -m tests.history.worker producer --url U --namespace NS --topic T --history F
        --proc P [--name N] [--options JSON] [--time-url U2]
    python -m tests.history.worker consumer --url U --namespace NS --topic T --history F
        --proc C --group G [--options JSON] [--work-ms MS] [--time-url U2]

Both use only redisq's public API. --time-url names the server whose TIME stamps the events
(default: --url; give a direct url when --url goes through a proxy). Broker connections use
socket_timeout=10 s unless --options says otherwise ("connect" key), so a cut-off connection
fails in bounded time.

The producer is one instance (instance id = --proc) driven by JSON commands on stdin, one per
line, each answered by one JSON line on stdout once done:
    {"op": "stream", "count": N|null, "rate": R, "keys": K, "delay_ms": D|null}   start
        sending in the background: send_async of N messages (null: until "stop") at about R per
        second, keys k0..k(K-1) in turn; values "<instance>:<n>" are unique in the run; with
        delay_ms, delayed sends (send_async(..., delay_ms=D): stored in the partition's
        schedule, appended when due)
    {"op": "stop"}                     stop the stream (answers how many it invoked)
    {"op": "send", "key": K, "count": N, "delay_ms": D|null}  send() N messages one by one
        (blocking); answers each message's outcome and how long send() took
    {"op": "flush", "timeout_s": S}    {"op": "close", "timeout_s": S}    {"op": "exit"}
The consumer runs consumer.run(handler) until SIGTERM; the handler records handle_start, sleeps
--work-ms, records handle_end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import redisq
from tests.history.recorder import Recorder, ServerClock


def _connect(args: argparse.Namespace, options: dict[str, Any]) -> redisq.Broker:
    connect_options = {"socket_timeout": 10, "socket_connect_timeout": 5}
    connect_options.update(options.pop("connect", {}))
    return redisq.connect(args.url, namespace=args.namespace, **connect_options)


def _error(exc: BaseException) -> dict[str, str]:
    return {"error": type(exc).__name__, "message": str(exc)[:500]}


class ProducerWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.inst = args.proc
        self.recorder = Recorder(args.history, args.proc)
        self.recorder.record("proc_start", pid=os.getpid())
        self.clock = ServerClock(args.time_url or args.url)
        options = json.loads(args.options or "{}")
        self.broker = _connect(args, options)
        self.producer = self.broker.producer(name=args.name, **options)
        self.recorder.record(
            "init_done",
            inst=self.inst,
            name=args.name,
            server_ms=self.clock.now_ms(),
            producer_id=getattr(self.producer, "producer_id", None),
            epoch=getattr(self.producer, "epoch", None),
        )
        self.seq = 0
        self.seq_lock = threading.Lock()
        self.stream_thread: threading.Thread | None = None
        self.stream_stop = threading.Event()
        self.streamed = 0

    def _next(self, key: str, delay_ms: int | None = None) -> tuple[str, int]:
        with self.seq_lock:
            n = self.seq
            self.seq += 1
        value = f"{self.inst}:{n}"
        delayed = {"delay_ms": delay_ms} if delay_ms is not None else {}
        self.recorder.record(
            "send_invoke",
            inst=self.inst,
            name=self.args.name,
            key=key,
            value=value,
            seq=n,
            **delayed,
        )
        return value, n

    def _ok(self, value: str, meta: redisq.RecordMetadata) -> None:
        delayed: dict[str, Any] = {}
        if meta.schedule_id is not None:  # a delayed send: offset None until it is delivered
            delayed = {"schedule_id": meta.schedule_id, "deliver_at_ms": meta.deliver_at_ms}
        self.recorder.record(
            "send_ok",
            inst=self.inst,
            value=value,
            partition=meta.partition,
            offset=meta.offset,
            dup=bool(meta.duplicate),
            **delayed,
        )

    def _fail(self, value: str, exc: BaseException) -> None:
        self.recorder.record("send_fail", inst=self.inst, value=value, **_error(exc))

    def _on_done(self, value: str) -> Any:
        def done(future: redisq.SendFuture) -> None:
            error = future.exception(timeout=0)
            if error is None:
                self._ok(value, future.result(timeout=0))
            else:
                self._fail(value, error)

        return done

    def _stream(self, count: int | None, rate: float, keys: int, delay_ms: int | None) -> None:
        """send_async at about `rate` per second, in ticks of 10 ms (delayed by delay_ms)."""
        per_tick = max(1, round(rate / 100))
        started = time.monotonic()
        sent = 0
        reason = "done"
        while not self.stream_stop.is_set() and (count is None or sent < count):
            for _ in range(per_tick):
                if count is not None and sent >= count:
                    break
                key = f"k{sent % keys}"
                value, _ = self._next(key, delay_ms)
                sent += 1
                try:
                    future = self.producer.send_async(
                        self.args.topic, value, key=key, delay_ms=delay_ms
                    )
                except (redisq.ProducerFenced, redisq.ProducerClosed) as exc:
                    self._fail(value, exc)
                    reason = type(exc).__name__
                    self.stream_stop.set()
                    break
                except Exception as exc:  # TopicNotFound while a topic is re-created, ...
                    self._fail(value, exc)
                    time.sleep(0.05)
                    continue
                future.add_done_callback(self._on_done(value))
            self.streamed = sent
            pause = started + sent / rate - time.monotonic()
            if pause > 0:
                self.stream_stop.wait(pause)
        self.recorder.record("stream_end", inst=self.inst, invoked=sent, reason=reason)

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "stream":
            self.stream_stop.clear()
            self.stream_thread = threading.Thread(
                target=self._stream,
                args=(
                    command.get("count"),
                    float(command.get("rate", 500)),
                    command["keys"],
                    command.get("delay_ms"),
                ),
                daemon=True,
            )
            self.stream_thread.start()
            return {}
        if op == "stop":
            self.stream_stop.set()
            if self.stream_thread is not None:
                self.stream_thread.join()
            return {"invoked": self.streamed}
        if op == "send":
            outcomes = []
            delay_ms = command.get("delay_ms")
            for _ in range(int(command.get("count", 1))):
                value, _ = self._next(command["key"], delay_ms)
                started = time.monotonic()
                outcome: dict[str, Any] = {"value": value}
                try:
                    meta = self.producer.send(
                        self.args.topic, value, key=command["key"], delay_ms=delay_ms
                    )
                except Exception as exc:
                    self._fail(value, exc)
                    outcome.update(_error(exc))
                else:
                    self._ok(value, meta)
                    outcome.update(offset=meta.offset, dup=meta.duplicate)
                outcome["elapsed"] = time.monotonic() - started
                outcomes.append(outcome)
            return {"outcomes": outcomes}
        if op in ("flush", "close"):
            try:
                getattr(self.producer, op)(timeout=command.get("timeout_s", 60))
            except Exception as exc:
                return _error(exc)
            return {}
        raise ValueError(f"unknown op {op!r}")

    def serve(self) -> None:
        for line in sys.stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            if command["op"] == "exit":
                break
            try:
                reply = {"done": command["op"], **self.handle(command)}
            except Exception as exc:
                reply = {"done": command["op"], **_error(exc)}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
        self.recorder.record("proc_exit")


def run_consumer(args: argparse.Namespace) -> None:
    recorder = Recorder(args.history, args.proc)
    recorder.record("proc_start", pid=os.getpid())
    clock = ServerClock(args.time_url or args.url)
    options = json.loads(args.options or "{}")
    broker = _connect(args, options)
    calls = iter(range(1 << 62))
    calls_lock = threading.Lock()
    work_s = args.work_ms / 1000

    def handle(message: redisq.Message) -> None:
        with calls_lock:
            call = next(calls)
        where = {"member": args.proc, "call": call, "partition": message.partition}
        where["offset"] = message.offset
        recorder.record(
            "handle_start",
            **where,
            key=message.key.decode(errors="backslashreplace") if message.key else None,
            value=message.value.decode(errors="backslashreplace"),
            attempt=message.attempt,
            server_ms=clock.now_ms(),
        )
        if work_s:
            time.sleep(work_s)
        recorder.record("handle_end", **where, server_ms=clock.now_ms())

    consumer = broker.consumer(args.topic, args.group, args.proc, **options)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    failure: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run(handle)
        except BaseException as exc:  # recorded: a consumer must not die on its own
            failure.append(exc)
            recorder.record("consumer_error", **_error(exc))

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    recorder.record("consumer_ready")
    while not stop.is_set() and runner.is_alive():
        stop.wait(0.1)
    consumer.close()
    runner.join(30)
    recorder.record("proc_exit")
    broker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["producer", "consumer"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--time-url")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--proc", required=True)
    parser.add_argument("--name")
    parser.add_argument("--group")
    parser.add_argument("--options")
    parser.add_argument("--work-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    level = logging.INFO if os.environ.get("REDISQ_TEST_VERBOSE") else logging.WARNING
    logging.basicConfig(level=level, format=f"{args.proc} %(asctime)s %(name)s: %(message)s")
    if args.role == "producer":
        ProducerWorker(args).serve()
    else:
        run_consumer(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
