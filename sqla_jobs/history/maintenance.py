"""Partition upkeep, retention and the mover: the history's maintenance.

Three jobs, each safe to run from any number of processes at once, with no leader:

* :func:`create_partitions` makes the day partitions from today to ``days_ahead`` days
  ahead (a completion lands in today's; the ``DEFAULT`` partition catches the rest).
* :func:`drop_partitions` drops every day partition that ended before ``older_than`` ago:
  whole partitions, no ``DELETE`` scan (and deletes, in batches, rows that the ``DEFAULT``
  partition holds from before then).
* :func:`move_finished` moves finished jobs that are still in the job table into the
  history, in batches: jobs a claim made dead (their last attempt lost its lease), and every
  finished job of a table that had no history before (after the migration).

Each partition operation is a transaction of its own that first takes a transaction-scoped
advisory lock with ``pg_try_advisory_xact_lock`` (one key per history table): a second run
finds it taken and skips the operation rather than wait, so two runs never collide. The DDL
takes an ``ACCESS EXCLUSIVE`` lock on the history table (not on the job table: claims never
wait for it); it runs with a short ``lock_timeout`` (default 0.2 s), so that completions,
which insert into the history, queue behind it at most that long. An operation that times
out is skipped and reported, for the next run.

:func:`maintain` runs all three; the worker runs it in its ``history`` role, and ``sqla-jobs
history`` from the command line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from typing import Any, Final, TypeVar

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session

from sqla_jobs import validation
from sqla_jobs._queries.history import (
    DELETE_DEFAULT_BEFORE,
    PRUNE_ENDED_WORKFLOWS,
    SWEEP,
    SWEEP_WINDOW,
    drop_day_partition,
    found_record,
    hold_maintenance_lock,
    make_day_partition,
    partition_rows,
    statement_time,
)
from sqla_jobs._queries.variant import tables_of
from sqla_jobs.errors import ConfigurationError, InvalidJobError
from sqla_jobs.events import describe
from sqla_jobs.schema import JobMixin, JobResultMixin
from sqla_jobs.schema.history import has_history, history_names, partition_day

__all__ = [
    "DEFAULT_DAYS_AHEAD",
    "DEFAULT_LOCK_TIMEOUT",
    "JobRecord",
    "MaintenanceReport",
    "Partition",
    "create_partitions",
    "drop_partitions",
    "job_record",
    "list_partitions",
    "maintain",
    "move_finished",
]

logger = logging.getLogger(__name__)

#: Day partitions made ahead of today.
DEFAULT_DAYS_AHEAD: Final = 7
#: How long partition DDL may wait for its lock before it gives up until the next run.
DEFAULT_LOCK_TIMEOUT: Final = 0.2
_BOUND: Final = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")
_LOCK_NOT_AVAILABLE: Final = "55P03"
#: SQLSTATE insufficient_privilege: "must be owner of table", "permission denied for ...".
_INSUFFICIENT_PRIVILEGE: Final = "42501"


def refused_privilege(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL refusing a statement for want of a privilege."""
    return (
        isinstance(exc, DBAPIError)
        and getattr(exc.orig, "sqlstate", None) == _INSUFFICIENT_PRIVILEGE
    )


_T = TypeVar("_T")


@dataclass(frozen=True)
class Partition:
    """One partition of a history table: ``start``/``end`` in UTC, both None for the
    ``DEFAULT`` partition."""

    name: str
    start: datetime | None
    end: datetime | None


@dataclass
class MaintenanceReport:
    """What one maintenance run did. ``skipped`` names the operations left for a later run:
    another run held the maintenance lock, or the lock on the history table was not
    granted within ``lock_timeout``."""

    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    moved: int = 0
    default_rows_deleted: int = 0
    #: Workflows deleted by the retention of a model with workflow steps.
    workflows_deleted: int = 0
    moved_from_default: int = 0
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class JobRecord:
    """A job's full row, wherever it is: every column of the job table (``values``, your
    own columns included), its ``result`` and whether it is in the history."""

    values: dict[str, Any]
    result: Any
    in_history: bool

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def _history_model(model: object) -> Table:
    if not (isinstance(model, type) and issubclass(model, JobMixin)):
        raise ConfigurationError(f"{model!r} is not a mapped class that mixes in JobMixin")
    if not has_history(model):
        raise ConfigurationError(
            f"{model.__name__} has no partitioned history: set partitioned_history = True"
        )
    table = model.__table__  # type: ignore[attr-defined]
    assert isinstance(table, Table)
    return table


