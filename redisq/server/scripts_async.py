"""Running the Lua scripts with EVALSHA (loading them again on NOSCRIPT), and the executor of
protocol steps (redisq.protocol) on one broker's client.

Our scripts' error replies come back as typed redisq errors (redisq.errors.from_reply, the one
place that maps them). A list of steps goes as one pipeline, except on Redis Cluster, whose
pipelines refuse EVALSHA: there the steps go one at a time.

A connection the server dropped (a restart, a proxy's idle timeout, CLIENT KILL) is recovered
from here, for everything redisq sends outside a producer's own rounds: redis-py's automatic
retry is off (connection.no_retries), so a step that meets a lost connection is sent once more
on a new one when sending it twice is safe (its `retry_safe`: reads, and every script whose
second run answers as its first did); otherwise, and when the new connection fails too, the
caller gets redisq.errors.ConnectionLost (a redis.ConnectionError), never redis-py's own.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.exceptions import NoScriptError, ResponseError

from redisq.errors import ConnectionLost, from_reply
from redisq.protocol import Atomic, Command, Operation, ScriptCall, Step, Steps
from redisq.protocol.resp import decode_bulks
from redisq.server.connection_async import closed_mid_write, drop_idle_connections, is_cluster
from redisq.server.lua import Script, is_fake, node_name, pack, primaries, script_names

T = TypeVar("T")
log = logging.getLogger("redisq.connection")


class AsyncScripts:
    """The script registry of one broker connection, and its executor of protocol steps."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cluster = is_cluster(client)
        shebang = not is_fake(client)
        self._scripts = {name: Script(name, shebang) for name in script_names()}

    def __getitem__(self, name: str) -> Script:
        return self._scripts[name]

    def pack(self, call: ScriptCall[Any]) -> bytes:
        """The call as one RESP EVALSHA command, for a connection written to directly."""
        return pack(self._scripts[call.script], call)

    async def load(self, name: str) -> None:
        """SCRIPT LOAD (on a cluster client, redis-py sends it to every primary); once more on a
        new connection after a lost one (loading twice is harmless)."""
        script = self._scripts[name]
        for attempt in (1, 2):
            try:
                with closed_mid_write():
                    sha = await self._client.script_load(script.source)
                break
            except redis.ConnectionError as exc:
                await self._lost(exc, again=attempt == 1, what=f"loading script {name}")
        if isinstance(sha, bytes):
            sha = sha.decode()
        if sha != script.sha:  # pragma: no cover - would mean a SHA1 mismatch in the server
            raise RuntimeError(f"script {name}: server SHA {sha} != {script.sha}")

    async def load_all(self) -> None:
        for name in self._scripts:
            await self.load(name)

    async def call(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Any],
        *,
        topic: str = "?",
        retry_safe: bool = True,
    ) -> Any:
        """EVALSHA now; on NOSCRIPT (a restarted or flushed server) load and run it again; on a
        lost connection, once more when retry_safe (see the module doc)."""
        for attempt in (1, 2):
            try:
                return await self._evalsha(name, keys, args, topic)
            except redis.ConnectionError as exc:
                await self._lost(exc, again=retry_safe and attempt == 1, what=f"script {name}")
        raise AssertionError("unreachable")

    async def _evalsha(
        self, name: str, keys: Sequence[str], args: Sequence[Any], topic: str
    ) -> Any:
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

    async def _lost(self, exc: redis.ConnectionError, *, again: bool, what: str) -> None:
        """A lost connection: every pooled one is suspect now (the server dropped them all, or
        went away), so they are closed; returns when the step may go once more, else raises
        ConnectionLost."""
        if isinstance(exc, ConnectionLost):
            raise exc
        await self._drop_connections()
        if not again:
            raise ConnectionLost(f"{what}: {type(exc).__name__}: {exc}") from exc
        log.debug("%s: connection lost (%s); sending it again on a new one", what, exc)

    async def _drop_connections(self) -> None:
        try:
            await drop_idle_connections(self._client)
        except Exception as exc:  # pragma: no cover - best effort: the next command reconnects
            log.debug("dropping the pooled connections failed: %s", exc)

    async def run(self, call: ScriptCall[T]) -> T:
        """Send a protocol call and decode its reply (see `call`). A pre-encoded body is sent as
        ordinary arguments (the producer's hot path writes pack() to its own connections)."""
        args = call.args
        if call.body_count:
            args = [*args, *decode_bulks(call.body, call.body_count)]
        reply = await self.call(
            call.script, call.keys, args, topic=call.topic, retry_safe=call.retry_safe
        )
        return call.decode(reply)

    async def run_operation(self, operation: Operation[T]) -> T:
        """Drive a protocol operation on this client (see run_steps)."""
        return await run_steps(operation, self.execute)

    async def execute(self, steps: Steps) -> Any:
        """Run protocol steps: a ScriptCall, a Command, or a list of them, pipelined (one round
        trip), whose results come back in order with the exception in place of a failed step's
        result."""
        if isinstance(steps, ScriptCall):
            return await self.run(steps)
        if isinstance(steps, Command):
            if steps.nodes == "primaries":
                return await self._on_primaries(steps)
            for attempt in (1, 2):
                try:
                    with closed_mid_write():
                        reply = await self._client.execute_command(*steps.args)
                    return steps.decode(reply)
                except redis.ConnectionError as exc:
                    again = steps.retry_safe and attempt == 1
                    await self._lost(exc, again=again, what=str(steps.args[0]))
            raise AssertionError("unreachable")
        if not steps:
            return []
        if isinstance(steps, Atomic) and self._cluster:
            return await self._in_order(steps)
        if self._cluster and any(isinstance(step, ScriptCall) for step in steps):
            results: list[Any] = []
            for step in steps:  # a cluster pipeline refuses EVALSHA: one at a time
                try:
                    results.append(await self.execute(step))
                except Exception as exc:
                    results.append(exc)
            return results
        replies = await self._pipeline_recovering(steps)  # Atomic: MULTI/EXEC, no NOSCRIPT
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:  # NOSCRIPT: those did not run; load them and send just those again
            for i in missing:
                await self.load(steps[i].script)  # type: ignore[union-attr]
            reloaded = await self._pipeline_recovering([steps[i] for i in missing])
            for i, reply in zip(missing, reloaded, strict=True):
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

    async def _in_order(self, steps: Atomic) -> list[Any]:
        """Atomic steps on a Cluster: one at a time, in order; a step on the key (the first) of
        a step that failed is not sent, its result that failure (a partition's later batch
        never lands before an earlier one)."""
        results: list[Any] = []
        failed: dict[str, Exception] = {}
        for step in steps:
            key = step.keys[0] if isinstance(step, ScriptCall) and step.keys else None
            if key is not None and key in failed:
                results.append(failed[key])
                continue
            try:
                results.append(await self.execute(step))
            except Exception as exc:
                results.append(exc)
                if key is not None:
                    failed[key] = exc
        return results

    async def _pipeline_recovering(self, steps: list[Step]) -> list[Any]:
        """The steps as one pipeline; after a lost connection once more when each of them is
        safe to send again (a pipeline fails as a whole: which steps ran is unknown)."""
        for attempt in (1, 2):
            try:
                replies = await self._raw_pipeline(steps)
            except redis.ConnectionError as exc:
                lost = exc
            else:
                # redis.asyncio's cluster pipeline hands a lost connection back in place of the
                # replies of the commands that went over it, where the others raise it.
                found = [r for r in replies if isinstance(r, redis.ConnectionError)]
                if not found:
                    return replies
                lost = found[0]
            again = attempt == 1 and all(step.retry_safe for step in steps)
            await self._lost(lost, again=again, what=f"a pipeline of {len(steps)} steps")
        raise AssertionError("unreachable")

    async def _on_primaries(self, step: Command[Any]) -> dict[str, Any]:
        """A command on every primary (Command.nodes "primaries"), one at a time."""
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
        """One round trip; Atomic steps inside MULTI/EXEC, their scripts sent whole (EVAL): a
        NOSCRIPT would fail one step and let the others through."""
        atomic = isinstance(steps, Atomic)
        pipe = self._client.pipeline(transaction=atomic)
        for step in steps:
            if isinstance(step, ScriptCall):
                args = step.args
                if step.body_count:
                    args = [*args, *decode_bulks(step.body, step.body_count)]
                script = self._scripts[step.script]
                if atomic:
                    pipe.eval(script.source, len(step.keys), *step.keys, *args)
                else:
                    pipe.evalsha(script.sha, len(step.keys), *step.keys, *args)
            else:
                pipe.execute_command(*step.args)
        with closed_mid_write():
            return list(await pipe.execute(raise_on_error=False))


async def run_steps(operation: Operation[T], execute: Callable[[Steps], Awaitable[Any]]) -> T:
    """Drive a protocol operation (a generator of steps; redisq.protocol.run_operation): each
    step goes to execute(), its result (or the exception it raised) back into the generator,
    until it returns."""
    try:
        steps = next(operation)
        while True:
            try:
                result = await execute(steps)
            except Exception as exc:
                steps = operation.throw(exc)
            else:
                steps = operation.send(result)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
