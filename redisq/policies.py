"""Failure policies: what a consumer does with a message whose handler keeps failing.

A group names one (`failure_policy="dead_letter"`, `"park_key"` or `"block"`), or passes its own:
a FailurePolicy whose decide(attempt, error) answers Retry(delay_s), DeadLetter() or Block().
The built-in ones are DeadLetterPolicy, ParkKeyPolicy and BlockPolicy; the guide on consuming
describes what each does. (Implemented in redisq.consume.policies.)
"""

from redisq.consume.policies import (
    Action,
    Backoff,
    Block,
    BlockPolicy,
    DeadLetter,
    DeadLetterPolicy,
    FailurePolicy,
    ParkKeyPolicy,
    Retry,
)

__all__ = [
    "Action",
    "Backoff",
    "Block",
    "BlockPolicy",
    "DeadLetter",
    "DeadLetterPolicy",
    "FailurePolicy",
    "ParkKeyPolicy",
    "Retry",
]
