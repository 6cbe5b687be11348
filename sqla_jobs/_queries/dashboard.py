"""The dashboard's SQL: the job list, a job's record, its result, recent throughput.

Pure builders over the user's tables, like :mod:`sqla_jobs._queries`. None of them takes
a lock.

Every list read is bounded: it reads at most ``scan`` entries of the primary key, newest
first, below the keyset cursor ``:before``, whatever the filters and however large the table
(a *window*). No index beyond the primary key is needed, so the dashboard adds no cost to
the claim, the enqueue or the outcomes (docs/operations/dashboard.md has the measurement on 10M
rows). The price: a filter that matches few jobs fills a page over several windows, and
the page says so.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import (
    BigInteger,
    Connection,
    Integer,
    RowMapping,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    func,
    literal_column,
    select,
)

from sqla_jobs._queries.run import Query
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.schema import JobStatus

__all__ = [
    "JOB",
    "JOB_PAGE",
    "LIST_COLUMNS",
    "MAX_ID",
    "RECENT_THROUGHPUT",
    "RESULT",
    "WINDOW_FLOOR",
    "BeforeParams",
    "JobIdParams",
    "JobListRow",
    "JobPageParams",
    "ResultRow",
    "ThroughputRow",
    "WindowFloorRow",
    "job",
    "job_page",
    "job_record",
    "recent_throughput",
    "result",
    "window_floor",
]

#: The cursor of the first page: every id is below it.
MAX_ID: Final = 2**63 - 1

#: The columns the job list shows (the detail page reads every column).
LIST_COLUMNS: Final = (
    "id",
    "queue",
    "task",
    "status",
    "priority",
    "attempts",
    "max_attempts",
    "run_at",
    "created_at",
    "finished_at",
)


def _count(name: str, value: object) -> int:
    # Rendered into the SQL text: only ever a positive int.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer, not {value!r}")
    return value


def _window(table: Table, columns: tuple[str, ...], scan: int) -> Any:
    # The newest `scan` jobs below :before, by the primary key, read backwards. LIMIT keeps
    # PostgreSQL from flattening the subquery, so the filters of the outer query apply to
    # this window and never make the scan walk further. The limits are literals, not
    # parameters: a generic (prepared) plan then still knows how few rows it reads, and
    # keeps to the backward index scan.
    return (
        select(*(table.c[name] for name in columns))
        .where(table.c.id < bindparam("before", type_=BigInteger))
        .order_by(table.c.id.desc())
        .limit(literal_column(str(_count("scan", scan)), Integer))
        .subquery("window")
    )


def job_page(
    table: Table, *, status: JobStatus | None, queue: bool, task: bool, scan: int, limit: int
) -> Select[Any]:
    """One page of the job list, newest first: the jobs of the window of ``scan`` jobs
    below ``:before`` (see the module docstring) that match the filters, at most ``limit``.

    ``status`` is rendered as a literal (one statement per status); ``queue`` and ``task``
    say whether ``:queue`` and ``:task`` filter. Parameters: ``:before``, and
    ``:queue``/``:task`` when used. Reads the primary key backwards and at most ``scan``
    heap rows.
    """
    window = _window(table, LIST_COLUMNS, scan)
    conditions = []
    if status is not None:
        conditions.append(window.c.status == literal_column(f"'{JobStatus(status).value}'"))
    if queue:
        conditions.append(window.c.queue == bindparam("queue", type_=Text))
    if task:
        conditions.append(window.c.task == bindparam("task", type_=Text))
    statement = select(*window.c).order_by(window.c.id.desc())
    if conditions:
        statement = statement.where(and_(*conditions))
    return statement.limit(literal_column(str(_count("limit", limit)), Integer))


class BeforeParams(TypedDict):
    """The keyset cursor: ids below ``before`` (:data:`MAX_ID` for the first page)."""

    before: int


class JobPageParams(BeforeParams, total=False):
    """:class:`BeforeParams`, and the queue and task filters of a :func:`job_page` built with
    ``queue=True`` or ``task=True``."""

    queue: str
    task: str


class JobListRow(NamedTuple):
    """A job of the list: the :data:`LIST_COLUMNS`. A time Python cannot hold is its text
    (read under :func:`~sqla_jobs._queries.run.readable_values`)."""

    id: int
    queue: str
    task: str
    status: str
    priority: int
    attempts: int
    max_attempts: int
    run_at: datetime | str | None
    created_at: datetime | str | None
    finished_at: datetime | str | None


#: Options: ``status``, ``queue``, ``task``, ``scan``, ``limit`` (see :func:`job_page`).
JOB_PAGE: Final = Query(job_page, JobPageParams, JobListRow)


def window_floor(table: Table, *, scan: int) -> Select[Any]:
    """The lowest id of the window below ``:before`` (the ``scan``-th id down), or no row
    when fewer jobs than that are left: the cursor of the next window. Reads only the
    primary key (an index-only scan once the table is vacuumed)."""
    return (
        select(table.c.id)
        .where(table.c.id < bindparam("before", type_=BigInteger))
        .order_by(table.c.id.desc())
        .offset(literal_column(str(_count("scan", scan) - 1), Integer))
        .limit(literal_column("1", Integer))
    )


class WindowFloorRow(NamedTuple):
    id: int


#: Option: ``scan``.
WINDOW_FLOOR: Final = Query(window_floor, BeforeParams, WindowFloorRow)


def job(table: Table) -> Select[Any]:
    """Every column of job ``:job_id`` (no row when there is none). Uses the primary key."""
    return select(table).where(table.c.id == bindparam("job_id", type_=BigInteger))


class JobIdParams(TypedDict):
    """One job, by its id."""

    job_id: int


#: Every column of the table (their names differ by model: read by name, :func:`job_record`).
JOB: Final[Query[JobIdParams, tuple[Any, ...]]] = Query(job, JobIdParams)


def job_record(connection: Connection, table: Table, job_id: int) -> RowMapping | None:
    """Every column of job ``job_id`` in ``table`` by name (:data:`JOB`), in ``connection``'s
    transaction; None when there is none."""
    return JOB.result(connection, table, {"job_id": job_id}).mappings().first()


def result(result_table: Table) -> Select[Any]:
    """``value, finished_at`` of the stored result of job ``:job_id``. Uses the primary key."""
    return select(result_table.c.value, result_table.c.finished_at).where(
        result_table.c.job_id == bindparam("job_id", type_=BigInteger)
    )


class ResultRow(NamedTuple):
    """A stored result: its value and when it was stored."""

    value: Any
    finished_at: datetime | str | None


RESULT: Final = Query(result, JobIdParams, ResultRow)


def recent_throughput(table: Table, *, scan: int) -> Select[Any]:
    """By queue, among the newest ``scan`` jobs below ``:before``: how many succeeded and
    died in the last five minutes and in the last hour, by the database's clock.

    ``queue, succeeded_5m, succeeded_1h, dead_1h, scanned``. Bounded like the job list (a
    job enqueued long before it finished can fall outside the window, so these are lower
    bounds on a busy table; ``scanned`` says how many jobs were read).
    """
    window = _window(table, ("id", "queue", "status", "finished_at"), scan)
    now = func.statement_timestamp()

    def finished(status: JobStatus, since: str) -> Any:
        return func.count().filter(
            window.c.status == literal_column(f"'{status.value}'"),
            window.c.finished_at > now - literal_column(f"interval '{since}'"),
        )

    return (
        select(
            window.c.queue,
            finished(JobStatus.SUCCEEDED, "5 minutes").label("succeeded_5m"),
            finished(JobStatus.SUCCEEDED, "1 hour").label("succeeded_1h"),
            finished(JobStatus.DEAD, "1 hour").label("dead_1h"),
            func.count().label("scanned"),
        )
        .group_by(window.c.queue)
        .order_by(window.c.queue)
    )


class ThroughputRow(NamedTuple):
    """One queue of :func:`recent_throughput`."""

    queue: str
    succeeded_5m: int
    succeeded_1h: int
    dead_1h: int
    scanned: int


#: Option: ``scan``.
RECENT_THROUGHPUT: Final = Query(recent_throughput, BeforeParams, ThroughputRow)
