"""The pause table of a job model: the queues whose jobs no claim starts.

Every job table has one, derived from its name when the model is mapped, in the same
``MetaData`` (as the history table is, :mod:`sqla_jobs.schema.history`), so that
``metadata.create_all()`` and Alembic's autogenerate see it like any table of yours::

    email_jobs_pauses (
        queue     varchar(200) PRIMARY KEY,  -- a queue name (sqla_jobs.validation.NAME_RULE)
        paused_at timestamptz NOT NULL DEFAULT now(),  -- the database's clock
        reason    text                                 -- what the pauser said, or NULL
    )

A row is a paused queue: :func:`sqla_jobs.pause_queue` inserts it, :func:`sqla_jobs.resume_queue`
deletes it, and every claim statement reads it (once per claim, before any job is read),
so that a pause takes effect at the next claim of every worker, with no leader and
no restart. A queue needs no jobs to be paused: a pause made before the first job of a queue
is enqueued holds that job too. The table is as small as the number of paused queues;
migrations create it with :func:`sqla_jobs.migrations.create_pause_table`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Column, DateTime, PrimaryKeyConstraint, String, Table, Text, event, func
from sqlalchemy.orm import Mapper

from sqla_jobs import validation
from sqla_jobs.ddl import qualified_name
from sqla_jobs.naming import identifier
from sqla_jobs.schema import JobMixin, job_table_of

__all__ = [
    "MAX_REASON_LENGTH",
    "PAUSE_COLUMNS",
    "PauseNames",
    "pause_names",
    "pause_table",
    "paused_predicate",
]

#: The pause table's columns, in order.
PAUSE_COLUMNS: Final = ("queue", "paused_at", "reason")
#: The longest reason kept with a pause, in characters.
MAX_REASON_LENGTH: Final = 1000


@dataclass(frozen=True)
class PauseNames:
    """The names of a job table's pause table and its primary key."""

    job_table: str
    table: str
    primary_key: str


def pause_names(job_table: str) -> PauseNames:
    """Derive the pause table's names from the job table's name (``<table>_pauses``, hashed
    like :func:`sqla_jobs.names` past PostgreSQL's 63 bytes)."""
    table = identifier(job_table, "pauses")
    return PauseNames(job_table=job_table, table=table, primary_key=identifier(table, "pkey"))


def pause_table(model: type[Any] | Table) -> Table:
    """The pause table of a job model (or job table), in the job table's ``MetaData``.

    Built once (when the model is mapped, or at the first call) and returned from the
    ``MetaData`` afterwards. Map a class of your own onto it to query it::

        class EmailJobPause(Base):
            __table__ = sqla_jobs.schema.pauses.pause_table(EmailJob)
    """
    job = job_table_of(model)
    n = pause_names(job.name)
    key = n.table if job.schema is None else f"{job.schema}.{n.table}"
    existing = job.metadata.tables.get(key)
    if existing is not None:
        return existing
    return Table(
        n.table,
        job.metadata,
        Column("queue", String(validation.MAX_NAME_LENGTH), nullable=False),
        Column("paused_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("reason", Text, nullable=True),
        PrimaryKeyConstraint("queue", name=n.primary_key),
        schema=job.schema,
        info={"sqla_jobs_pauses_of": job.name},
    )


def paused_predicate(job_table: Table, queue: str) -> str:
    """``EXISTS (SELECT FROM <pauses> AS p WHERE p.queue = <queue>)`` as SQL text: whether
    the queue ``queue`` (a column or a parameter, as SQL) is paused. One probe of the pause
    table's primary key; every claim statement negates it for the queues it serves."""
    table = qualified_name(pause_names(job_table.name).table, job_table.schema)
    return f"EXISTS (SELECT FROM {table} AS p WHERE p.queue = {queue})"


def _attach_pauses(mapper: Mapper[Any], cls: type[Any]) -> None:
    table = mapper.local_table
    if isinstance(table, Table):
        pause_table(table)


event.listen(JobMixin, "after_mapper_constructed", _attach_pauses, propagate=True)
