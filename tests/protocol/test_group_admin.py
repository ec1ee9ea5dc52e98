"""Group administration on the broker, in both APIs, on every backend: list_groups,
describe_group, reset_offsets and delete_group (the protocol operations of
redisq.protocol.groups and redisq.protocol.offsets, driven by either broker).

Issue 37, item 1: an offset reset could return and then be undone. It checked for leases, read,
then wrote each position in separate steps; a member granted a partition in between kept the
old position it had loaded and wrote it back with its next commit. The tests hold the reset
between its checks and its writes (they drive its steps by hand) and have a member take the
lease, or take it, commit and leave, right there: the reset now fails with GroupInUse, and
never returns a reset that does not hold.

Issue 37, item 2: the lag of a start="latest" group on a partition none of its members had read
yet counted the whole partition (1,010 shown, 10 to read), in describe_group, `redisq lag`,
`redisq group describe`, the console and redisq_consumer_lag.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import redisq
import redisq.asyncio as rq
from redisq import cli, metrics
from redisq.errors import GroupInUse, GroupNotFound, TopicNotFound
from redisq.model.records import Message
from redisq.protocol import ScriptCall, Steps, run_operation
from redisq.protocol.group import GroupRef, acquire_lease, heartbeat, join_group
from redisq.protocol.offsets import reset_offsets
from redisq.protocol.transactions import InputPosition, apply_position
from redisq.server.scripts_async import run_steps
from tests.aio import Env, aio
from tests.aio import wait_until as async_wait_until
from tests.conftest import wait_until
from tests.console.test_metrics import parse, value

MEMBER = {"lease_ttl_ms": 10_000, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}


# -- helpers -------------------------------------------------------------------------------------
def send(broker: redisq.Broker, topic: str, values: list[str], partitions: int) -> None:
    with broker.producer() as producer:
        for i, v in enumerate(values):
            producer.send_async(topic, v.encode(), partition=i % partitions)
        producer.flush()


def read_all(
    broker: redisq.Broker, topic: str, group: str, *, at_most: int | None = None, **options: Any
) -> list[str]:
    """What a member of the group is handed until it has been idle for a second (or at_most
    messages), acked and committed."""
    got: list[Message] = []
    with broker.consumer(topic, group, **MEMBER, **options) as consumer:
        wait_until(lambda: bool(consumer.assignment), what="an assignment")
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 1.0 and (at_most is None or len(got) < at_most):
            want = 100 if at_most is None else at_most - len(got)
            batch = consumer.poll(timeout=0.2, max_messages=want)
            if batch:
                consumer.ack(batch)
                got += batch
                idle_since = time.monotonic()
        consumer.commit()
    return sorted(m.value.decode() for m in got)


def writes_positions(steps: Steps) -> bool:
    """The reset's write: reset_position.lua, alone or pipelined."""
    calls = steps if isinstance(steps, list) else [steps]
    return any(isinstance(s, ScriptCall) and s.script == "reset_position" for s in calls)


def leases_held(broker: redisq.Broker, topic: str, group: str, partitions: int) -> bool:
    keys = broker.keys
    return all(broker.client.get(keys.lease(topic, p, group)) for p in range(partitions))


def positions(broker: redisq.Broker, topic: str, group: str) -> list[str | None]:
    return [p.last_delivered for p in broker.describe_group(topic, group).partitions]


OLD = [f"old-{i}" for i in range(10)]


def consumed(broker: redisq.Broker, partitions: int = 2, entry_format: str | None = None) -> None:
    """Topic t with OLD in it, all of it handled and committed by group g."""
    broker.create_topic("t", partitions=partitions, entry_format=entry_format)
    send(broker, "t", OLD, partitions)
    assert read_all(broker, "t", "g") == sorted(OLD)


# -- the broker methods, both APIs ---------------------------------------------------------------
def test_group_admin_on_the_thread_broker(broker: redisq.Broker) -> None:
    consumed(broker)
    assert broker.list_groups() == [("t", "g")] == broker.list_groups("t")
    description = broker.describe_group("t", "g")
    assert (description.mode, description.start) == ("orderly", "earliest")
    assert description.total_lag == 0
    with pytest.raises(TopicNotFound):
        broker.describe_group("nope", "g")
    with pytest.raises(GroupNotFound):
        broker.describe_group("t", "nobody")
    with pytest.raises(TopicNotFound):
        broker.list_groups("nope")
    dry = broker.reset_offsets("t", "g", to_earliest=True, dry_run=True)
    assert [(r.after, r.lag_before, r.lag_after) for r in dry] == [("0-0", 0, 5)] * 2
    assert broker.describe_group("t", "g").total_lag == 0
    assert [r.lag_after for r in broker.reset_offsets("t", "g", to_earliest=True)] == [5, 5]
    assert broker.describe_group("t", "g").total_lag == 10
    broker.delete_group("t", "g")
    assert broker.list_groups() == []
    with pytest.raises(GroupNotFound):
        broker.delete_group("t", "g")


