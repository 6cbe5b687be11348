"""What every statement module shares: status literals, the database's clock,
parameters split from text, and the fence of an attempt (see :mod:`sqla_jobs._queries`)."""

from __future__ import annotations

from typing import Any, Final, TypedDict

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Integer,
    Table,
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    null,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY

from sqla_jobs.schema import JobStatus


def _lit(status: JobStatus) -> ColumnElement[str]:
    # Statuses are rendered as literals, not bind parameters: the partial index predicate
    # can then be proven to hold even for a generic (prepared) plan.
    return literal_column(f"'{status.value}'")


def _now() -> ColumnElement[Any]:
    return func.statement_timestamp()


_ONE: Final[ColumnElement[int]] = literal_column("1", Integer)
_SECOND: Final[ColumnElement[Any]] = literal_column("interval '1 second'")


#: The times a claim or an outcome hands back to Python, as ``run_at``: those between these
#: bounds, which every datetime of Python's range (years 1 to 9999) holds in any session time
#: zone (a day's margin on each side). PostgreSQL's timestamptz goes further (``'-infinity'``,
#: ``'infinity'``, 4713 BC to 294276 AD), and a row another program wrote may hold such a time.
READABLE_TIMES: Final = ("0001-01-02 00:00:00+00", "9999-12-30 00:00:00+00")


def _readable_time(column: ColumnElement[Any]) -> ColumnElement[Any]:
    """``column`` as a statement hands it back to Python: itself, or NULL where it lies outside
    :data:`READABLE_TIMES`. The rule it carries: **no row's time fails a statement that reads
    it back**. psycopg (and asyncpg) cannot load such a value into a ``datetime``; raising at
    fetch would fail the whole claim, every time, and stop the queue. A claimed job with
    ``run_at`` None ends alone, dead with the reason (:meth:`sqla_jobs.worker.runner.Runner.admit`).
    """
    low: ColumnElement[Any] = literal_column(f"timestamptz '{READABLE_TIMES[0]}'")
    high: ColumnElement[Any] = literal_column(f"timestamptz '{READABLE_TIMES[1]}'")
    return case((column.between(low, high), column), else_=null()).label(column.key)


def _seconds(param: str) -> ColumnElement[Any]:
    return bindparam(param, type_=Float) * _SECOND


def _split(param: str, element: Any) -> ColumnElement[Any]:
    # The arrays arrive as comma-separated text ('1,2,3') and are split and cast here:
    # cheaper on the client than having the driver inspect and dump a list per parameter.
    text = func.string_to_array(bindparam(param, type_=Text), literal_column("','"))
    return cast(text, ARRAY(element))


def _cancel_requested(table: Table) -> ColumnElement[bool]:
    """Whether :func:`sqla_jobs.cancel` asked the job's running attempt to stop.

    The rule it carries, in every statement that ends or gives back an attempt (complete,
    fail, release, the claim's takeover of an expired lease): a job whose cancel was
    requested ends ``cancelled``; it is never made pending, running or succeeded again
    (until :func:`retry` clears the request).
    """
    return table.c.cancel_requested_at.is_not(null())


class FenceParams(TypedDict):
    """A batch of attempts by their fences (:func:`_fences`): ids and attempts, each as
    comma-separated text (``"12,13"``, ``"1,2"``) that the statement splits and casts, so
    that its text is the same for every batch size."""

    fence_ids: str
    fence_attempts: str


class LeaseFenceParams(FenceParams):
    """:class:`FenceParams` with a lease in seconds for each attempt, comma-separated."""

    fence_leases: str


def _fences(table: Table, *, leases: bool = False) -> tuple[Any, ColumnElement[bool]]:
    """The ``(id, attempt)`` pairs of a batch (with a lease in seconds each, if ``leases``),
    and the fenced match against the table: a join of the pairs with the running rows,
    which the outcome writer's batches plan as one hash join with the running index
    (measured at 500 jobs and 3,000 running; a plan test holds it, custom and generic)."""
    arrays = [_split("fence_ids", BigInteger), _split("fence_attempts", Integer)]
    names_ = ["id", "attempt"]
    if leases:
        arrays.append(_split("fence_leases", Float))
        names_.append("lease")
    pairs = func.unnest(*arrays).table_valued(*names_).render_derived(name="fence")
    match = and_(
        table.c.id == pairs.c.id,
        table.c.attempts == pairs.c.attempt,
        table.c.status == _lit(JobStatus.RUNNING),
    )
    return pairs, match


def _fenced_by_key(table: Table) -> ColumnElement[bool]:
    """The fenced match of :func:`_fences` for the statements a lock-held group runs once
    per chunk (:func:`lock`, :func:`complete_held`, and the history's held completion):
    the rows found through the primary key, no pair joined.

    The ids are matched as ``id = ANY(...)``, an index condition on the primary key, and
    each row's attempt as the one at its id's place in the attempts (``array_position``;
    both arrays split once per statement, in scalar subqueries). A join with the pairs was
    planned, under statistics taken before any job ran (they call the running rows one), as
    a nested loop that unnested both arrays again for each row: 15,750 pairs compared for a
    group of 126, 1.9 ms to lock it and 2.1 ms to complete it (0.29 and 0.66 ms now);
    without the ``id = ANY(...)`` index condition, the same statistics made the planner
    scan the whole table once per pair (100 ms for a chunk of 300 jobs in a table of
    40,000). The status test is written ``IS NOT DISTINCT FROM 'running'`` (the same test:
    the column is never null), which the planner cannot match to the running index's
    predicate: given ``= 'running'``, it may read that whole index instead, for each
    statement. (``array_position`` makes the match quadratic in the chunk, fine at a
    group's ``CAP`` of 200.) Parameters: ``:fence_ids``, ``:fence_attempts``."""
    ids = select(_split("fence_ids", BigInteger)).scalar_subquery()
    attempts = select(_split("fence_attempts", Integer)).scalar_subquery()
    at = func.array_position(ids, table.c.id, type_=Integer)
    return and_(
        table.c.id == func.any(_split("fence_ids", BigInteger)),
        table.c.attempts == attempts[at],
        table.c.status.is_not_distinct_from(_lit(JobStatus.RUNNING)),
    )
