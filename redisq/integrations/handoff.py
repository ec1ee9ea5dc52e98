"""What a framework's worker answers for a message handed to it, as redisq's failure policy
reads it: shared by the Kombu transport and the taskiq broker. Imports nothing but redisq."""

from __future__ import annotations

from redisq.policies import DeadLetter, FailurePolicy, Retry


class Rejected(Exception):
    """The framework rejected the message (Kombu: basic_reject without requeue, or requeued
    past max_requeues): the group dead-letters it, never drops it."""


class Released(Exception):
    """The consumer closes before the framework settled the message: it is not committed, so
    the group hands it out again (to the next member that holds its partition)."""


class HandoffPolicy(FailurePolicy):
    """The framework decides per message; the group carries it out. A rejection dead-letters at
    once; a release on close retries until the closing member stops (nothing is given up); a
    failure of the bridge itself gets the ordinary retries, then the dead letter."""

    def decide(self, attempt: int, error: BaseException) -> Retry | DeadLetter:
        if isinstance(error, Released):
            return Retry(0.05)
        if isinstance(error, Rejected):
            return DeadLetter()
        action = super().decide(attempt, error)
        assert isinstance(action, Retry | DeadLetter)
        return action
