"""Pausing queues: the statements on a job table's pause table
(:func:`~sqla_jobs.schema.pauses.pause_table`); see :mod:`sqla_jobs._queries`.

The claim statements read the pause table themselves (:func:`~sqla_jobs._queries.claim`,
:func:`~sqla_jobs._queries.lock_keys`, :func:`~sqla_jobs._queries.walk_keys`,
:func:`~sqla_jobs._queries.claim_keyed`); these write and list it.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import (
    ColumnElement,
    Float,
    Select,
    Table,
    Text,
    bindparam,
    cast,
    delete,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.sql.dml import ReturningDelete, ReturningInsert

from sqla_jobs._queries._sql import _now
from sqla_jobs._queries.run import NoParams, Query
from sqla_jobs.schema import names
from sqla_jobs.schema.pauses import pause_table


def pause(table: Table) -> ReturningInsert[Any]:
    """Pause the queue ``:queue`` of ``table``'s jobs: insert its row into the pause table,
    ``paused_at`` the database's clock. Idempotent: a queue paused already keeps its
    ``paused_at``, and its reason unless ``:reason`` gives a new one. Returns ``queue,
    paused_at, reason``. Locks the queue's row of the pause table (an insert, or the update
    of a pause there already) until the transaction ends; claims read the table without
    waiting for it, and see the pause from the commit on."""
    pauses = pause_table(table)
    statement = insert(pauses).values(
        queue=bindparam("queue", type_=Text), reason=bindparam("reason", type_=Text)
    )
    return statement.on_conflict_do_update(
        index_elements=[pauses.c.queue],
        set_={"reason": func.coalesce(statement.excluded.reason, pauses.c.reason)},
    ).returning(pauses.c.queue, pauses.c.paused_at, pauses.c.reason)


def resume(table: Table) -> ReturningDelete[Any]:
    """Resume the queue ``:queue``: delete its row from the pause table, and notify the job
    table's channel with the queue's name (as an enqueue does, delivered at commit), so
    that idle workers serving it claim at once instead of at their next poll. Returns
    ``queue`` (and the notification's empty value), or no row when the queue was not
    paused (then nothing is sent)."""
    pauses = pause_table(table)
    channel: ColumnElement[str] = literal_column(
        "'" + names(table.name).channel.replace("'", "''") + "'"
    )
    return (
        delete(pauses)
        .where(pauses.c.queue == bindparam("queue", type_=Text))
        .returning(pauses.c.queue, func.pg_notify(channel, pauses.c.queue))
    )


def paused_queues(table: Table) -> Select[Any]:
    """The paused queues of ``table``'s jobs, by name: ``queue, paused_at, reason,
    paused_seconds`` (for how long, by the database's clock). Reads the pause table whole
    (one row per paused queue); takes no lock."""
    pauses = pause_table(table)
    return select(
        pauses.c.queue,
        pauses.c.paused_at,
        pauses.c.reason,
        cast(func.extract("epoch", _now() - pauses.c.paused_at), Float).label("paused_seconds"),
    ).order_by(pauses.c.queue)


# -- the queries --------------------------------------------------------------------------


class PauseParams(TypedDict):
    """:func:`pause`'s parameters."""

    queue: str
    reason: str | None


class QueueParams(TypedDict):
    """:func:`resume`'s parameters."""

    queue: str


class PauseRow(NamedTuple):
    """A pause as :func:`pause` returns it."""

    queue: str
    paused_at: datetime
    reason: str | None


class ResumeRow(NamedTuple):
    """A queue :func:`resume` resumed."""

    queue: str
    notified: Any = None


class PausedQueueRow(NamedTuple):
    """A row of :func:`paused_queues`."""

    queue: str
    paused_at: datetime
    reason: str | None
    paused_seconds: float | Decimal | None


PAUSE: Final = Query(pause, PauseParams, PauseRow)
RESUME: Final = Query(resume, QueueParams, ResumeRow)
PAUSED_QUEUES: Final = Query(paused_queues, NoParams, PausedQueueRow)
