"""The scheduler role: enqueues the due slots of the registry's periodic tasks.

Every worker runs one (unless ``Worker(scheduler=False)``); none is a leader. For each
periodic task it asks the database for the time, and when a new slot is due it tries to win
it with :func:`sqla_jobs.periodic.enqueue_due`, in a short transaction of its own that
commits: the database lets exactly one worker win each slot, the others change nothing. It
sleeps until the next slot is due, by the database's clock, but never more than a second,
so that a stop is quick and a schedule is not missed by a clock that jumps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final

from sqlalchemy.orm import Session

from sqla_jobs.periodic import database_now, enqueue_due
from sqla_jobs.registry import Registry, Task

__all__ = ["Scheduler"]

logger = logging.getLogger("sqla_jobs.worker")

#: The longest sleep between two looks at the schedules (seconds).
MAX_SLEEP: Final = 1.0
#: How long after a slot's time the scheduler wakes for it (seconds): a database clock read
#: just before the slot must not find it not yet due.
_AFTER_SLOT: Final = 0.005


class Scheduler:
    """The ``schedule`` role of a :class:`~sqla_jobs.Worker`."""

    def __init__(
        self,
        registry: Registry,
        session_factory: Callable[[], Session],
        *,
        stopping: threading.Event,
        on_database_error: Callable[[str, Exception], float],
        on_database_ok: Callable[[], None],
    ) -> None:
        self.registry = registry
        self.session_factory = session_factory
        self.stopping = stopping
        self.on_database_error = on_database_error
        self.on_database_ok = on_database_ok
        # The latest slot this worker already tried for each task (won or lost): a slot is
        # tried once per worker, and the database decides between workers.
        self.tried: dict[str, datetime] = {}

    def loop(self) -> None:
        tasks = self.registry.periodic_tasks
        while not self.stopping.is_set():
            try:
                wait = self.tick(tasks)
            except Exception as exc:
                wait = self.on_database_error("schedule", exc)
            else:
                self.on_database_ok()
            self.stopping.wait(wait)

    def tick(self, tasks: list[Task[Any]]) -> float:
        """Try every task whose latest slot is new to this worker; return how long to sleep
        (seconds) before the next slot is due."""
        registry = self.registry
        next_due: datetime | None = None
        with self.session_factory() as session:
            for task in tasks:
                schedule = task.schedule
                assert schedule is not None
                with session.begin():
                    now = database_now(session)
                    slot = schedule.latest_slot(now)
                    if self.tried.get(task.name) != slot:
                        enqueue_due(
                            session,
                            registry.model,
                            registry.schedule_model,
                            task=task.name,
                            schedule=schedule,
                            now=now,
                            job={
                                "queue": task.queue,
                                "priority": task.priority,
                                "max_attempts": task.max_attempts,
                            },
                        )
                self.tried[task.name] = slot
                due = schedule.next_slot(now)
                if next_due is None or due < next_due:
                    next_due = due
                    wait = (due - now).total_seconds() + _AFTER_SLOT
        if next_due is None:
            return MAX_SLEEP
        return min(max(wait, 0.0), MAX_SLEEP)