@aio
async def test_group_admin_on_the_asyncio_broker(env: Env) -> None:
    """The same operations through redisq.asyncio (the README names describe_group on the
    broker; the asyncio API had none of them). Message entries: it shifts by single messages
    (on batch entries a shift moves whole batches: tests/batches/test_reading.py)."""
    consumed(env.sync, entry_format="message")
    async with env.connect() as broker:
        assert await broker.list_groups() == [("t", "g")] == await broker.list_groups("t")
        description = await broker.describe_group("t", "g")
        assert description == env.sync.describe_group("t", "g")
        assert description.total_lag == 0 and len(description.partitions) == 2
        with pytest.raises(TopicNotFound):
            await broker.describe_group("nope", "g")
        with pytest.raises(GroupNotFound):
            await broker.describe_group("t", "nobody")
        dry = await broker.reset_offsets("t", "g", shift_by=-2, dry_run=True)
        assert [(r.lag_before, r.lag_after) for r in dry] == [(0, 2)] * 2
        done = await broker.reset_offsets("t", "g", shift_by=-2, partitions=[1])
        assert [(r.partition, r.lag_after) for r in done] == [(1, 2)]
        assert [p.lag for p in (await broker.describe_group("t", "g")).partitions] == [0, 2]
        async with broker.consumer("t", "g", **MEMBER) as member:
            await async_wait_until(lambda: bool(member.assignment), what="an assignment")
            with pytest.raises(GroupInUse):
                await broker.reset_offsets("t", "g", to_earliest=True)
            with pytest.raises(GroupInUse):
                await broker.delete_group("t", "g")
        await broker.delete_group("t", "g")
        assert await broker.list_groups("t") == []
    assert "t~dlq~g" not in env.sync.list_topics()


# -- issue 37.1: a member granted while a reset runs ---------------------------------------------
def test_a_member_granted_during_a_reset_makes_it_fail_not_undone(broker: redisq.Broker) -> None:
    """The member is granted both partitions after the reset's checks, before its writes; it
    then handles a new message and commits. Before: the reset returned (positions 0-0) and the
    member's commit put its old positions back: none of the old messages was read again."""
    consumed(broker)
    committed = positions(broker, "t", "g")
    member: redisq.Consumer | None = None

    def execute(steps: Steps) -> Any:
        nonlocal member
        if member is None and writes_positions(steps):
            member = broker.consumer("t", "g", name="late", **MEMBER)
            wait_until(lambda: leases_held(broker, "t", "g", 2), what="the member's leases")
        return broker.scripts.execute(steps)

    returned = True
    try:
        run_operation(reset_offsets(broker.keys, "t", "g", to_earliest=True), execute)
    except GroupInUse as refused:
        returned = False
        assert "late" in str(refused) and "nothing reset" in str(refused)
    assert member is not None
    with member:  # it goes on from the position it loaded, and commits
        send(broker, "t", ["new"], 2)
        handled: list[Message] = []
        deadline = time.monotonic() + 30
        while not handled and time.monotonic() < deadline:
            handled = member.poll(timeout=0.2)
        member.ack(handled)
        member.commit()
    again = read_all(broker, "t", "g")
    if returned:  # a reset that returned must hold: the old messages come again
        assert set(OLD) <= set(again), f"the reset returned and was undone: {again}"
    assert not returned, "the reset returned while a member held the lease"
    assert [m.value for m in handled] == [b"new"] and again == []
    assert positions(broker, "t", "g") != committed  # the member's commit stands
    broker.reset_offsets("t", "g", to_earliest=True)  # with no member: it holds
    assert read_all(broker, "t", "g") == sorted([*OLD, "new"])


