"""What a consumer does when a handler keeps failing: failure policies, behind one interface.

A policy answers, after each failed attempt, with one action:

    Retry(delay_s)          call the handler again after a backoff
    DeadLetter(park_key)    move the message to the group's dead-letter topic (with the error and
                            the attempt count) and go on; park_key also holds later messages of
                            the same key until `redisq dlq release`
    Block(delay_s)          keep retrying; the partition waits on this message and shows it as
                            blocked in describe_group and `redisq lag` (RocketMQ's default)

An entry that is not a message (written by another client) never reaches the handler: the
policy's `malformed()` answers for it at once. A new policy is one class:

    class NotifyThenDeadLetter(DeadLetterPolicy):
        def decide(self, attempt, error):
            action = super().decide(attempt, error)
            if isinstance(action, DeadLetter):
                page_someone(error)
            return action

    broker.consumer("orders", group="billing", failure_policy=NotifyThenDeadLetter(max_attempts=3))
"""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any

from redisq.errors import check_int


@dataclass(frozen=True, slots=True)
class Retry:
    delay_s: float


@dataclass(frozen=True, slots=True)
class DeadLetter:
    park_key: bool = False


@dataclass(frozen=True, slots=True)
class Block:
    delay_s: float


Action = Retry | DeadLetter | Block


class Backoff:
    """Exponential backoff with equal jitter: half fixed, half random."""

    def __init__(self, base_ms: int = 100, max_ms: int = 30_000) -> None:
        self.base_s = base_ms / 1000
        self.max_s = max_ms / 1000

    def delay(self, attempt: int) -> float:
        # The exponent is capped: 2**64 times any base is past any maximum, and 2**1024 no
        # longer converts to a float (a blocked message retried that often crashed its worker).
        exponent = min(max(1, attempt) - 1, 64)
        delay = min(self.max_s, self.base_s * (2**exponent))
        return delay / 2 + random.uniform(0, delay / 2)


class FailurePolicy:
    """The interface, and the dead-letter policy's defaults (see the module doc)."""

    name = "failure_policy"
    needs_order = False  # a policy that holds keys back only works in orderly mode

    def __init__(self, max_attempts: int = 5, backoff: Backoff | None = None) -> None:
        self.max_attempts = check_int("max_attempts", max_attempts, 1)
        self.backoff = backoff or Backoff()

    def decide(self, attempt: int, error: BaseException) -> Action:
        """After failed attempt number `attempt` (1, 2, ...)."""
        if attempt < self.max_attempts:
            return Retry(self.backoff.delay(attempt))
        return self.give_up(attempt, error)

    def give_up(self, attempt: int, error: BaseException) -> Action:
        return DeadLetter()

    def malformed(self) -> Action:
        """For an entry that is not a message: no attempt can succeed."""
        return self.give_up(0, ValueError("malformed entry"))


class DeadLetterPolicy(FailurePolicy):
    name = "dead_letter"


class ParkKeyPolicy(FailurePolicy):
    name = "park_key"
    needs_order = True

    def give_up(self, attempt: int, error: BaseException) -> Action:
        return DeadLetter(park_key=True)


class BlockPolicy(FailurePolicy):
    name = "block"

    def give_up(self, attempt: int, error: BaseException) -> Action:
        return Block(self.backoff.delay(attempt))


POLICIES: dict[str, type[FailurePolicy]] = {
    "dead_letter": DeadLetterPolicy,
    "park_key": ParkKeyPolicy,
    "block": BlockPolicy,
}


def make_policy(spec: str | FailurePolicy, max_attempts: int, backoff: Backoff) -> FailurePolicy:
    """A policy from its name (with the consumer's max_attempts and backoff), or as given."""
    if isinstance(spec, str):
        return POLICIES[spec](max_attempts, backoff)
    return spec


# -- one message under a policy, for either driver -------------------------------------------------
@dataclass(frozen=True, slots=True)
class CallHandler:
    """Call the handler with this message; send back None, or the exception it raised."""

    message: object


@dataclass(frozen=True, slots=True)
class Wait:
    """Sleep this long, while the partition is still ours (else stop)."""

    delay_s: float


@dataclass(frozen=True, slots=True)
class MarkBlocked:
    """Show the message as blocked (describe_group, lag)."""

    error: BaseException
    attempts: int


@dataclass(frozen=True, slots=True)
class Handled:
    message: object
    was_blocked: bool


@dataclass(frozen=True, slots=True)
class GaveUp:
    """Dead-letter it (park_key: and park its key)."""

    error: BaseException
    attempts: int
    park_key: bool


def handle_under_policy(
    message: Any, policy: FailurePolicy
) -> Generator[CallHandler | Wait | MarkBlocked, BaseException | None, Handled | GaveUp]:
    """The attempts of one message: the handler, then retries with backoff, until it succeeds or
    the policy gives up (or blocks, retrying for ever). The thread and asyncio consumers drive
    the same steps with their own calls and sleeps."""
    attempt = message.attempt
    blocked = False
    while True:
        error = yield CallHandler(message)
        if error is None:
            return Handled(message, blocked)
        action = policy.decide(attempt, error)
        if isinstance(action, DeadLetter):
            return GaveUp(error, attempt, action.park_key)
        if isinstance(action, Block) and not blocked:
            blocked = True
            yield MarkBlocked(error, attempt)
        yield Wait(action.delay_s)
        attempt += 1
        message = replace(message, attempt=attempt)
