"""docker/: no Docker engine runs here, so the deployment is checked in two ways.

1. The compose files are parsed: every service, port, file, volume and command they name exists
   and agrees with the config files (a port published for a service is the port its config
   listens on; a config file a command names is mounted; the redisq image's commands parse).
2. redis-server and valkey-server are started with the very config files in docker/ (only port,
   bind, dir and logfile overridden on the command line) and redisq runs against them: a
   primary, a replica (--replicaof, as compose does), a Sentinel from docker/sentinel.conf, and
   a three-node cluster from docker/cluster.conf.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import redisq
from tests.replication import SentinelProcess, wait_for
from tests.servers import ServerProcess, binary_for, cluster_free_port, valkey_binary

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE_FILES = ["compose.yaml", "compose.cluster.yaml"]
TOPIC = "orders"


def with_config_file(
    binary: str, name: str, extra: dict[str, str] | None = None, port: int | None = None
) -> ServerProcess:
    """A server from docker/<name>: nothing but port, bind, dir and logfile (and `extra`, as a
    compose command line would add) is given on the command line."""
    server = ServerProcess(binary, port=port, config_file=str(DOCKER / name))
    server.config = dict(extra or {})  # no test defaults (save "", appendonly no)
    return server.start()


def config_get(server: ServerProcess, name: str) -> str:
    with server.client(decode_responses=True) as client:
        return str(client.config_get(name)[name])


def conf_directives(name: str) -> dict[str, str]:
    directives = {}
    for line in (DOCKER / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            directives.setdefault(key, value.strip())
    return directives


@pytest.fixture
def namespace() -> str:
    return f"k{uuid.uuid4().hex[:10]}"


# -- 1. the compose files ---------------------------------------------------------------------


def load_compose(name: str) -> dict[str, Any]:
    document = yaml.safe_load((DOCKER / name).read_text())
    assert isinstance(document, dict) and document.get("services"), name
    return document


def interpolate(text: str) -> str:
    """Compose's ${VAR:-default} with no VAR set."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def service_argv(service: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for field in ("entrypoint", "command"):
        value = service.get(field)
        if isinstance(value, str):
            argv += value.split()
        elif value:
            argv += [interpolate(str(v)) for v in value]
    return argv


def volume_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts.append((str(volume["source"]), str(volume["target"])))
        else:
            source, target = str(volume).split(":")[:2]
            mounts.append((source, target))
    return mounts