@aio
async def test_asyncio_member_granted_during_a_reset_makes_it_fail(env: Env) -> None:
    """The same race through redisq.asyncio: its broker runs the same operation, an asyncio
    member is granted the partitions between the reset's checks and its writes."""
    consumed(env.sync)
    async with env.connect() as broker:
        member: rq.Consumer | None = None

        async def execute(steps: Steps) -> Any:
            nonlocal member
            if member is None and writes_positions(steps):
                member = broker.consumer("t", "g", name="late", **MEMBER)
                await async_wait_until(
                    lambda: member_polls(member), what="the member's leases", timeout=30
                )
            return await broker.scripts.execute(steps)

        async def member_polls(consumer: rq.Consumer) -> bool:
            await consumer.poll(timeout=0.05)
            return leases_held(env.sync, "t", "g", 2)

        returned = True
        try:
            await run_steps(reset_offsets(broker.keys, "t", "g", to_earliest=True), execute)
        except GroupInUse as refused:
            returned = False
            assert "late" in str(refused)
        assert member is not None
        send(env.sync, "t", ["new"], 2)
        handled: list[Message] = []
        deadline = time.monotonic() + 30
        while not handled and time.monotonic() < deadline:
            handled = await member.poll(timeout=0.2)
        await member.ack(handled)
        await member.commit()
        await member.close()
    again = read_all(env.sync, "t", "g")
    if returned:
        assert set(OLD) <= set(again), f"the reset returned and was undone: {again}"
    assert not returned, "the reset returned while a member held the lease"
    assert [m.value for m in handled] == [b"new"] and again == []


def test_a_reset_refused_on_one_partition_names_what_it_reset(broker: redisq.Broker) -> None:
    """A member granted only partition 1 meanwhile: partition 0 is reset, partition 1 keeps
    its position, and the error says which is which."""
    consumed(broker)
    committed = positions(broker, "t", "g")
    granted = []

    def execute(steps: Steps) -> Any:
        if not granted and writes_positions(steps):
            call = acquire_lease(broker.keys, GroupRef("t", "g"), 1, "late", 10_000, "0")
            granted.append(broker.scripts.run(call))
        return broker.scripts.execute(steps)

    with pytest.raises(GroupInUse) as refused:
        run_operation(reset_offsets(broker.keys, "t", "g", to_earliest=True), execute)
    assert granted[0] is not None and "(late)" in str(refused.value)
    assert "partition 1 while the reset ran: not reset there; partition 0 reset" in str(
        refused.value
    )
    assert positions(broker, "t", "g") == ["0-0", committed[1]]


def test_a_reset_computed_from_a_position_that_moved_changes_nothing(
    broker: redisq.Broker,
) -> None:
    """shift_by=-2 is computed from the position the reset read. A member takes the partition,
    handles three more messages, commits and leaves before the reset writes: the write finds
    another position and changes nothing. Before, it returned "before: old-4, after: old-2",
    though it had replaced old-7: five handled messages came again instead of two."""
    broker.create_topic("t", partitions=1)
    send(broker, "t", OLD, 1)
    assert read_all(broker, "t", "g", at_most=5) == OLD[:5]
    moved_to: list[str | None] = []

    def execute(steps: Steps) -> Any:
        if not moved_to and writes_positions(steps):
            assert read_all(broker, "t", "g", at_most=3, name="between") == OLD[5:8]
            moved_to.extend(positions(broker, "t", "g"))
        return broker.scripts.execute(steps)

    try:
        (done,) = run_operation(reset_offsets(broker.keys, "t", "g", shift_by=-2), execute)
    except GroupInUse as refused:
        assert "moved partition 0" in str(refused)
    else:  # what it says it replaced is what was there
        assert done.before == moved_to[0], f"the reset replaced {moved_to[0]}, not {done.before}"
    assert read_all(broker, "t", "g") == OLD[8:]


def test_a_transaction_position_pending_at_a_reset_is_not_applied_after_it(
    broker: redisq.Broker,
) -> None:
    """A previous owner's transaction that carries the partition's position (tx_hold.lua's
    pending_tx, applied once by whoever comes first) would otherwise apply it after the reset
    and undo it."""
    broker.create_topic("t", partitions=1)
    send(broker, "t", OLD, 1)
    assert read_all(broker, "t", "g") == sorted(OLD)
    last = broker.describe_group("t", "g").partitions[0].last_delivered
    assert last is not None
    state = broker.keys.group_partition_state("t", 0, "g")
    broker.client.hset(state, "pending_tx", "tx-1")  # as tx_hold.lua left it
    broker.reset_offsets("t", "g", to_earliest=True)
    applied = broker.scripts.run(
        apply_position(broker.keys, "tx-1", InputPosition("g", "t", 0, last, 10), committed=True)
    )
    assert not applied
    assert positions(broker, "t", "g") == ["0-0"]


