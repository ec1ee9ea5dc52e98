"""A concurrent-mode member in its own process (tests/consume/test_concurrent_member_faults.py):
every handled message is pushed as "<member> <partition> <offset>" onto the test's list."""

from __future__ import annotations

import signal
import sys
import threading
import time

import redisq


def main(url: str, namespace: str, name: str) -> int:
    broker = redisq.connect(url, namespace=namespace)
    events = f"{namespace}:test-events"
    client = broker.client

    def handle(message: redisq.Message) -> None:
        time.sleep(0.01)
        client.rpush(events, f"{name} {message.partition} {message.offset}")

    consumer = broker.consumer(
        "t", "g", name, mode="concurrent", lease_ttl_ms=1500, claim_idle_ms=500, batch_size=10
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    runner = threading.Thread(target=consumer.run, args=(handle,), daemon=True)
    runner.start()
    while not stop.is_set() and runner.is_alive():
        stop.wait(0.1)
    consumer.close()
    runner.join(10)
    broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