@pytest.mark.parametrize("compose_file", COMPOSE_FILES)
def test_compose_names_only_things_that_exist(compose_file: str) -> None:
    document = load_compose(compose_file)
    services: dict[str, dict[str, Any]] = document["services"]
    named_volumes = set(document.get("volumes") or {})
    built_images = {
        s["image"] for s in services.values() if "build" in s and "image" in s
    }  # images this file builds itself
    host_ports: list[str] = []
    for name, service in services.items():
        assert "image" in service or "build" in service, f"{name}: no image and no build"
        if "build" in service:
            build = service["build"]
            context = DOCKER / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: build context {context} missing"
            dockerfile = context / (
                "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            )
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        elif "redisq" in str(service["image"]):
            assert service["image"] in built_images, f"{name}: image {service['image']} not built"

        mounts = volume_mounts(service)
        for source, _target in mounts:
            if source.startswith((".", "/")):
                assert (DOCKER / source).exists(), f"{name}: {source} missing"
            else:
                assert source in named_volumes, f"{name}: volume {source} not declared"

        depends = service.get("depends_on") or []
        for other in depends if isinstance(depends, list) else depends.keys():
            assert other in services, f"{name}: depends on unknown service {other}"

        # A config file named on the command line is mounted, and its port is the one published.
        argv = service_argv(service)
        mounted = {target: source for source, target in mounts}
        listen_port = None
        for arg in argv:
            if arg.endswith(".conf"):
                conf = arg if arg in mounted else None
                if conf is None:  # copied first (sentinel): the copy's source is mounted
                    conf = next(t for t in mounted if t.endswith(Path(arg).name))
                source = DOCKER / mounted[conf]
                assert source.is_file(), f"{name}: {source} missing"
                listen_port = conf_directives(source.name).get("port")
        for port in service.get("ports", []):
            parts = str(port).split(":")
            assert len(parts) in (2, 3), f"{name}: port {port}"
            assert parts[-1].isdigit() and parts[-2].isdigit(), f"{name}: port {port}"
            if listen_port is not None:
                assert parts[-1] == listen_port, (
                    f"{name}: publishes {parts[-1]}, listens {listen_port}"
                )
            host_ports.append(parts[-2])
        for arg in argv:
            if arg.startswith("redis-node-") or arg.startswith(("redis-primary", "sentinel-")):
                host = arg.split(":")[0]
                assert host in services, f"{name}: names unknown host {host}"

        env = service.get("environment") or {}
        url = env.get("REDIS_URL") if isinstance(env, dict) else None
        if url:
            hosts = re.sub(r"^[a-z+]+://", "", url).split("/")[0]
            for host in hosts.split(","):
                assert host.split(":")[0] in services, f"{name}: REDIS_URL names {host}"
    assert len(host_ports) == len(set(host_ports)), f"host ports published twice: {host_ports}"


@pytest.mark.parametrize("compose_file", COMPOSE_FILES)
def test_compose_redisq_commands_parse(compose_file: str) -> None:
    from redisq.cli import build_parser

    parser = build_parser()
    for name, service in load_compose(compose_file)["services"].items():
        if "redisq" not in str(service.get("image", "")) or "entrypoint" in service:
            continue
        command = [str(c) for c in service.get("command", [])]
        try:
            parser.parse_args(command)
        except SystemExit:
            raise AssertionError(f"{name}: `redisq {' '.join(command)}` does not parse") from None


def test_dockerfile_copies_what_exists() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert 'pip install ".[spark]"' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^spark = \[", pyproject, re.MULTILINE)
    assert 'ENTRYPOINT ["redisq"]' in text


def test_config_files_say_what_the_readme_promises() -> None:
    for name in ("redis.conf", "cluster.conf"):
        directives = conf_directives(name)
        assert directives["appendonly"] == "yes"
        assert directives["maxmemory-policy"] == "noeviction"
        assert directives["appendfsync"] in ("always", "everysec", "no")
    assert conf_directives("cluster.conf")["cluster-enabled"] == "yes"
    compose = (DOCKER / "compose.yaml").read_text()
    assert "--appendfsync" in compose and "${REDIS_APPENDFSYNC:-everysec}" in compose


# -- 2. servers started from the very config files ---------------------------------------------


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_primary_replica_and_sentinel_from_docker_configs(kind: str, namespace: str) -> None:
    binary = binary_for(kind)
    primary = with_config_file(binary, "redis.conf")
    replica = sentinel = None
    try:
        assert config_get(primary, "appendonly") == "yes"
        assert config_get(primary, "appendfsync") == "everysec"
        assert config_get(primary, "maxmemory-policy") == "noeviction"
        replica = with_config_file(binary, "redis.conf", {"replicaof": f"127.0.0.1 {primary.port}"})
        wait_for(
            lambda: replica.client().info("replication")["master_link_status"] == "up",
            what="the replica",
        )
        sentinel = SentinelProcess(binary, primary, template=DOCKER / "sentinel.conf").start()
        wait_for(sentinel.knows_replica, what="the sentinel to see the replica")
        url = f"redis+sentinel://{sentinel.address}/{sentinel.service}"
        with redisq.connect(url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=4)
            acks = "replicas"
            with broker.producer(acks=acks, max_batch_messages=100) as producer:
                futures = [
                    producer.send_async(TOPIC, b"m%d" % i, key=b"k%d" % (i % 20))
                    for i in range(2000)
                ]
                producer.flush(timeout=60)
            assert all(f.exception(timeout=0) is None for f in futures)
            # Messages as a user counts them (the topic's default format: XLEN counts entries).
            assert broker.describe_topic(TOPIC).total_messages == 2000
        # acks="replicas" waited for the replica: every message is read back through it.
        sent = sorted(b"m%d" % i for i in range(2000))
        with redisq.connect(replica.url, namespace=namespace) as on_replica:
            assert on_replica.describe_topic(TOPIC).total_messages == 2000
            assert sorted(m.value for p in range(4) for m in on_replica.read(TOPIC, p)) == sent
    finally:
        for process in (sentinel, replica, primary):
            if process is not None:
                process.stop()


def test_appendfsync_override_and_acks_fsync(namespace: str) -> None:
    server = with_config_file(valkey_binary(), "redis.conf", {"appendfsync": "always"})
    try:
        assert config_get(server, "appendfsync") == "always"  # as compose's REDIS_APPENDFSYNC
        with redisq.connect(server.url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=2)
            with broker.producer(acks="fsync") as producer:
                metas = [producer.send(TOPIC, b"m%d" % i, key=b"k") for i in range(20)]
        assert len({m.offset for m in metas}) == 20
    finally:
        server.stop()


@pytest.mark.fault
def test_noeviction_refuses_writes_and_keeps_data(namespace: str) -> None:
    server = with_config_file(valkey_binary(), "redis.conf")
    try:
        with redisq.connect(server.url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=1)
            with broker.producer() as producer:
                for i in range(200):
                    producer.send_async(TOPIC, b"x" * 1000, key=b"k%d" % i)
            used = int(server.client().info("memory")["used_memory"])
            server.client().config_set("maxmemory", used + 64 * 1024)
            with broker.producer(delivery_timeout_ms=1500) as producer:
                with pytest.raises(redisq.DeliveryTimeout, match="OOM"):
                    for _ in range(5000):
                        producer.send(TOPIC, b"y" * 10_000, key=b"k")
            server.client().config_set("maxmemory", 0)
            kept = [m.value for m in broker.read(TOPIC, 0)]
        assert kept[:200] == [b"x" * 1000] * 200  # nothing evicted
    finally:
        server.stop()


@pytest.fixture
def docker_cluster() -> Iterator[list[ServerProcess]]:
    """Three primaries from docker/cluster.conf (valkey-server), slots split in three."""
    nodes: list[ServerProcess] = []
    try:
        for _ in range(3):
            nodes.append(
                with_config_file(valkey_binary(), "cluster.conf", port=cluster_free_port())
            )
        for i, node in enumerate(nodes):
            first, last = i * 5461, 16383 if i == 2 else i * 5461 + 5460
            with node.client() as client:
                assert config_get(node, "cluster-enabled") == "yes"
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        with nodes[0].client() as client:
            for node in nodes[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)

        def ready() -> bool:
            for node in nodes:
                with node.client() as client:
                    info = client.execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info or "cluster_known_nodes:3" not in info:
                    return False
            return True

        wait_for(ready, what="the cluster")
        time.sleep(0.2)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_cluster_from_docker_config(docker_cluster: list[ServerProcess], namespace: str) -> None:
    url = f"redis+cluster://127.0.0.1:{docker_cluster[0].port}"
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=12)
        assert {p.node for p in broker.describe_topic(TOPIC).partitions} == {
            f"127.0.0.1:{n.port}" for n in docker_cluster
        }
        with broker.producer(max_batch_messages=100) as producer:
            futures = [
                producer.send_async(TOPIC, b"m%d" % i, key=b"k%d" % (i % 100)) for i in range(3000)
            ]
            producer.flush(timeout=60)
        assert all(f.exception(timeout=0) is None for f in futures)
        values = [m.value for p in range(12) for m in broker.read(TOPIC, p)]
        assert sorted(values) == sorted(b"m%d" % i for i in range(3000))
        try:
            for key in broker.client.scan_iter(match=broker.keys.pattern(), count=1000):
                broker.client.delete(key)
        except redis.RedisError:
            pass