def _check_days(field_: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 366:
        raise InvalidJobError(field_, f"must be an integer in [0, 366], got {value!r}")
    return value


def _check_timeout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 60:
        raise InvalidJobError("lock_timeout", f"must be in (0, 60] seconds, got {value!r}")
    return float(value)


def _parse(value: str) -> datetime:
    # Printed in UTC (sqla_jobs._queries.history.UTC): '2026-01-31 00:00:00+00'.
    return datetime.fromisoformat(value.replace("+00", "+00:00")).astimezone(timezone.utc)


def _partitions(connection: Connection, table: Table) -> list[Partition]:
    found = []
    for row in partition_rows(connection, table):
        match = _BOUND.search(row.bound or "")
        if match is None:
            found.append(Partition(row.name, None, None))
        else:
            found.append(Partition(row.name, _parse(match.group(1)), _parse(match.group(2))))
    return found


def list_partitions(engine: Engine, model: type[JobMixin]) -> list[Partition]:
    """The partitions of the model's history table, by name (reads the catalog)."""
    table = _history_model(model)
    with engine.connect() as connection:
        return _partitions(connection, table)


def _locked(
    engine: Engine,
    table: Table,
    lock_timeout: float,
    work: Callable[[Connection], _T],
) -> tuple[bool, _T | None]:
    """Run ``work`` in a transaction of its own that holds the history's maintenance lock,
    with ``lock_timeout``. ``(False, None)`` when another run holds the lock or the wait for
    a table lock timed out (nothing changed then)."""
    try:
        with engine.begin() as connection:
            if not hold_maintenance_lock(connection, table, lock_timeout):
                return False, None
            return True, work(connection)
    except OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE:
            return False, None
        raise


def _today(engine: Engine) -> date:
    with engine.connect() as connection:
        return partition_day(statement_time(connection))


def create_partitions(
    engine: Engine,
    model: type[JobMixin],
    *,
    days_ahead: int = DEFAULT_DAYS_AHEAD,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    report: MaintenanceReport | None = None,
) -> MaintenanceReport:
    """Create the missing day partitions from today (the database's clock, UTC) to
    ``days_ahead`` days ahead; one transaction each. Rows of a day that finished before its
    partition existed (in the ``DEFAULT`` partition) move into it as it is made
    (``moved_from_default``).

    Each day is made on its own: the days ahead first (they hold no rows yet: cheap, and
    never held up by today's), and a day that cannot be made now (its locks not had within
    ``lock_timeout``, an error) is logged and left for the next run (``skipped``), never in
    the way of the others. While a partition is made, inserts into the history wait
    (:func:`~sqla_jobs.schema.history.hold_inserts`): a completion then is late, never
    refused."""
    table = _history_model(model)
    days = _check_days("days_ahead", days_ahead)
    timeout = _check_timeout(lock_timeout)
    report = report or MaintenanceReport()
    n = history_names(table.name, table.schema)
    today = _today(engine)
    with engine.connect() as connection:
        existing = {p.name for p in _partitions(connection, table)}
    for offset in [*range(1, days + 1), 0]:
        day = today + timedelta(days=offset)
        name = n.partition(day)
        if name in existing:
            continue

        def make(connection: Connection, day: date = day) -> int:
            # Rows of the day that sit in DEFAULT move into the new partition.
            return make_day_partition(connection, table, day)

        try:
            done, moved = _locked(engine, table, timeout, make)
        except DBAPIError as exc:
            # Only a failure of this day's own is left for the next run: a missing privilege
            # (the worker's maintenance says so once and stops trying) and a lost connection
            # are the caller's.
            if refused_privilege(exc) or exc.connection_invalidated:
                raise
            logger.warning(
                "history partition %s not made: %s; the next run tries again",
                name,
                describe(exc),
                extra={"action": "history_partition_failed", "partition": name},
            )
            done, moved = False, None
        if not done:
            report.skipped.append(f"create {name}")
        else:
            report.created.append(name)
            report.moved_from_default += moved or 0
    report.created.sort()  # by day (their names end in it), whatever the order made
    if report.created:
        logger.info(
            "created history partitions %s",
            ", ".join(report.created),
            extra={"action": "history_partitions_created", "partitions": report.created},
        )
    return report


def drop_partitions(
    engine: Engine,
    model: type[JobMixin],
    *,
    older_than: timedelta | float,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    batch_size: int = 10_000,
    report: MaintenanceReport | None = None,
) -> MaintenanceReport:
    """Retention: drop every day partition whose whole day ended more than ``older_than``
    ago (the database's clock), one ``DROP TABLE`` per partition in a transaction of its
    own; then delete, ``batch_size`` at a time, the ``DEFAULT`` partition's rows that
    finished before then. Never a ``DELETE`` of a day partition's rows. For a model with
    workflow steps, the workflows that ended before then and have no step left in the job
    table are deleted too, ``batch_size`` at a time (``workflows_deleted``): their steps
    are in partitions dropped now or soon (a day partition goes once its whole day is past
    the cutoff), and a step whose workflow is gone cannot be retried."""
    table = _history_model(model)
    keep = validation.check_duration("older_than", older_than)
    timeout = _check_timeout(lock_timeout)
    report = report or MaintenanceReport()
    with engine.connect() as connection:
        now = statement_time(connection)
        found = _partitions(connection, table)
    cutoff = now - keep
    for partition in found:
        if partition.end is None or partition.end > cutoff:
            continue

        def drop(connection: Connection, name: str = partition.name) -> None:
            drop_day_partition(connection, table, name)

        done, _ = _locked(engine, table, timeout, drop)
        if done:
            report.dropped.append(partition.name)
        else:
            report.skipped.append(f"drop {partition.name}")
    while True:
        with engine.begin() as connection:
            deleted = len(
                DELETE_DEFAULT_BEFORE.rows(
                    connection, table, {"cutoff": cutoff, "limit": batch_size}
                )
            )
        report.default_rows_deleted += deleted
        if deleted < batch_size:
            break
    workflow = tables_of(model).workflow
    while workflow is not None:
        with engine.begin() as connection:
            deleted = len(
                PRUNE_ENDED_WORKFLOWS.rows(
                    connection, table, {"cutoff": cutoff, "limit": batch_size}, workflow=workflow
                )
            )
        report.workflows_deleted += deleted
        if deleted < batch_size:
            break
    if report.dropped:
        logger.info(
            "dropped history partitions %s",
            ", ".join(report.dropped),
            extra={"action": "history_partitions_dropped", "partitions": report.dropped},
        )
    return report


def move_finished(
    engine: Engine,
    model: type[JobMixin],
    *,
    result_model: type[JobResultMixin] | None = None,
    scan: int = 10_000,
    max_windows: int | None = None,
) -> int:
    """Move the finished jobs still in the job table into the history, one window of
    ``scan`` ids per transaction (:func:`sqla_jobs._queries.history.sweep`), walking the
    primary key from the lowest id to the highest; each job's row of ``result_model`` (by
    default the model's own ``result_model``) moves into its history row. Returns how many
    jobs moved. Rows locked by others are skipped (a later run takes them); pending and
    running jobs stay. For a model with workflow steps, whose jobs finish in place, this is
    how they reach the history: a workflow's steps once the workflow ended."""
    table = _history_model(model)
    workflow = tables_of(model).workflow
    result_model = result_model or model.result_model
    results = None
    if result_model is not None:
        results = result_model.__table__  # type: ignore[attr-defined]
    after = 0
    moved = 0
    windows = 0
    while max_windows is None or windows < max_windows:
        with engine.begin() as connection:
            window = SWEEP_WINDOW.one(connection, table, {"after": after, "scan": scan})
            upto = None if window is None else window.max
            if upto is None:
                break
            rows = SWEEP.rows(
                connection,
                table,
                {"after": after, "upto": upto},
                result_table=results,
                workflow=workflow,
            )
        moved += len(rows)
        after = upto
        windows += 1
    if moved:
        logger.info(
            "moved %d finished jobs into the history",
            moved,
            extra={"action": "history_moved", "count": moved},
        )
    return moved


def maintain(
    engine: Engine,
    model: type[JobMixin],
    *,
    retention: timedelta | float | None = None,
    days_ahead: int = DEFAULT_DAYS_AHEAD,
    result_model: type[JobResultMixin] | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> MaintenanceReport:
    """One maintenance run: :func:`create_partitions`, :func:`move_finished`, then, with a
    ``retention``, :func:`drop_partitions` older than it."""
    report = create_partitions(engine, model, days_ahead=days_ahead, lock_timeout=lock_timeout)
    report.moved = move_finished(engine, model, result_model=result_model)
    if retention is not None:
        drop_partitions(
            engine, model, older_than=retention, lock_timeout=lock_timeout, report=report
        )
    return report


def job_record(
    session: Session | Connection, model: type[JobMixin], job_id: int
) -> JobRecord | None:
    """Job ``job_id``'s full record (args, attempts, last error, result, your columns),
    whether it is still in the job table or in the history; None when it is in neither.
    Reads in the caller's transaction."""
    table = _history_model(model)
    validation.check_job_id("job_id", job_id)
    found = found_record(session, table, job_id)
    if found is None:
        return None
    return JobRecord(values=found.values, result=found.result, in_history=found.in_history)
