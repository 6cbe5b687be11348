"""What the worker's supervisor keeps its role threads with.

:class:`Role` is a named thread that the supervisor (:meth:`Worker.run`'s thread, see
:mod:`sqla_jobs.worker.lifecycle`) restarts when it dies of a bug; :class:`DatabaseWatch`
gives each role the two callbacks through which it reports a failed database call (logged
with a backoff of the role's own) and the recovery after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqla_jobs.backoff import Backoff
from sqla_jobs.events import describe
from sqla_jobs.observer import NO_OBSERVER, Observer

__all__ = ["DatabaseWatch", "Role"]

# The worker's own logger: these lines are the worker's, whichever module writes them.
logger = logging.getLogger("sqla_jobs.worker")


class Role:
    """A named runtime thread the supervisor restarts if it dies."""

    def __init__(self, name: str, prefix: str, target: Callable[[], None]) -> None:
        self.name = name
        self.target = target
        self.thread_name = f"{prefix}-{name}"
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        def guarded() -> None:
            try:
                self.target()
            except BaseException:
                logger.critical(
                    "worker thread %s crashed",
                    self.name,
                    exc_info=True,
                    extra={"action": "thread_crashed", "thread_name": self.name},
                )

        self.thread = threading.Thread(target=guarded, name=self.thread_name, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)


class DatabaseWatch:
    """Each role's view of the database: logs failures with a backoff of its own and the
    recovery after them; ``ok`` is whether the last call of any role succeeded."""

    def __init__(self) -> None:
        self.ok = True
        self.observer: Observer = NO_OBSERVER

    def role(self, what: str) -> tuple[Callable[[str, Exception], float], Callable[[], None]]:
        backoff = Backoff()

        def failed(operation: str, exc: Exception) -> float:
            self.ok = False
            self.observer.database_error(operation)
            delay = backoff.next_delay()
            logger.warning(
                "database error in %s (%s); retrying in %.1fs",
                operation,
                describe(exc),
                delay,
                extra={
                    "action": "database_error",
                    "operation": operation,
                    "error": describe(exc),
                    "delay": round(delay, 3),
                    "failures": backoff.failures,
                },
            )
            return delay

        def recovered() -> None:
            self.ok = True
            if backoff.reset():
                logger.info(
                    "the database answers again (%s)",
                    what,
                    extra={"action": "database_recovered", "operation": what},
                )

        return failed, recovered
