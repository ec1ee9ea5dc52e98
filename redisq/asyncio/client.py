"""Opening a redis.asyncio client for a url, and the asyncio executor of protocol steps.

The same rules as the sync API (redisq.connection): the url, else REDIS_URL, else the embedded
valkey-server; a cluster by scheme or detected; Sentinel urls; bytes replies; redis-py's
automatic retries off (redisq retries itself, with the recovery each call needs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisClusterException, ResponseError

from redisq import connection
from redisq.errors import from_reply
from redisq.protocol import Command, ScriptCall, Step, Steps
from redisq.protocol.resp import decode_bulks
from redisq.scripts import Script, is_fake, node_name, pack, primaries, script_names

T = TypeVar("T")


def _no_retries() -> Retry:
    return Retry(NoBackoff(), 0)


async def open_client(url: str, **options: Any) -> Any:
    """A redis.asyncio client for url (see redisq.connection.open_client)."""
    options = connection.client_options(options)
    options["retry"] = _no_retries()
    kind, target = connection.url_kind(url)
    if kind == "sentinel":
        return await _open_sentinel(url, options)
    if kind == "cluster":
        return await _open_cluster(url, target, options)
    client = redis.asyncio.Redis.from_url(url, **options)
    try:
        info = await client.info("cluster")
    except redis.RedisError as exc:
        await client.aclose()
        raise connection.unreachable(url, exc) from None
    if info.get("cluster_enabled") in (1, "1"):
        await client.aclose()
        return await _open_cluster(url, url, options)
    return client


async def _open_cluster(url: str, cluster_url: str, options: dict[str, Any]) -> RedisCluster:
    client = RedisCluster.from_url(cluster_url, **options)
    try:
        await client.initialize()
    except (redis.RedisError, RedisClusterException) as exc:
        await client.aclose()
        raise connection.unreachable(url, exc) from None
    return client


async def _open_sentinel(url: str, options: dict[str, Any]) -> Any:
    from redis.asyncio.sentinel import Sentinel

    sentinels, service, sentinel_kwargs = connection.sentinel_parts(url, options)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **options)
    client = sentinel.master_for(service, redis_class=redis.asyncio.Redis, **options)
    try:
        await client.ping()
    except redis.RedisError as exc:
        await client.aclose()
        raise connection.unreachable(url, exc) from None
    return client


@contextlib.contextmanager
def closed_mid_write() -> Iterator[None]:
    """A write on a connection another task closed meanwhile, as the lost connection it is
    (redis.ConnectionError, which every caller already retries).

    redis.asyncio's RedisCluster disconnects every connection of every node, checked out or not,
    from whichever task meets its every `reinitialize_steps`-th MOVED (5 by default: dozens in a
    slot migration) or a CLUSTERDOWN: RedisCluster._execute_command calls self.aclose(), and
    ClusterNode.disconnect() sets each connection's writer to None (redis-py 8.1,
    redis/asyncio/cluster.py and Connection.disconnect in redis/asyncio/connection.py). A task
    that has just found its connection connected in send_packed_command (the command's write,
    or the handshake of a connection reconnecting) writes through asyncio.wait_for, which on
    Python 3.11 runs the write in a new task one loop iteration later; the writer is gone by
    then and redis-py lets AttributeError("'NoneType' object has no attribute 'writelines'")
    out. The write itself failed, so the command did not run on that connection. Only that
    exact error is converted; any other AttributeError is a bug and stays one."""
    try:
        yield
    except AttributeError as exc:
        if exc.name != "writelines" or exc.obj is not None:
            raise
        raise redis.ConnectionError("connection closed by another task before the write") from exc


async def resolve_url(url: str | None) -> tuple[str, bool]:
    """(url, embedded?): starting the embedded server blocks, so it runs in a thread."""
    return await asyncio.to_thread(connection.resolve_url, url)


class AsyncScripts:
    """The script registry of one asyncio broker, and the asyncio executor of protocol steps."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        shebang = not is_fake(client)
        self._scripts = {name: Script(name, shebang) for name in script_names()}

    def __getitem__(self, name: str) -> Script:
        return self._scripts[name]

    def pack(self, call: ScriptCall[Any]) -> bytes:
        """The call as one RESP EVALSHA command, for a connection written to directly."""
        return pack(self._scripts[call.script], call)

    async def load(self, name: str) -> None:
        script = self._scripts[name]
        with closed_mid_write():
            sha = await self._client.script_load(script.source)
        if isinstance(sha, bytes):
            sha = sha.decode()
        if sha != script.sha:  # pragma: no cover - would mean a SHA1 mismatch in the server
            raise RuntimeError(f"script {name}: server SHA {sha} != {script.sha}")

    async def call(
        self, name: str, keys: Sequence[str], args: Sequence[Any], *, topic: str = "?"
    ) -> Any:
        """EVALSHA; on NOSCRIPT load and run it again; our error replies come back typed."""
        script = self._scripts[name]
        try:
            with closed_mid_write():
                try:
                    return await self._client.evalsha(script.sha, len(keys), *keys, *args)
                except NoScriptError:
                    await self.load(name)
                    return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            mapped = from_reply(str(exc), topic)
            if mapped is None:
                raise
            raise mapped from None

    async def run(self, call: ScriptCall[T]) -> T:
        args = call.args
        if call.body_count:
            args = [*args, *decode_bulks(call.body, call.body_count)]
        return call.decode(await self.call(call.script, call.keys, args, topic=call.topic))

    async def execute(self, steps: Steps) -> Any:
        """As redisq.scripts.Scripts.execute: a step, or a list of steps pipelined."""
        if isinstance(steps, ScriptCall):
            return await self.run(steps)
        if isinstance(steps, Command):
            if steps.nodes == "primaries":
                return await self._on_primaries(steps)
            with closed_mid_write():
                reply = await self._client.execute_command(*steps.args)
            return steps.decode(reply)
        if not steps:
            return []
        if self._cluster and any(isinstance(step, ScriptCall) for step in steps):
            results: list[Any] = []
            for step in steps:  # a cluster pipeline refuses EVALSHA
                try:
                    results.append(await self.execute(step))
                except Exception as exc:
                    results.append(exc)
            return results
        replies = await self._raw_pipeline(steps)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            for i in missing:
                await self.load(steps[i].script)  # type: ignore[union-attr]
            again = await self._raw_pipeline([steps[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        results = []
        for step, reply in zip(steps, replies, strict=True):
            if isinstance(reply, ResponseError):
                topic = step.topic if isinstance(step, ScriptCall) else "?"
                results.append(from_reply(str(reply), topic) or reply)
            elif isinstance(reply, Exception):
                results.append(reply)
            else:
                results.append(step.decode(reply))
        return results

    async def _on_primaries(self, step: Command[Any]) -> dict[str, Any]:
        """As redisq.scripts.Scripts._on_primaries."""
        out: dict[str, Any] = {}
        for node in primaries(self._client, self._cluster):
            options = {} if node is None else {"target_nodes": node}
            try:
                with closed_mid_write():
                    reply = await self._client.execute_command(*step.args, **options)
                out[node_name(node)] = step.decode(reply)
            except (ResponseError, redis.ConnectionError, redis.TimeoutError) as exc:
                out[node_name(node)] = exc  # one node's answer, or that it gave none
        return out

    async def _raw_pipeline(self, steps: list[Step]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for step in steps:
            if isinstance(step, ScriptCall):
                args = step.args
                if step.body_count:
                    args = [*args, *decode_bulks(step.body, step.body_count)]
                pipe.evalsha(self._scripts[step.script].sha, len(step.keys), *step.keys, *args)
            else:
                pipe.execute_command(*step.args)
        with closed_mid_write():
            return list(await pipe.execute(raise_on_error=False))


async def run_operation(operation: Any, scripts: AsyncScripts) -> Any:
    """Drive a protocol operation (a generator of steps) with the asyncio executor."""
    try:
        steps = next(operation)
        while True:
            try:
                result = await scripts.execute(steps)
            except Exception as exc:
                steps = operation.throw(exc)
            else:
                steps = operation.send(result)
    except StopIteration as done:
        return done.value


async def stop_task(task: asyncio.Task[Any], grace_s: float, halt: Callable[[], None]) -> bool:
    """Stop a background task that close() has told to finish: it gets grace_s to end on its
    own; then halt() (which sets the flag its loop checks) and cancellations, again until it
    has ended. One cancellation is not enough: on Python 3.11 a wait_for() inside redis-py
    (or in the task) whose inner call has just completed returns its result and drops the
    cancel. Returns True if the task ended on its own. If the caller is cancelled meanwhile,
    the task is halted and cancelled before the cancellation goes on (not left running)."""
    try:
        done, _ = await asyncio.wait({task}, timeout=grace_s)
    except asyncio.CancelledError:
        halt()
        task.cancel()
        raise
    if done:
        return True
    halt()
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1)
    return False


async def await_expiring(call: Awaitable[T], expire: Callable[[], None]) -> T:
    """call (a round trip on the shared client: fencing, a new epoch, loading scripts) while
    expire() runs every 50 ms: a call blocked on a silent server (up to the client's socket
    timeout, 30 s) holds back no batch's delivery timeout (redisq.transport.call_expiring)."""
    task = asyncio.ensure_future(call)
    try:
        while not (await asyncio.wait({task}, timeout=0.05))[0]:
            expire()
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


async def wait_acknowledged(future: asyncio.Future[T], timeout: float | None) -> T:
    """A send's acknowledgement, waited for at most timeout seconds (a checked one, or None):
    TimeoutError as redisq.SendFuture.result raises it; the message is not given up."""
    if timeout is None:
        return await future
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except TimeoutError:
        if future.done():  # it came as the wait ended
            return future.result()
        raise TimeoutError(f"no acknowledgement within {timeout} s") from None


def settle_futures(
    futures: list[asyncio.Future[T]], error: BaseException | None, results: Callable[[], list[T]]
) -> None:
    """A finished batch's futures (message i's at position i): its error, or each its result."""
    if error is not None:
        for future in futures:
            if not future.done():
                future.set_exception(error)
        return
    for future, result in zip(futures, results(), strict=True):
        if not future.done():
            future.set_result(result)


async def single_flight(
    running: dict[Any, asyncio.Future[T]], key: Any, start: Callable[[], Awaitable[T]]
) -> T:
    """start()'s result, with one call per key under way at a time (in `running`), shared by
    every caller that asks meanwhile. Shielded: a cancelled caller does not cancel the others'
    call."""
    call = running.get(key)
    if call is None:
        call = running[key] = asyncio.ensure_future(start())

        def done(task: asyncio.Future[T]) -> None:
            if running.get(key) is task:
                del running[key]
            if not task.cancelled():
                task.exception()  # retrieved: every caller may have been cancelled

        call.add_done_callback(done)
    return await asyncio.shield(call)
