"""A caller's timeout: checked once, before anything is queued, and counted down."""

from __future__ import annotations

import numbers
import threading
import time

from redisq.errors import InvalidConfig


def check_timeout(timeout: object, name: str = "timeout") -> float | None:
    """A caller's wait in seconds: None (no limit) or a non-negative real number (bool is not
    one). Checked before anything is queued, so a bad timeout cannot fail a send that was
    written anyway."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{name} must be None or a number of seconds, not {type(timeout).__name__}")
    seconds = float(timeout)
    if not 0 <= seconds <= threading.TIMEOUT_MAX:  # NaN and inf too
        raise InvalidConfig(
            f"{name}={timeout!r} is out of range: None or 0..{threading.TIMEOUT_MAX:.0f} seconds"
        )
    return seconds


def remaining(deadline: float) -> float:
    """Seconds left until deadline (time.monotonic()), never less than 0."""
    return max(0.0, deadline - time.monotonic())
