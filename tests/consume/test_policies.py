"""The failure policies and the steps of one message under a policy (redisq.consume.policies),
without a server: what each policy answers after each failed attempt, and the steps
handle_under_policy asks either driver to take (call, wait, mark blocked) until the message is
handled or given up."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest

from redisq.consume.policies import (
    Backoff,
    Block,
    BlockPolicy,
    CallHandler,
    DeadLetter,
    DeadLetterPolicy,
    FailurePolicy,
    GaveUp,
    Handled,
    MarkBlocked,
    ParkKeyPolicy,
    Retry,
    Wait,
    handle_under_policy,
    make_policy,
)
from redisq.errors import InvalidConfig


@dataclass(frozen=True)
class Message:
    offset: str
    attempt: int = 1


BOOM = RuntimeError("boom")


def drive(
    steps: Generator[Any, BaseException | None, Any], outcomes: list[BaseException | None]
) -> tuple[list[Any], Any]:
    """Run the steps, answering each CallHandler with the next outcome; (steps, result)."""
    seen: list[Any] = []
    answer: BaseException | None = None
    step = next(steps)
    try:
        while True:
            seen.append(step)
            answer = outcomes.pop(0) if isinstance(step, CallHandler) else None
            step = steps.send(answer)
    except StopIteration as stop:
        return seen, stop.value


def test_backoff_doubles_with_equal_jitter_up_to_its_maximum() -> None:
    backoff = Backoff(base_ms=100, max_ms=1_000)
    for attempt, full in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (10**6, 1.0)]:
        for _ in range(20):
            assert full / 2 <= backoff.delay(attempt) <= full


def test_every_policy_retries_before_max_attempts() -> None:
    for policy in (DeadLetterPolicy(3), ParkKeyPolicy(3), BlockPolicy(3)):
        for attempt in (1, 2):
            assert isinstance(policy.decide(attempt, BOOM), Retry)


def test_what_each_policy_does_at_max_attempts() -> None:
    assert DeadLetterPolicy(3).decide(3, BOOM) == DeadLetter(park_key=False)
    assert ParkKeyPolicy(3).decide(3, BOOM) == DeadLetter(park_key=True)
    assert isinstance(BlockPolicy(3).decide(3, BOOM), Block)
    assert isinstance(BlockPolicy(3).decide(50, BOOM), Block)  # blocked for ever


def test_a_malformed_entry_is_given_up_at_once() -> None:
    assert DeadLetterPolicy(5).malformed() == DeadLetter(park_key=False)
    assert ParkKeyPolicy(5).malformed() == DeadLetter(park_key=True)
    assert isinstance(BlockPolicy(5).malformed(), Block)


def test_only_park_key_needs_order() -> None:
    assert ParkKeyPolicy.needs_order
    assert not DeadLetterPolicy.needs_order and not BlockPolicy.needs_order


@pytest.mark.parametrize("bad", [0, -1])
def test_max_attempts_below_one_is_refused(bad: int) -> None:
    with pytest.raises(InvalidConfig, match="max_attempts"):
        DeadLetterPolicy(bad)


def test_make_policy_by_name_or_as_given() -> None:
    backoff = Backoff()
    policy = make_policy("park_key", 7, backoff)
    assert isinstance(policy, ParkKeyPolicy)
    assert (policy.max_attempts, policy.backoff) == (7, backoff)
    mine = BlockPolicy(2)
    assert make_policy(mine, 9, backoff) is mine
    with pytest.raises(KeyError):
        make_policy("retry_forever", 3, backoff)


def test_a_handler_that_succeeds_is_called_once() -> None:
    steps, result = drive(handle_under_policy(Message("1-0"), DeadLetterPolicy(3)), [None])
    assert steps == [CallHandler(Message("1-0"))]
    assert result == Handled(Message("1-0"), was_blocked=False)


def test_retries_count_attempts_and_wait_between_them() -> None:
    fast = Backoff(base_ms=1, max_ms=1)
    steps, result = drive(
        handle_under_policy(Message("1-0"), DeadLetterPolicy(5, fast)), [BOOM, BOOM, None]
    )
    calls = [step.message.attempt for step in steps if isinstance(step, CallHandler)]
    assert calls == [1, 2, 3]
    assert [type(step) for step in steps] == [CallHandler, Wait, CallHandler, Wait, CallHandler]
    assert result == Handled(Message("1-0", attempt=3), was_blocked=False)


def test_dead_letter_after_max_attempts_says_the_attempts() -> None:
    steps, result = drive(handle_under_policy(Message("1-0"), ParkKeyPolicy(2)), [BOOM, BOOM])
    assert sum(isinstance(step, CallHandler) for step in steps) == 2
    assert result == GaveUp(BOOM, attempts=2, park_key=True)


def test_a_redelivered_message_goes_on_from_its_attempt() -> None:
    """A message handed out again (attempt 3 after a takeover) has only what is left."""
    _, result = drive(handle_under_policy(Message("1-0", 3), DeadLetterPolicy(3)), [BOOM])
    assert result == GaveUp(BOOM, attempts=3, park_key=False)


def test_block_marks_the_message_blocked_once_then_retries_until_it_succeeds() -> None:
    fast = Backoff(base_ms=1, max_ms=1)
    outcomes: list[BaseException | None] = [BOOM] * 6 + [None]
    steps, result = drive(handle_under_policy(Message("1-0"), BlockPolicy(2, fast)), outcomes)
    assert [step for step in steps if isinstance(step, MarkBlocked)] == [MarkBlocked(BOOM, 2)]
    assert sum(isinstance(step, CallHandler) for step in steps) == 7
    assert result == Handled(Message("1-0", attempt=7), was_blocked=True)


def test_a_new_policy_is_one_class() -> None:
    """The module doc's promise: a subclass changes one decision, the steps follow it."""

    class RetryTwiceThenBlock(FailurePolicy):
        def give_up(self, attempt: int, error: BaseException) -> Block:
            return Block(0.0)

    steps, result = drive(
        handle_under_policy(Message("1-0"), RetryTwiceThenBlock(2, Backoff(1, 1))),
        [BOOM, BOOM, None],
    )
    assert any(isinstance(step, MarkBlocked) for step in steps)
    assert result.was_blocked