# -- issue 37.2: the lag of a start="latest" group before its first read --------------------------
def joined_latest(broker: redisq.Broker, topic: str, group: str) -> None:
    """The group exists (start="latest") and no member has read a partition yet: its first
    member joined and left before it was granted any (join_group.lua, as a consumer joins)."""
    ref = GroupRef(topic, group)
    calls = broker.scripts
    calls.run(
        join_group(broker.keys, ref, "m", mode="orderly", start="latest", policy="dead_letter")
    )
    calls.run(heartbeat(broker.keys, ref, "m", 30_000, leave=True))


def cli_output(capsys: pytest.CaptureFixture[str], url: str, ns: str, *args: str) -> str:
    capsys.readouterr()
    assert cli.main([*args, "--url", url, "--namespace", ns]) == 0
    return capsys.readouterr().out


def test_the_lag_of_a_latest_group_before_its_first_read(
    broker: redisq.Broker, server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """1,000 messages, then the group (start="latest"), then 10 more: every view shows a lag of
    10, what its first reader is then handed (before: 1,010), and 0 before the 10 came (before:
    1,000)."""
    broker.create_topic("t", partitions=2)
    send(broker, "t", [f"before-{i}" for i in range(1000)], 2)
    time.sleep(0.005)  # the group's start is the next millisecond of the server's clock
    joined_latest(broker, "t", "g")
    lags = views(broker, server_url, capsys)
    assert lags == {view: [0, 0] for view in lags}, lags
    time.sleep(0.005)
    send(broker, "t", [f"after-{i}" for i in range(10)], 2)
    lags = views(broker, server_url, capsys)
    assert lags == {view: [5, 5] for view in lags}, lags
    assert read_all(broker, "t", "g") == sorted(f"after-{i}" for i in range(10))
    lags = views(broker, server_url, capsys)
    assert lags == {view: [0, 0] for view in lags}, lags


def views(
    broker: redisq.Broker, url: str, capsys: pytest.CaptureFixture[str]
) -> dict[str, list[int]]:
    """The group's lag per partition, as each view shows it."""
    ns = broker.namespace
    shown: dict[str, list[int]] = {}
    description = broker.describe_group("t", "g")
    shown["describe_group"] = [p.lag for p in description.partitions]  # type: ignore[misc]
    shown["describe_group (asyncio)"] = asyncio_lags(url, ns)
    out = cli_output(capsys, url, ns, "lag", "t", "g")
    rows = [line.split() for line in out.splitlines() if line.startswith("g ")]
    shown["redisq lag"] = [int(row[2]) for row in rows]
    out = cli_output(capsys, url, ns, "group", "describe", "t", "g")
    total = int(out.split(" members, lag ")[1].split(",")[0])
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    shown["redisq group describe"] = [int(row[4]) for row in rows]
    assert total == sum(shown["redisq group describe"])
    samples = parse(metrics.exposition(metrics.collect(broker, clients=[])))
    shown["redisq_consumer_lag"] = [
        int(value(samples, "redisq_consumer_lag", topic="t", group="g", partition=p))
        for p in range(2)
    ]
    shown.update(console_lags(broker))
    return shown


def asyncio_lags(url: str, namespace: str) -> list[int]:
    import asyncio

    async def read() -> list[int]:
        async with await rq.connect(url, namespace=namespace) as broker:
            return [p.lag or 0 for p in (await broker.describe_group("t", "g")).partitions]

    return asyncio.run(read())


def console_lags(broker: redisq.Broker) -> dict[str, list[int]]:
    """The console's group page (per partition, and its total)."""
    try:
        from tests.console.test_http import Client, cells, running_console
    except pytest.skip.Exception:  # no console extra: the other views still count
        return {}
    import re

    with running_console(broker) as base:
        _, _, page = Client(base).get("/topics/t/groups/g")
    found = re.search(r'id="total-lag">([\d,]+)<', page)
    assert found, page
    lags = [int(r[3].rstrip("*").replace(",", "")) for r in cells(page, "group-partitions")]
    assert int(found.group(1).replace(",", "")) == sum(lags)
    return {"console": lags}
