"""One run of a fault scenario: its history directory, the processes it started (stopped by pid
at the end, whatever happened), the topic as stored, and the checks.

    with Run(tmp_path, url, namespace) as run:
        producer = run.producer("A", options={...})
        consumer = run.consumer("c1")
        ...
        run.finish_workers()
        results = run.check(broker, TOPIC)
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import redisq
from tests.history import checker
from tests.history.checker import History, Stored
from tests.history.faults import Driver, WorkerProcess, wait_until
from tests.history.proxy import Proxy
from tests.history.recorder import Tail
from tests.servers import ServerProcess

TOPIC = "orders"
GROUP = "g"
# Drains and recoveries get this long (generous: the machine has 2 shared cores); a healthy run
# takes a few seconds. A test that fails waits this long once.
DRAIN_S = float(os.environ.get("REDISQ_HISTORY_DRAIN_S", "30"))
# Producers in the scenarios use delivery_timeout_ms=30000 (PRODUCER): a flush after the faults
# must be done within that plus a margin.
FLUSH_S = 45.0
PRODUCER = {"max_batch_messages": 50, "linger_ms": 2, "delivery_timeout_ms": 30_000}


def new_namespace() -> str:
    return f"h{uuid.uuid4().hex[:10]}"


class Run:
    def __init__(
        self,
        directory: Path,
        url: str,
        namespace: str | None = None,
        *,
        time_url: str | None = None,
        servers: Iterable[ServerProcess] = (),
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = url
        self.time_url = time_url
        self.namespace = namespace or new_namespace()
        self.servers = list(servers)
        self.proxies: list[Proxy] = []
        self.workers: dict[str, WorkerProcess] = {}
        plain = (time_url or url).startswith(("redis://", "rediss://"))
        self.driver = Driver(self.dir / "driver.jsonl", (time_url or url) if plain else None)
        self.tail = Tail(self.dir)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    # -- processes -------------------------------------------------------------------------------
    def _spawn(self, role: str, proc: str, url: str | None, extra: list[str]) -> WorkerProcess:
        assert proc not in self.workers, f"{proc} already started"
        history = self.dir / f"{proc}.jsonl"
        args = [role, "--url", url or self.url, "--namespace", self.namespace, "--topic", TOPIC]
        args += ["--history", str(history), "--proc", proc]
        time_url = self.time_url or (self.url if url else None)
        if time_url:
            args += ["--time-url", time_url]
        worker = WorkerProcess(proc, args + extra, history)
        self.workers[proc] = worker
        return worker

    def producer(
        self,
        proc: str,
        *,
        name: str | None = None,
        options: dict[str, Any] | None = None,
        url: str | None = None,
        wait: bool = True,
    ) -> WorkerProcess:
        """A producer instance `proc` (wait: until its init_done is recorded)."""
        extra = ["--options", json.dumps(options or {})]
        if name:
            extra += ["--name", name]
        worker = self._spawn("producer", proc, url, extra)
        if wait:
            self.wait(lambda: self.count("init_done", proc) > 0 or not worker.alive(), 60,
                      f"{proc} to start")  # fmt: skip
            assert worker.alive(), f"producer {proc} exited with {worker.popen.poll()}"
        return worker

    def consumer(
        self,
        proc: str,
        *,
        options: dict[str, Any] | None = None,
        url: str | None = None,
        work_ms: float = 2.0,
        wait: bool = True,
    ) -> WorkerProcess:
        """A member `proc` of group GROUP (wait: until its consumer has joined)."""
        opts = {"lease_ttl_ms": 1500, "batch_size": 20, "ack_interval_ms": 20, **(options or {})}
        extra = ["--group", GROUP, "--options", json.dumps(opts), "--work-ms", str(work_ms)]
        worker = self._spawn("consumer", proc, url, extra)
        if wait:
            self.wait(lambda: self.count("consumer_ready", proc) > 0 or not worker.alive(), 60,
                      f"{proc} to join")  # fmt: skip
            assert worker.alive(), f"consumer {proc} exited with {worker.popen.poll()}"
        return worker

    def proxy(self, target_port: int) -> Proxy:
        proxy = Proxy(target_port).start()
        self.proxies.append(proxy)
        return proxy

    def finish_workers(self, procs: Iterable[str] | None = None) -> None:
        for proc in list(procs if procs is not None else self.workers):
            worker = self.workers[proc]
            if worker.alive():
                self.driver.finish(worker)

    def cleanup(self) -> None:
        """Stop everything this run started, by pid: workers, proxies, servers."""
        for worker in self.workers.values():
            try:
                worker.finish(timeout=10)
            except Exception:  # keep stopping the others
                worker.popen.kill()
        for proxy in self.proxies:
            proxy.stop()
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                os.kill(server.pid, signal.SIGCONT)
            server.stop()
        self.driver.close()

    # -- the history ------------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        self.tail.poll()
        return self.tail.events

    def count(self, ev: str, proc: str | None = None) -> int:
        events = self.events()
        return sum(1 for e in events if e["ev"] == ev and (proc is None or e["proc"] == proc))

    def handled(self) -> set[tuple[int, str]]:
        return {(e["partition"], e["offset"]) for e in self.events() if e["ev"] == "handle_end"}

    def wait(self, condition: Callable[[], object], timeout: float, what: str) -> float:
        return wait_until(condition, timeout, what)

    def wait_acked(self, proc: str, count: int, timeout: float = DRAIN_S) -> None:
        self.wait(lambda: self.count("send_ok", proc) >= count, timeout,
                  f"{count} acknowledged sends of {proc}")  # fmt: skip

    def wait_handled(self, count: int, proc: str | None = None, timeout: float = DRAIN_S) -> None:
        self.wait(lambda: self.count("handle_end", proc) >= count, timeout,
                  f"{count} handled by {proc or 'anyone'}")  # fmt: skip

    def wait_all_handled(self, stored: list[Stored], timeout: float = DRAIN_S) -> bool:
        """Wait until every stored message (of the history's producers) has been handled; False
        after the deadline (all_handled then names what is missing)."""
        history = History(self.events())
        wanted = {(s.partition, s.offset) for s in history.known(stored)}
        try:
            self.wait(lambda: wanted <= self.handled(), timeout, "every message handled")
        except AssertionError:
            return False
        return True

    def wait_streams(self, procs: Iterable[str], timeout: float = DRAIN_S) -> None:
        """Until each producer's stream has ended (its count invoked, or stopped by an error)."""
        for proc in procs:
            self.wait(partial(self.ended, proc), timeout, f"the stream of {proc} to end")

    def wait_delivered(self, topic: str = TOPIC, timeout: float = DRAIN_S) -> None:
        """Until the topic's schedules are empty (describe_topic's total_scheduled): every
        delayed message stored has been appended to its partition (a delivery appends a message
        and removes it from its schedule in one script). Something must deliver: a consumer of
        the topic, or a producer that sent delayed messages to it, while it runs."""
        with redisq.connect(self.url, namespace=self.namespace) as broker:
            self.wait(lambda: broker.describe_topic(topic).total_scheduled == 0, timeout,
                      f"every delayed message of {topic} to be delivered")  # fmt: skip

    def ended(self, proc: str) -> bool:
        return self.count("stream_end", proc) > 0

    def close_producers(self, procs: Iterable[str], timeout: float = FLUSH_S) -> list[str]:
        """Stop each producer's stream, flush and close it; returns what went wrong. Once the
        faults are over every send must resolve (acknowledged or failed) within its delivery
        timeout (30 s in these scenarios): a flush that does not finish within `timeout` is a
        liveness failure the scenario reports (and the producer is then left to be stopped)."""
        problems = []
        going = list(procs)
        for op in ("stop", "flush", "close"):  # each op on every producer at once
            for proc in going:
                self.workers[proc].start_command(op, timeout_s=timeout)
            for proc in list(going):
                reply = self.workers[proc].wait_reply(op, timeout + 30)
                if "error" in reply:
                    problems.append(f"{proc} {op}: {reply['error']}: {reply.get('message')}")
                    going.remove(proc)
        return problems

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for e in self.events():
            counts[e["ev"]] = counts.get(e["ev"], 0) + 1
        keys = ("send_invoke", "send_ok", "send_fail", "handle_end", "fault")
        return ", ".join(f"{k}={counts.get(k, 0)}" for k in keys)

    def history(self) -> History:
        return History(self.events())

    def check(
        self,
        stored: list[Stored],
        properties: Iterable[str] = checker.ALL,
        *,
        foreign_ok: bool = False,
        lost_before: float | None = None,
    ) -> dict[str, list[str]]:
        results = checker.check(
            self.history(), stored, properties, foreign_ok=foreign_ok, lost_before=lost_before
        )
        summary = {name: len(v) for name, v in results.items()}
        print(f"\nhistory {self.dir}: {self.summary()}; violations {summary}")
        return results


def read_partition(broker: redisq.Broker, partition: int, topic: str = TOPIC) -> list[Stored]:
    """Every entry of one partition (broker.read), in offset order, key and value as text."""
    return [
        Stored(
            partition,
            message.offset,
            message.key.decode(errors="backslashreplace") if message.key else None,
            message.value.decode(errors="backslashreplace"),
        )
        for message in broker.read(topic, partition)
    ]


def read_stored(broker: redisq.Broker, topic: str = TOPIC) -> list[Stored]:
    """Every entry of every partition."""
    stored = []
    for p in range(broker.topic_config(topic, refresh=True).partitions):
        stored += read_partition(broker, p, topic)
    return stored


def assert_no_violations(results: dict[str, list[str]], extra: list[str] | None = None) -> None:
    """One assertion for everything a scenario checked, so every broken property is reported."""
    text = checker.report(results)
    if extra:
        text = "\n".join([*(f"scenario: {line}" for line in extra), text]).strip()
    assert not text, "\n" + text
