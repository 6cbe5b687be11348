"""The rate table of a job model: the recent starts of its rate-limited queues.

Optional, like the schedule table of periodic jobs: a job table whose workers use rate
limits (:class:`~sqla_jobs.RateLimit`, ``Registry(rate_limits=...)``) has one beside it,
derived from its name, in the same ``MetaData``; migrations create it with
:func:`sqla_jobs.migrations.create_rate_table`::

    email_jobs_rates (
        queue  varchar(200) NOT NULL,            -- a rate-limited queue
        key    text NOT NULL DEFAULT '',         -- '' for the queue's own limit
        starts timestamptz[] NOT NULL DEFAULT '{}',  -- when each claim of the window ran
        counts integer[] NOT NULL DEFAULT '{}',      -- how many attempts each one started
        rate_limit integer,                      -- the limit and window of the last claim
        window_seconds double precision,         -- that logged (for status and metrics)
        PRIMARY KEY (queue, key)
    )

One row per rate-limited queue, written by each claim that starts jobs of the queue (in the
claim's transaction) and read by the next: the claims of the last window, as two arrays of
the same length, pruned to the window at every write. See
:func:`sqla_jobs._queries.rates.log_starts` for the rule it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import (
    ARRAY,
    Column,
    DateTime,
    Float,
    Integer,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    text,
)

from sqla_jobs import validation
from sqla_jobs.ddl import qualified_name
from sqla_jobs.naming import identifier
from sqla_jobs.schema import job_table_of

__all__ = ["RATE_COLUMNS", "RateNames", "rate_names", "rate_table", "rate_table_name"]

#: The rate table's columns, in order.
RATE_COLUMNS: Final = ("queue", "key", "starts", "counts", "rate_limit", "window_seconds")


@dataclass(frozen=True)
class RateNames:
    """The names of a job table's rate table and its primary key."""

    job_table: str
    table: str
    primary_key: str


def rate_names(job_table: str) -> RateNames:
    """Derive the rate table's names from the job table's name (``<table>_rates``, hashed
    like :func:`sqla_jobs.names` past PostgreSQL's 63 bytes)."""
    table = identifier(job_table, "rates")
    return RateNames(job_table=job_table, table=table, primary_key=identifier(table, "pkey"))


def rate_table_name(job_table: Table) -> str:
    """The rate table of ``job_table``, qualified and quoted for SQL text."""
    return qualified_name(rate_names(job_table.name).table, job_table.schema)


def rate_table(model: type[Any] | Table) -> Table:
    """The rate table of a job model (or job table), in the job table's ``MetaData``.

    Built at the first call and returned from the ``MetaData`` afterwards: call it where
    your models are declared (``rate_table(EmailJob)``) for ``metadata.create_all()`` and
    Alembic's autogenerate to see it.
    """
    job = job_table_of(model)
    n = rate_names(job.name)
    key = n.table if job.schema is None else f"{job.schema}.{n.table}"
    existing = job.metadata.tables.get(key)
    if existing is not None:
        return existing
    return Table(
        n.table,
        job.metadata,
        Column("queue", String(validation.MAX_NAME_LENGTH), nullable=False),
        Column("key", Text, nullable=False, server_default=text("''")),
        Column(
            "starts",
            ARRAY(DateTime(timezone=True)),
            nullable=False,
            server_default=text("'{}'"),
        ),
        Column("counts", ARRAY(Integer), nullable=False, server_default=text("'{}'")),
        Column("rate_limit", Integer, nullable=True),
        Column("window_seconds", Float, nullable=True),
        PrimaryKeyConstraint("queue", "key", name=n.primary_key),
        schema=job.schema,
        info={"sqla_jobs_rates_of": job.name},
    )
