"""The rows the query layer's statements return, one type per shape: each field is a column of
the statement's ``RETURNING`` (or select) list, in its order. Each statement's
:class:`~sqla_jobs._queries.run.Query` (and tests/test_query_rows.py) holds it to its row
type, so that reordering, adding or renaming a returned column fails there, not as a wrong
value read by position somewhere above. No builder module is imported here: they import
their rows from here.

The hot statements' rows stay the driver's plain tuples (a claim of a thousand jobs builds no
named tuple per row); the code above reads them by the positions named here
(:data:`CLAIM_ORDER`, :data:`COMPLETE_STATUS`, ...), derived from the fields, never written
as numbers. The statements that return one row per call (the keyed claim's two key
statements) are read as their named tuple (``LockKeysRow(*row)``).
"""

from __future__ import annotations

import operator
from datetime import datetime, timedelta
from typing import Any, Final, NamedTuple, TypeAlias

__all__ = [
    "CLAIM_ID",
    "CLAIM_JOB_FIELDS",
    "CLAIM_ORDER",
    "CLAIM_RUN_AT",
    "CLAIM_STATUS",
    "COMPLETE_STATUS",
    "FENCE",
    "ClaimRow",
    "CompleteRow",
    "DeleteRow",
    "FailRow",
    "FenceRow",
    "LockKeysRow",
    "LockRow",
    "RowType",
    "WalkKeysRow",
]


class ClaimRow(NamedTuple):
    """A job a claim started (or made dead or cancelled: see ``status``)."""

    id: int
    status: str
    queue: str
    task: str
    args: Any
    priority: int
    attempts: int
    max_attempts: int
    #: None where Python's datetime cannot hold it (``_sql._readable_time``).
    run_at: datetime | None
    lease_expires_at: datetime | None
    trace_context: Any
    time_limit: timedelta | None


class CompleteRow(NamedTuple):
    """An attempt :func:`~sqla_jobs._queries.outcomes.complete` matched: ``status`` is
    ``succeeded``, or ``cancelled`` when its cancel was requested."""

    id: int
    attempts: int
    task: str
    status: str


class DeleteRow(NamedTuple):
    """An attempt :func:`~sqla_jobs._queries.outcomes.complete_and_delete` deleted."""

    id: int
    attempts: int
    task: str


class FenceRow(NamedTuple):
    """An attempt a fenced statement matched (completed held, renewed, released, cancelled)."""

    id: int
    attempts: int


class FailRow(NamedTuple):
    """What :func:`~sqla_jobs._queries.outcomes.fail` made of an attempt."""

    id: int
    status: str
    #: None where Python's datetime cannot hold it (``_sql._readable_time``).
    run_at: datetime | None


class LockRow(NamedTuple):
    """An attempt :func:`~sqla_jobs._queries.outcomes.lock` locked, and the locking
    transaction's start (epoch seconds)."""

    id: int
    attempts: int
    xact_start: float


class LockKeysRow(NamedTuple):
    """The one row of :func:`~sqla_jobs._queries.keyed.lock_keys`. ``free``: a limited
    queue's free slots (its ``limited`` variant only)."""

    locked: int
    keys: str
    key_limits: str
    capacity: int
    full: bool
    free: int | None = None


class WalkKeysRow(NamedTuple):
    """The one row of :func:`~sqla_jobs._queries.keyed.walk_keys`."""

    locked: int
    keys: str
    key_limits: str
    reached: bool


#: Any of the row types above.
RowType: TypeAlias = (
    type[ClaimRow]
    | type[CompleteRow]
    | type[DeleteRow]
    | type[FenceRow]
    | type[FailRow]
    | type[LockRow]
    | type[LockKeysRow]
    | type[WalkKeysRow]
)

#: A fenced row's ``(id, attempts)``: the fence of the attempt it matched. Every fenced row
#: type starts with them (tests/test_query_rows.py holds each to it).
FENCE: Final = operator.itemgetter(*map(FenceRow._fields.index, ("id", "attempts")))

#: A claimed row's id, status, and its run_at (None where unreadable).
CLAIM_ID: Final = ClaimRow._fields.index("id")
CLAIM_STATUS: Final = ClaimRow._fields.index("status")
#: A claimed row's fields after its status: a ClaimedJob's after its model and id.
CLAIM_JOB_FIELDS: Final = slice(CLAIM_STATUS + 1, None)
CLAIM_RUN_AT: Final = ClaimRow._fields.index("run_at")
#: The order a claim hands its jobs out in: the claim statement's own ``(priority, run_at, id)``.
CLAIM_ORDER: Final = operator.itemgetter(*map(ClaimRow._fields.index, ("priority", "run_at", "id")))
#: A completed row's status.
COMPLETE_STATUS: Final = CompleteRow._fields.index("status")
