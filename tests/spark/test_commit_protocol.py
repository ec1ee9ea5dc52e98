"""The Spark writer's commit protocol (spark_connector.commit) on real servers, without Spark:
task attempts stage transactions, the driver commits the winners and aborts the rest, a replayed
epoch commits what its first run decided, a driver that dies mid-commit is completed by the next.

Standalone Valkey and the three-master cluster (the write's record, each attempt's transaction
and each partition sit in different slots there)."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from redisq.produce.transactions import new_transaction_id
from redisq.protocol import run_operation
from redisq.protocol import transaction_ops as tx_ops
from redisq.protocol.produce import encode_message, random_producer_id
from redisq.protocol.transactions import StagedBatch, Writer
from spark_connector import commit
from tests.conftest import drop_namespace

pytestmark = pytest.mark.spark


@pytest.fixture(params=["valkey", pytest.param("valkey-cluster3", marks=pytest.mark.cluster)])
def broker(request: pytest.FixtureRequest) -> Iterator[redisq.Broker]:
    if request.param == "valkey":
        url = request.getfixturevalue("valkey_server").url
    else:
        url = f"redis://127.0.0.1:{request.getfixturevalue('valkey_cluster3')[0].port}"
    b = redisq.connect(url, namespace=f"c{uuid.uuid4().hex[:10]}")
    b.create_topic("out", partitions=3)
    yield b
    drop_namespace(b)
    b.close()


def run(broker: redisq.Broker, op: Any) -> Any:
    return run_operation(op, broker.scripts.execute)


def attempt(broker: redisq.Broker, write_id: str, rows: list[bytes], task: int) -> str:
    """One task attempt as the writer makes it: registered under the write, then staged."""
    tx_id = new_transaction_id()
    run(broker, commit.register_attempt(broker.keys, write_id, tx_id, f"{task}:0"))
    writer = Writer(random_producer_id(), None, 1, timeout_ms=3_600_000)
    batches = []
    for p in range(3):
        mine = [r for i, r in enumerate(rows) if i % 3 == p]
        body = b"".join(b"".join(encode_message(None, r, None, None)) for r in mine)
        batches.append(StagedBatch("out", p, "v", len(mine), body))
    run(broker, tx_ops.stage(broker.keys, tx_id, writer, batches, 0, register=True))
    return tx_id


def topic_values(broker: redisq.Broker) -> Counter[bytes]:
    return Counter(m.value for p in range(3) for m in broker.read("out", p))


def test_driver_commits_winners_only_and_aborts_every_other_attempt(
    broker: redisq.Broker,
) -> None:
    rows_a = [b"a%d" % i for i in range(30)]
    rows_b = [b"b%d" % i for i in range(30)]
    lost_a = attempt(broker, "w1", rows_a, 0)  # killed: never reported
    won_a = attempt(broker, "w1", rows_a, 0)
    won_b = attempt(broker, "w1", rows_b, 1)
    zombie_b = attempt(broker, "w1", [b"zombie"], 1)  # a speculative copy that lost
    assert topic_values(broker) == Counter()  # staged: invisible
    outcome = run(broker, commit.commit_write(broker.keys, "w1", [won_a, won_b]))
    assert sorted(outcome.committed) == sorted([won_a, won_b])
    assert sorted(outcome.aborted) == sorted([lost_a, zombie_b])
    assert outcome.appended == 60
    assert topic_values(broker) == Counter(rows_a + rows_b)
    for tx_id, state in ((lost_a, "aborted"), (zombie_b, "aborted"), (won_a, "committed")):
        record = broker.scripts.execute(tx_ops.tx.read_record(broker.keys, tx_id))
        assert record is not None and record.state == state
    # An attempt that registers after the decision is never committed: a repeat of the commit
    # (a retried driver call) writes nothing twice and aborts the latecomer.
    late = attempt(broker, "w1", [b"late"], 1)
    again = run(broker, commit.commit_write(broker.keys, "w1", [won_a, won_b]))
    assert again.appended == 0 and again.aborted == [late]
    assert topic_values(broker) == Counter(rows_a + rows_b)


def test_replayed_epoch_commits_what_its_first_run_decided(broker: redisq.Broker) -> None:
    rows = [b"r%d" % i for i in range(40)]
    first = attempt(broker, "q-7", rows, 0)
    run(broker, commit.commit_write(broker.keys, "q-7", [first]))
    # The query restarts and runs epoch 7 again: a new attempt stages the same rows.
    replay = attempt(broker, "q-7", rows, 0)
    outcome = run(broker, commit.commit_write(broker.keys, "q-7", [replay]))
    assert outcome.replayed and outcome.committed == [first] and outcome.aborted == [replay]
    assert topic_values(broker) == Counter(rows)


def test_driver_dying_mid_commit_is_completed_by_the_replay(broker: redisq.Broker) -> None:
    rows_a, rows_b = [b"a%d" % i for i in range(20)], [b"b%d" % i for i in range(20)]
    a, b = attempt(broker, "q-3", rows_a, 0), attempt(broker, "q-3", rows_b, 1)
    calls = 0

    def dies_after_the_first_roll_forward(steps: Any) -> Any:
        nonlocal calls
        result = broker.scripts.execute(steps)
        if isinstance(steps, list) and steps and steps[0].__class__.__name__ == "ScriptCall":
            if steps[0].script == "tx_apply":
                calls += 1
                if calls == 1:
                    raise ConnectionError("driver died")
        return result

    with pytest.raises(ConnectionError):
        run_operation(
            commit.commit_write(broker.keys, "q-3", [a, b]), dies_after_the_first_roll_forward
        )
    partial = topic_values(broker)
    assert 0 < sum(partial.values()) < 40
    # The restarted query replays epoch 3 with new attempts; the first run's decision holds.
    a2, b2 = attempt(broker, "q-3", rows_a, 0), attempt(broker, "q-3", rows_b, 1)
    outcome = run(broker, commit.commit_write(broker.keys, "q-3", [a2, b2]))
    assert outcome.replayed and sorted(outcome.aborted) == sorted([a2, b2])
    assert topic_values(broker) == Counter(rows_a + rows_b)


def test_abort_rolls_back_every_attempt_and_refuses_a_late_stage(broker: redisq.Broker) -> None:
    a = attempt(broker, "w2", [b"x%d" % i for i in range(10)], 0)
    b = attempt(broker, "w2", [b"y%d" % i for i in range(10)], 1)
    aborted = run(broker, commit.abort_write(broker.keys, "w2", [b]))
    assert sorted(aborted) == sorted([a, b])
    assert topic_values(broker) == Counter()
    writer = Writer(random_producer_id(), None, 1, timeout_ms=3_600_000)
    late = StagedBatch("out", 0, "v", 1, b"".join(encode_message(None, b"late", None, None)))
    with pytest.raises(redisq.errors.TransactionDecided):
        run(broker, tx_ops.stage(broker.keys, a, writer, [late], 1, register=False))


def test_a_winner_aborted_before_the_commit_fails_the_write_loudly(broker: redisq.Broker) -> None:
    a = attempt(broker, "w3", [b"x"], 0)
    run(broker, tx_ops.abort(broker.keys, a, None, []))  # the sweeper, past its timeout
    with pytest.raises(commit.IncompleteWrite, match="aborted"):
        run(broker, commit.commit_write(broker.keys, "w3", [a]))
