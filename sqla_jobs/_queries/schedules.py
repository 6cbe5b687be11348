"""The periodic schedules' statements as queries: each builder of
:mod:`sqla_jobs._queries.enqueueing` that :mod:`sqla_jobs.periodic` runs (a schedule's row
created and advanced, the database's clock), with the record of its bind parameters and its
row (see :class:`~sqla_jobs._queries.run.Query`). The builders stay where they are (the
enqueueing statements' module); the queries that name them live here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final, NamedTuple, TypedDict

from sqla_jobs._queries.enqueueing import database_now, schedule_advance, schedule_create
from sqla_jobs._queries.run import Executor, NoParams, Query

__all__ = [
    "DATABASE_NOW",
    "SCHEDULE_ADVANCE",
    "SCHEDULE_CREATE",
    "AdvancedRow",
    "CreatedRow",
    "NowRow",
    "ScheduleParams",
    "SlotParams",
    "database_clock",
]


class SlotParams(TypedDict):
    """A periodic task's schedule (its row's ``name``) and the slot it moves to."""

    schedule_name: str
    slot: datetime


class ScheduleParams(SlotParams):
    """:class:`SlotParams` and the ``horizon`` past which a recorded slot is the mark of a
    clock read that was ahead (:func:`sqla_jobs.periodic.enqueue_due`)."""

    horizon: datetime


class CreatedRow(NamedTuple):
    """The schedule's row, created by this transaction."""

    name: str


class AdvancedRow(NamedTuple):
    """The slot the schedule's row moved from."""

    recorded: datetime


class NowRow(NamedTuple):
    statement_timestamp: datetime


#: Start a schedule's row at its slot (a row back only to the transaction that created it).
SCHEDULE_CREATE: Final = Query(schedule_create, SlotParams, CreatedRow)
#: Move a schedule's row to its slot (a row back only to the transaction that won the slot).
SCHEDULE_ADVANCE: Final = Query(schedule_advance, ScheduleParams, AdvancedRow)
DATABASE_NOW: Final = Query(database_now, NoParams, NowRow)


def database_clock(executor: Executor) -> datetime:
    """The database's clock, ``statement_timestamp()`` (:data:`DATABASE_NOW`), in
    ``executor``'s transaction (the caller's)."""
    row = DATABASE_NOW.one(executor, None, {})
    assert row is not None  # a SELECT without FROM returns its one row
    return row.statement_timestamp
