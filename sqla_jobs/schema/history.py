"""The history table of a job model: finished jobs, partitioned by when they finished.

A job model opts in with ``partitioned_history = True``::

    class EmailJob(JobMixin, Base):
        __tablename__ = "email_jobs"
        partitioned_history = True

Its history table (``email_jobs_history``, :func:`history_names`) is derived from the job
table when the model is mapped, in the same ``MetaData``: every column of the job table,
your own columns included (without their foreign keys: history outlives the rows they
pointed at), plus ``result`` (jsonb, the handler's return value). The primary key is
``(id, finished_at)``, because PostgreSQL requires the partition key in it; ``id`` leads, so
a lookup by id reads one index entry per partition. The table is ``PARTITION BY RANGE
(finished_at)``, one partition per UTC day (``email_jobs_history_p20260131``) and a
``DEFAULT`` partition that catches a row no day partition takes (maintenance did not run),
so that a completion never fails for want of a partition. A partial index of the dead
jobs, ``(finished_at, id, queue) WHERE status = 'dead'`` (``email_jobs_history_dead_idx``,
one on each partition), lets health count and list them without reading the rest of the
history.

Map a class of your own onto it to query it::

    class EmailJobHistory(Base):
        __table__ = sqla_jobs.history_table(EmailJob)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from typing import Any, Final

from sqlalchemy import (
    Column,
    DefaultClause,
    Index,
    PrimaryKeyConstraint,
    Table,
    TextClause,
    event,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapper

from sqla_jobs.ddl import executable, qualified_name
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.naming import identifier
from sqla_jobs.schema import JobMixin, dead_predicate, job_table_of

__all__ = [
    "PARTITION_KEY",
    "RESULT_COLUMN",
    "HistoryNames",
    "attach_partition",
    "create_default_partition",
    "create_detached_partition",
    "create_partition",
    "day_bounds",
    "drop_partition",
    "has_history",
    "history_names",
    "history_table",
    "is_history_partition",
    "partition_day",
]

#: The column the history is partitioned by.
PARTITION_KEY: Final = "finished_at"
#: The column of the history table that holds a succeeded job's result.
RESULT_COLUMN: Final = "result"
_DAY_FORMAT: Final = "%Y%m%d"
_PARTITION_SUFFIX: Final = re.compile(r"_p(\d{8}|default)$")


@dataclass(frozen=True)
class HistoryNames:
    """The names of a job table's history table and its partitions."""

    job_table: str
    table: str
    primary_key: str
    dead_index: str
    #: The steps' index of a model with workflow steps (:class:`~sqla_jobs.StepMixin`).
    workflow_index: str
    default_partition: str
    lock_key: str

    def partition(self, day: date) -> str:
        """The name of the partition of ``day`` (UTC)."""
        return identifier(self.table, f"p{day.strftime(_DAY_FORMAT)}")


def history_names(job_table: str, schema: str | None = None) -> HistoryNames:
    """Derive the history table's names from the job table's name (see :func:`names`)."""
    table = identifier(job_table, "history")
    return HistoryNames(
        job_table=job_table,
        table=table,
        primary_key=identifier(table, "pkey"),
        dead_index=identifier(table, "dead_idx"),
        workflow_index=identifier(table, "workflow_idx"),
        default_partition=identifier(table, "pdefault"),
        # The advisory lock that keeps two maintenance runs of one history apart.
        lock_key=f"sqla_jobs.history:{qualified_name(table, schema)}",
    )


def is_history_partition(name: str) -> bool:
    """Whether a table name is one of a history table's partitions (``..._p20260131`` or
    ``..._pdefault``): for an Alembic ``include_name`` hook, since partitions are tables
    that no model declares."""
    return _PARTITION_SUFFIX.search(name) is not None


def partition_day(value: datetime) -> date:
    """The UTC day a finish time falls in."""
    return value.astimezone(timezone.utc).date()


def day_bounds(day: date) -> tuple[datetime, datetime]:
    """The ``[start, end)`` of a day partition, in UTC."""
    start = datetime.combine(day, time(), tzinfo=timezone.utc)
    return start, start + timedelta(days=1)


def has_history(model: type[Any]) -> bool:
    """Whether a job model keeps its finished jobs in a partitioned history table."""
    return bool(getattr(model, "partitioned_history", False))


#: The step column of a model with workflow steps, indexed in its history.
WORKFLOW_COLUMN: Final = "workflow_id"
#: The one job column whose server default the history keeps (see :func:`history_table`).
SNOOZES_COLUMN: Final = "snoozes"


