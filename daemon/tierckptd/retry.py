"""Retry with capped exponential backoff and full jitter, for persistent-tier calls.

Only a :class:`~tierckptd.backends.base.BackendError` whose ``retryable`` is True is retried
(throttling, 5xx, timeouts, refused connections); everything else, including ``NotFoundError``
and non-retryable backend errors, is raised at once. When the policy gives up, the last error is
raised unchanged, so callers handle one set of exception types whether or not retries happened.

The delay before retry ``n`` (1-based) is drawn uniformly from ``[0, min(max_delay,
initial_delay * multiplier ** (n - 1))]`` ("full jitter"), which spreads the retries of many
daemons that lost the object store at the same moment.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tierckptd.backends.base import BackendError

__all__ = ["RetryPolicy", "call_with_retry"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
OnRetry = Callable[[int, BackendError, float], None]
"""``on_retry(attempt, error, delay)``: called after failed attempt ``attempt`` (1-based), before sleeping."""


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to wait between attempts.

    Attributes:
        initial_delay: Upper bound of the first delay, in seconds.
        max_delay: Cap of every delay, in seconds.
        multiplier: Growth of the bound from one retry to the next (>= 1).
        max_attempts: Attempts in all, the first included; 0 means no limit.
        deadline: Seconds from the first attempt after which no retry starts (a retry whose
            delay would end past it is not made); None means no deadline. With neither limit
            the call is retried for as long as the errors stay retryable.
        jitter: Draw each delay uniformly from ``[0, bound]`` (full jitter); False sleeps the
            bound itself (deterministic; for tests).
    """

    initial_delay: float = 0.5
    max_delay: float = 30.0
    multiplier: float = 2.0
    max_attempts: int = 0
    deadline: float | None = 600.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.initial_delay < 0 or self.max_delay < self.initial_delay:
            raise ValueError("RetryPolicy: need 0 <= initial_delay <= max_delay")
        if self.multiplier < 1:
            raise ValueError("RetryPolicy: multiplier must be >= 1")
        if self.max_attempts < 0:
            raise ValueError("RetryPolicy: max_attempts must be >= 0 (0 = no limit)")
        if self.deadline is not None and self.deadline < 0:
            raise ValueError("RetryPolicy: deadline must be >= 0 or None")

    def bound(self, attempt: int) -> float:
        """Return the largest delay after failed attempt ``attempt`` (1-based)."""
        # min() before the power would overflow for huge attempt counts; cap the exponent instead.
        return min(self.max_delay, self.initial_delay * self.multiplier ** min(attempt - 1, 1000))

    def delay(self, attempt: int) -> float:
        """Return the delay to sleep after failed attempt ``attempt`` (1-based)."""
        cap = self.bound(attempt)
        return random.uniform(0.0, cap) if self.jitter else cap


def _next_delay(policy: RetryPolicy, attempt: int, err: BackendError, started: float) -> float | None:
    """Return the delay before the next attempt, or None to give up and re-raise ``err``."""
    if not err.retryable:
        return None
    if policy.max_attempts and attempt >= policy.max_attempts:
        return None
    delay = policy.delay(attempt)
    if policy.deadline is not None and time.monotonic() + delay - started > policy.deadline:
        return None
    return delay


def _notify(on_retry: OnRetry | None, attempt: int, err: BackendError, delay: float) -> None:
    logger.warning("attempt %d failed (%s); retrying in %.2fs", attempt, err, delay)
    if on_retry is not None:
        on_retry(attempt, err, delay)


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    on_retry: OnRetry | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn()`` until it returns, retrying retryable backend errors as ``policy`` allows.

    Args:
        fn: The operation; called with no arguments (bind them with ``functools.partial``).
        policy: Backoff and limits.
        on_retry: Called as ``on_retry(attempt, error, delay)`` before each sleep (metrics, logs).
        sleep: The sleep function (tests inject a fake).

    Returns:
        What ``fn`` returned.

    Raises:
        BackendError: The last error, when it is not retryable or the policy gave up.
        Exception: Any other error of ``fn``, at once.
    """
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except BackendError as e:
            delay = _next_delay(policy, attempt, e, started)
            if delay is None:
                raise
            _notify(on_retry, attempt, e, delay)
        sleep(delay)


