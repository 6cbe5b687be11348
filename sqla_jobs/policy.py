"""How long a failed attempt waits before the next one."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

__all__ = ["RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, evaluated by the database.

    After attempt ``n`` fails, the job waits
    ``min(cap, base * 2 ** (n - 1)) * (1 ± jitter)``, measured from the database's clock.
    With the defaults: about 1 s, 2 s, 4 s, ... up to one hour.
    """

    base: timedelta = timedelta(seconds=1)
    cap: timedelta = timedelta(hours=1)
    jitter: float = 0.1

    def __post_init__(self) -> None:
        from sqla_jobs.errors import ConfigurationError

        if self.base <= timedelta(0):
            raise ConfigurationError("RetryPolicy.base must be positive")
        if self.cap < self.base:
            raise ConfigurationError("RetryPolicy.cap must be at least base")
        if not 0.0 <= self.jitter < 1.0:
            raise ConfigurationError("RetryPolicy.jitter must be in [0, 1)")
