"""Exponential backoff with jitter, for the worker's reconnect loops (client-side time).

Not to be confused with :class:`sqla_jobs.policy.RetryPolicy`, which spaces a failed job's
attempts in database time.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

__all__ = ["Backoff"]


@dataclass
class Backoff:
    """Delays of ``initial * 2**n`` seconds, capped at ``cap``, each with +-``jitter``.

    ``failures`` counts the failures since the last :meth:`reset`.
    """

    initial: float = 0.1
    cap: float = 5.0
    jitter: float = 0.2
    failures: int = field(default=0, init=False)

    def next_delay(self) -> float:
        """Count one more failure and return how long to wait before trying again."""
        self.failures += 1
        delay = min(self.cap, math.ldexp(self.initial, min(self.failures - 1, 30)))
        return delay * (1 + self.jitter * (2 * random.random() - 1))

    def wait(self, stop: threading.Event) -> float:
        """Count a failure and sleep its delay, waking early if ``stop`` is set."""
        delay = self.next_delay()
        stop.wait(delay)
        return delay

    def reset(self) -> bool:
        """Forget the failures; returns whether there were any (a recovery)."""
        recovered = self.failures > 0
        self.failures = 0
        return recovered