def history_table(model: type[Any] | Table) -> Table:
    """The history table of a job model (or job table), in the job table's ``MetaData``.

    Built once (when a model with ``partitioned_history = True`` is mapped, or at the first
    call) and returned from the ``MetaData`` afterwards, so ``metadata.create_all()`` and
    Alembic's autogenerate see it like any table of yours. ``create_all()`` also creates its
    ``DEFAULT`` partition; the day partitions come from the migration helper and from the
    maintenance (:func:`sqla_jobs.history.maintain`).
    """
    job = job_table_of(model)
    n = history_names(job.name, job.schema)
    key = n.table if job.schema is None else f"{job.schema}.{n.table}"
    existing = job.metadata.tables.get(key)
    if existing is not None:
        return existing
    columns: list[Any] = []
    for column in job.columns:
        nullable = False if column.name in ("id", PARTITION_KEY) else column.nullable
        # No defaults (the rows are copies), but for the snooze count of schema version 4,
        # a NOT NULL column that a row written by hand (of an older version) leaves out.
        kept = column.server_default if column.name == SNOOZES_COLUMN else None
        default = kept.arg if isinstance(kept, DefaultClause) else None
        assert default is None or isinstance(default, str | TextClause)
        columns.append(
            Column(
                column.name,
                column.type,
                nullable=bool(nullable),
                key=column.key,
                server_default=default,
            )
        )
    if RESULT_COLUMN in job.columns:
        raise ConfigurationError(
            f"{job.name} has a column named {RESULT_COLUMN!r}, which its history table needs "
            "for the job's result; rename it"
        )
    columns.append(Column(RESULT_COLUMN, JSONB, nullable=True))
    table = Table(
        n.table,
        job.metadata,
        *columns,
        PrimaryKeyConstraint("id", PARTITION_KEY, name=n.primary_key),
        # The dead jobs (a partitioned index: one partial index on each partition), so
        # that health counts and lists them without reading the rest of the history:
        # finish time first, so that dead_jobs reads the newest backwards and stops at its
        # limit; queue last, so that queue_stats counts them from the index alone.
        Index(n.dead_index, PARTITION_KEY, "id", "queue", postgresql_where=text(dead_predicate())),
        *_workflow_index(job, n),
        schema=job.schema,
        postgresql_partition_by=f"RANGE ({PARTITION_KEY})",
        info={"sqla_jobs_history_of": job.name},
    )
    sql = create_default_partition(job.name, job.schema)
    event.listen(table, "after_create", executable(sql).execute_if(dialect="postgresql"))
    return table


def _workflow_index(job: Table, n: HistoryNames) -> list[Index]:
    # A model with workflow steps: a finished workflow's steps, found by its id (a retry
    # brings them back, the workflow's page lists them), one index range per partition.
    if WORKFLOW_COLUMN not in job.columns:
        return []
    return [
        Index(
            n.workflow_index,
            WORKFLOW_COLUMN,
            postgresql_where=text(f"{WORKFLOW_COLUMN} IS NOT NULL"),
        )
    ]


def create_default_partition(job_table: str, schema: str | None = None) -> str:
    """``CREATE TABLE IF NOT EXISTS <history>_pdefault PARTITION OF <history> DEFAULT``."""
    n = history_names(job_table, schema)
    return (
        f"CREATE TABLE IF NOT EXISTS {qualified_name(n.default_partition, schema)} "
        f"PARTITION OF {qualified_name(n.table, schema)} DEFAULT"
    )


def create_partition(job_table: str, day: date, schema: str | None = None) -> str:
    """``CREATE TABLE IF NOT EXISTS`` of the partition of one UTC day.

    Takes an ``ACCESS EXCLUSIVE`` lock on the history table and its ``DEFAULT`` partition
    (which it scans for rows of that day: none, normally) until the transaction ends; run
    it with a short ``lock_timeout``.
    """
    n = history_names(job_table, schema)
    start, end = day_bounds(day)
    return (
        f"CREATE TABLE IF NOT EXISTS {qualified_name(n.partition(day), schema)} "
        f"PARTITION OF {qualified_name(n.table, schema)} "
        f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    )


def create_detached_partition(job_table: str, day: date, schema: str | None = None) -> str:
    """``CREATE TABLE <partition of day> (LIKE <history>)``: a table of the history's
    columns, not yet a partition (see :func:`attach_partition`)."""
    n = history_names(job_table, schema)
    return (
        f"CREATE TABLE {qualified_name(n.partition(day), schema)} "
        f"(LIKE {qualified_name(n.table, schema)})"
    )


def hold_inserts(job_table: str, schema: str | None = None) -> str:
    """``LOCK TABLE <history> IN SHARE ROW EXCLUSIVE MODE``: until the transaction ends, no
    row can be inserted into the history (an insert waits), while reads go on. A partition
    made beside a ``DEFAULT`` one needs it: an insert routes its row to a partition before
    it locks that partition, so a row of the new partition's day routed to ``DEFAULT`` just
    before the partition is made would fail its ``DEFAULT`` constraint (a completion
    refused), or make the partition's ``ATTACH`` fail. Taken on the history table itself,
    which every insert locks before it routes."""
    n = history_names(job_table, schema)
    return f"LOCK TABLE {qualified_name(n.table, schema)} IN SHARE ROW EXCLUSIVE MODE"


def attach_partition(job_table: str, day: date, schema: str | None = None) -> str:
    """``ALTER TABLE <history> ATTACH PARTITION <partition of day> FOR VALUES ...``.
    Takes a ``SHARE UPDATE EXCLUSIVE`` lock on the history table and an ``ACCESS
    EXCLUSIVE`` one on its ``DEFAULT`` partition, which it scans."""
    n = history_names(job_table, schema)
    start, end = day_bounds(day)
    return (
        f"ALTER TABLE {qualified_name(n.table, schema)} "
        f"ATTACH PARTITION {qualified_name(n.partition(day), schema)} "
        f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    )


def drop_partition(name: str, schema: str | None = None) -> str:
    """``DROP TABLE IF EXISTS`` of one partition: its rows go at once, without a scan.
    Takes an ``ACCESS EXCLUSIVE`` lock on the history table until the transaction ends."""
    return f"DROP TABLE IF EXISTS {qualified_name(name, schema)}"


def _attach_history(mapper: Mapper[Any], cls: type[Any]) -> None:
    if not has_history(cls):
        return
    if getattr(cls, "delete_on_success", False):
        raise ConfigurationError(
            f"{cls.__name__} sets both partitioned_history and delete_on_success; a model "
            "with history moves its finished jobs there, so leave delete_on_success out"
        )
    table = mapper.local_table
    if isinstance(table, Table):
        history_table(table)


event.listen(JobMixin, "after_mapper_constructed", _attach_history, propagate=True)
