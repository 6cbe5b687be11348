"""The ``history`` role: the upkeep of a model's partitioned history, from every worker.

For a model with ``partitioned_history = True``, each worker runs
:func:`sqla_jobs.history.maintain` at start and then every ``every`` seconds: the day
partitions from today to a week ahead, the move of finished jobs still in the job table
(dead by a claim, or from before the table had a history), and, when the worker was given a
``history_retention``, the drop of the partitions older than it. No leader: runs of several
workers at once skip each other's operations (an advisory try-lock), and partition DDL
gives up after a short ``lock_timeout`` and is tried again at the next run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import Engine

from sqla_jobs.history import maintain
from sqla_jobs.schema import JobMixin, JobResultMixin

__all__ = ["HistoryKeeper"]

logger = logging.getLogger("sqla_jobs.worker")


class HistoryKeeper:
    def __init__(
        self,
        engine: Engine,
        model: type[JobMixin],
        *,
        result_model: type[JobResultMixin] | None,
        retention: timedelta | None,
        every: float,
        finished: threading.Event,
        stopping: threading.Event,
        on_database_error: Callable[[str, Exception], float],
        on_database_ok: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.model = model
        self.result_model = result_model
        self.retention = retention
        self.every = every
        self.finished = finished
        self.stopping = stopping
        self.on_database_error = on_database_error
        self.on_database_ok = on_database_ok
        self.runs = 0  # completed runs, for tests and health

    def loop(self) -> None:
        wait = 0.0
        while not self.finished.wait(wait):
            if self.stopping.is_set():
                wait = 0.5
                continue
            try:
                report = maintain(
                    self.engine,
                    self.model,
                    retention=self.retention,
                    result_model=self.result_model,
                )
            except Exception as exc:
                wait = min(self.every, self.on_database_error("history maintenance", exc))
                continue
            self.on_database_ok()
            self.runs += 1
            if report.skipped:
                logger.info(
                    "history maintenance left %d operations for the next run (another run "
                    "held the lock, or a lock wait timed out): %s",
                    len(report.skipped),
                    ", ".join(report.skipped),
                    extra={"action": "history_maintenance_skipped", "skipped": report.skipped},
                )
            wait = self.every
