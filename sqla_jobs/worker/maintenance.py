"""The ``history`` role: the upkeep of a model's partitioned history, from every worker.

For a model with ``partitioned_history = True``, each worker runs
:func:`sqla_jobs.history.maintain` at start and then every ``every`` seconds: the day
partitions from today to a week ahead, the move of finished jobs still in the job table
(dead by a claim, or from before the table had a history), and, when the worker was given a
``history_retention``, the drop of the partitions older than it. No leader: runs of several
workers at once skip each other's operations (an advisory try-lock), and partition DDL
gives up after a short ``lock_timeout`` and is tried again at the next run.

Partition DDL (create, drop) is PostgreSQL's to allow to the history table's owner alone
(docs/privileges.md). A worker whose role is not the owner either says so
(``history_partitions=False``: it runs the mover only, and leaves the partitions to the
owner's ``sqla-jobs history`` from cron), or finds out, once: before its first run it asks
PostgreSQL whether its role acts as the history table's owner and may create tables in its
schema (:func:`sqla_jobs._queries.admin.may_keep_partitions`), and a maintenance run refused
for want of a privilege (SQLSTATE 42501: a partition owned by another role, say) counts the
same. Either way it logs one warning with the action ``history_partitions_not_permitted``,
naming the table, the owner and what to do, and from then until the worker restarts runs the
mover only: DML that the worker's grants cover. Completions never need a partition (the
``DEFAULT`` one takes what no day partition does).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import Engine

from sqla_jobs._queries.admin import MAY_KEEP_PARTITIONS
from sqla_jobs.ddl import qualified_name
from sqla_jobs.events import describe
from sqla_jobs.history import MaintenanceReport, history_table, maintain, move_finished
from sqla_jobs.history.maintenance import refused_privilege
from sqla_jobs.schema import JobMixin, JobResultMixin

__all__ = ["HistoryKeeper", "refused_privilege"]

logger = logging.getLogger("sqla_jobs.worker")


class HistoryKeeper:
    """The ``history`` role's loop. ``partitions``: whether this worker makes and drops
    partitions (the whole :func:`~sqla_jobs.history.maintain`) or runs the mover only; it
    turns False for good (until restart) the first time partition DDL is refused."""

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
        partitions: bool = True,
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
        self.partitions = partitions
        self.runs = 0  # completed runs, for tests and health

    def run_once(self) -> MaintenanceReport:
        """One run: the whole maintenance, or the mover alone (``partitions`` False)."""
        if not self.partitions:
            return MaintenanceReport(
                moved=move_finished(self.engine, self.model, result_model=self.result_model)
            )
        return maintain(
            self.engine,
            self.model,
            retention=self.retention,
            result_model=self.result_model,
        )

    def loop(self) -> None:
        wait = 0.0
        checked = not self.partitions
        while not self.finished.wait(wait):
            if self.stopping.is_set():
                wait = 0.5
                continue
            try:
                if not checked:
                    self._check_privileges()
                    checked = True
                report = self.run_once()
            except Exception as exc:
                if self.partitions and refused_privilege(exc):
                    self._stop_partitions(describe(getattr(exc, "orig", None) or exc))
                    wait = 0.0  # the mover, at once
                    continue
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

    def _check_privileges(self) -> None:
        """Before the first run: stop partition upkeep if this role may not do it."""
        history = history_table(self.model)
        with self.engine.connect() as connection:
            found = MAY_KEEP_PARTITIONS.one(
                connection, None, {"history": qualified_name(history.name, history.schema)}
            )
        if found is None or (found.acts_as_owner and found.may_create):
            return
        missing = [] if found.acts_as_owner else [f"is not {found.owner}, its owner, nor a member"]
        if not found.may_create:
            missing.append("may not create tables in its schema")
        self._stop_partitions(f"role {found.role} {' and '.join(missing)}")

    def _stop_partitions(self, why: str) -> None:
        """The one way partition upkeep stops: one warning, then the mover only."""
        self.partitions = False
        history = history_table(self.model).fullname
        model = f"{self.model.__module__}:{self.model.__name__}"
        logger.warning(
            "history maintenance of %s: this worker may not make or drop its partitions "
            "(%s); that is for the table's owner: run `sqla-jobs history --model %s` as the "
            "owner from cron (daily at least; --retention for retention) and start the "
            "workers with history_partitions=False (--no-history-partitions), or make this "
            "worker's role a member of the owner role (GRANT <owner> TO <role>). Until it "
            "restarts, this worker moves finished jobs into the history and tries no "
            "partition DDL",
            history,
            why,
            model,
            extra={
                "action": "history_partitions_not_permitted",
                "history_table": history,
                "reason": why,
            },
        )
