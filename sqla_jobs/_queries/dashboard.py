"""The dashboard's SQL: the job list, a job's record, its result, recent throughput, the
last hour by minute (the charts) and the failing jobs by task and error; for a model with
workflow steps, the recent workflows, a workflow's record and its steps as a graph, and the
workflow gauges the metrics export.

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

from collections.abc import Callable
from datetime import datetime
from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Integer,
    RowMapping,
    Select,
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
    union_all,
)
from sqlalchemy.dialects.postgresql import aggregate_order_by as _untyped_aggregate_order_by

from sqla_jobs._queries.run import NoParams, Query
from sqla_jobs._queries.workflows import STEP_STATE_COLUMNS, workflow_steps_of
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.schema import JobStatus
from sqla_jobs.schema.workflows import WorkflowStatus

# Untyped in SQLAlchemy 2.0.30, the lowest version we support: typed once, here.
aggregate_order_by: Callable[..., ColumnElement[Any]] = _untyped_aggregate_order_by

__all__ = [
    "FAILURES",
    "FAILURE_HOURS",
    "FINISHED_WORKFLOWS",
    "JOB",
    "JOB_PAGE",
    "LIST_COLUMNS",
    "MAX_ID",
    "MINUTES",
    "MINUTE_COUNTS",
    "RECENT_THROUGHPUT",
    "RESULT",
    "RUNNING",
    "RUNNING_WORKFLOWS",
    "WINDOW_FLOOR",
    "WORKFLOW",
    "WORKFLOW_GAUGES",
    "WORKFLOW_GRAPH",
    "WORKFLOW_GRAPH_COLUMNS",
    "BeforeParams",
    "FailureRow",
    "JobIdParams",
    "JobListRow",
    "JobPageParams",
    "MinuteRow",
    "NoParams",
    "ResultRow",
    "RunningParams",
    "RunningRow",
    "ThroughputRow",
    "WindowFloorRow",
    "WorkflowGaugeRow",
    "WorkflowIdParams",
    "WorkflowListRow",
    "WorkflowStepRow",
    "failures",
    "job",
    "job_page",
    "job_record",
    "minute_counts",
    "recent_throughput",
    "result",
    "running",
    "window_floor",
    "workflow",
    "workflow_gauges",
    "workflow_graph",
    "workflow_record",
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


def running(table: Table) -> Select[Any]:
    """The running jobs, longest running first, at most ``:limit``: each one's attempt, its
    worker, when the attempt started (``attempted_at``, set by its claim) and, by the
    database's clock, the seconds since (``elapsed``) and the seconds its lease has left
    (``lease_left``, negative once it ran out: its worker stopped or stalled), its own time
    limit in seconds (``time_limit``, NULL for its task's) and its latest ``progress``.

    Reads the running jobs only (``status = 'running'``, the running index's rows: the jobs
    in flight, bounded by the workers' slots, and the expired leases not yet taken over),
    never the backlog or the finished jobs. Parameter: ``:limit``.
    """
    clock = func.statement_timestamp()
    return (
        select(
            table.c.id,
            table.c.queue,
            table.c.task,
            table.c.attempts,
            table.c.max_attempts,
            table.c.leased_by,
            table.c.attempted_at,
            _epoch(clock - table.c.attempted_at).label("elapsed"),
            _epoch(table.c.lease_expires_at - clock).label("lease_left"),
            _epoch(table.c.time_limit).label("time_limit"),
            table.c.progress,
        )
        .where(table.c.status == literal_column(f"'{JobStatus.RUNNING.value}'"))
        .order_by(table.c.attempted_at.asc().nulls_first(), table.c.id)
        .limit(bindparam("limit", type_=Integer))
    )


class RunningParams(TypedDict):
    """How many running jobs to read."""

    limit: int


class RunningRow(NamedTuple):
    """A running job of :func:`running`; the seconds are the database's (NULL where the
    time they count from is: ``attempted_at`` of a job a version before it was claimed)."""

    id: int
    queue: str
    task: str
    attempts: int
    max_attempts: int
    leased_by: str | None
    attempted_at: datetime | str | None
    elapsed: float | None
    lease_left: float | None
    time_limit: float | None
    progress: Any


RUNNING: Final = Query(running, RunningParams, RunningRow)


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


#: The charts' span: this many minutes, the last one the current (partial) minute.
MINUTES: Final = 60


def _int(value: int) -> Any:
    # A constant rendered into the text (no bind parameter: the plan knows it).
    return literal_column(str(int(value)), Integer)


_MINUTE: Final = "'minute'"


def _since() -> Any:
    # The first minute of the charts, by the database's clock.
    return func.date_trunc(literal_column(_MINUTE), func.statement_timestamp()) - literal_column(
        f"interval '{MINUTES - 1} minutes'"
    )


def _epoch(value: Any) -> Any:
    # Seconds as float8 (date_part): cheaper per row than numeric (extract) and date_trunc.
    return func.date_part(literal_column("'epoch'"), value)


def minute_counts(table: Table, *, scan: int) -> Any:
    """By queue and minute of the last hour (:data:`MINUTES`, by the database's clock), among
    the newest ``scan`` jobs below ``:before``: how many jobs finished succeeded, dead, or at
    all (cancelled too), and how many were enqueued.

    ``queue, minute, succeeded, dead, finished, enqueued``; ``minute`` 0 is the first minute
    of the hour, ``MINUTES - 1`` the current one; minutes with nothing are left out. Bounded
    like the job list (one window of the primary key, read once): on a table busier than
    ``scan`` jobs an hour these are lower bounds, and the page says so.
    """
    window = (
        select(table.c.id, table.c.queue, table.c.status, table.c.created_at, table.c.finished_at)
        .where(table.c.id < bindparam("before", type_=BigInteger))
        .order_by(table.c.id.desc())
        .limit(literal_column(str(_count("scan", scan)), Integer))
        .cte("window")
    )
    # The clock, read once (not per row): the first minute, also in epoch seconds.
    since = _since()
    clock = select(since.label("since"), _epoch(since).label("since_epoch")).cte("clock")
    rows = window.join(clock, literal_column("true"))
    zero = literal_column("0", BigInteger)

    def status(value: JobStatus) -> Any:
        return window.c.status == literal_column(f"'{value.value}'")

    def minute(column: Any) -> Any:
        # 0 for the first minute of the charts, MINUTES - 1 for the current one.
        return cast(func.floor((_epoch(column) - clock.c.since_epoch) / _int(60)), Integer)

    ended = (
        select(
            window.c.queue,
            minute(window.c.finished_at).label("minute"),
            func.count().filter(status(JobStatus.SUCCEEDED)).label("succeeded"),
            func.count().filter(status(JobStatus.DEAD)).label("dead"),
            func.count().label("finished"),
            zero.label("enqueued"),
        )
        .select_from(rows)
        .where(window.c.finished_at >= clock.c.since)
        .group_by(window.c.queue, literal_column("2"))
    )
    enqueued = (
        select(
            window.c.queue,
            minute(window.c.created_at).label("minute"),
            zero.label("succeeded"),
            zero.label("dead"),
            zero.label("finished"),
            func.count().label("enqueued"),
        )
        .select_from(rows)
        .where(window.c.created_at >= clock.c.since)
        .group_by(window.c.queue, literal_column("2"))
    )
    both = ended.union_all(enqueued).subquery("counts")
    return (
        select(
            both.c.queue,
            both.c.minute,
            *(
                func.sum(both.c[name]).cast(BigInteger).label(name)
                for name in ("succeeded", "dead", "finished", "enqueued")
            ),
        )
        .where(both.c.minute < _int(MINUTES))  # a time ahead of the database's clock
        .group_by(both.c.queue, both.c.minute)
        .order_by(both.c.queue, both.c.minute)
    )


class MinuteRow(NamedTuple):
    """One queue and minute of :func:`minute_counts`."""

    queue: str
    minute: int
    succeeded: int
    dead: int
    finished: int
    enqueued: int


#: Option: ``scan``.
MINUTE_COUNTS: Final = Query(minute_counts, BeforeParams, MinuteRow)

#: How far back the failing jobs are read, and how long a message or error kind may be.
FAILURE_HOURS: Final = 24
_MESSAGE_LENGTH: Final = 300
_KIND_LENGTH: Final = 120


def failures(table: Table, *, scan: int) -> Any:
    """The dead jobs that finished in the last :data:`FAILURE_HOURS` hours (database time),
    grouped by task and error kind: ``task, error, jobs, latest, latest_id, message``.

    The error kind is the last line of the job's ``last_error`` (a traceback's last line is
    its exception), up to its first colon: ``ValueError`` for ``ValueError: card declined``;
    ``message`` is the newest job's last line, ``latest`` its finish time, ``latest_id`` its
    id. Reads the dead index (the job table's, or each history partition's of the last
    day) and the rows it points to, at most ``scan`` of them (then ``jobs`` are lower
    bounds), never the other jobs. Most jobs first.
    """
    dead: Any = literal_column(f"'{JobStatus.DEAD.value}'")
    empty: Any = literal_column("''")
    error = func.coalesce(table.c.last_error, empty)
    last_line = func.substring(
        func.rtrim(error, literal_column("E' \\t\\r\\n'")),
        literal_column("'[^\\n]*$'"),
    )
    read = (
        select(
            table.c.id,
            table.c.task,
            table.c.finished_at,
            func.left(last_line, _int(_MESSAGE_LENGTH)).label("message"),
        )
        .where(
            table.c.status == dead,
            table.c.finished_at
            >= func.statement_timestamp() - literal_column(f"interval '{FAILURE_HOURS} hours'"),
        )
        .limit(literal_column(str(_count("scan", scan)), Integer))
        .subquery("dead")
    )
    kind = func.left(
        case(
            (read.c.message == empty, literal_column("'(no error recorded)'")),
            else_=func.btrim(func.split_part(read.c.message, literal_column("':'"), _int(1))),
        ),
        _int(_KIND_LENGTH),
    ).label("error")
    newest = (read.c.finished_at.desc(), read.c.id.desc())
    return (
        select(
            read.c.task,
            kind,
            func.count().label("jobs"),
            func.max(read.c.finished_at).label("latest"),
            func.max(read.c.id).label("latest_id"),
            func.array_agg(aggregate_order_by(read.c.message, *newest))[_int(1)].label("message"),
        )
        .group_by(read.c.task, literal_column("2"))
        .order_by(literal_column("3").desc(), read.c.task, literal_column("2"))
    )


class FailureRow(NamedTuple):
    """One task and error kind of :func:`failures`."""

    task: str
    error: str
    jobs: int
    latest: datetime | None
    latest_id: int
    message: str


#: Option: ``scan``.
FAILURES: Final = Query(failures, NoParams, FailureRow)


# -- workflows (a model with steps: sqla_jobs.schema.workflows) --------------------------------

#: The columns the workflow list shows (a workflow's page reads every column).
WORKFLOW_COLUMNS: Final = (
    "id",
    "name",
    "status",
    "steps_total",
    "steps_left",
    "steps_failed",
    "created_at",
    "cancel_requested_at",
    "finished_at",
)


def _workflow_running() -> Any:
    return literal_column(f"'{WorkflowStatus.RUNNING.value}'")


def running_workflows(workflow: Table, *, scan: int, limit: int) -> Select[Any]:
    """The running workflows among the newest ``scan`` of the workflow table, newest first,
    at most ``limit``: the :data:`WORKFLOW_COLUMNS`.

    Bounded like the job list: the primary key read backwards, at most ``scan`` rows,
    whatever the table's size (the workflow table has no index on ``status``: a running
    workflow older than the window is not listed, and the page says so). No parameters.
    """
    window = (
        select(*(workflow.c[name] for name in WORKFLOW_COLUMNS))
        .order_by(workflow.c.id.desc())
        .limit(_int(_count("scan", scan)))
        .subquery("window")
    )
    return (
        select(*window.c)
        .where(window.c.status == _workflow_running())
        .order_by(window.c.id.desc())
        .limit(_int(_count("limit", limit)))
    )


def finished_workflows(workflow: Table, *, limit: int) -> Select[Any]:
    """The ``limit`` workflows that finished last, the last first: the
    :data:`WORKFLOW_COLUMNS`. Reads the workflow table's finished index
    (``finished_at, id WHERE finished_at IS NOT NULL``) backwards, ``limit`` entries and
    their rows. No parameters."""
    return (
        select(*(workflow.c[name] for name in WORKFLOW_COLUMNS))
        .where(workflow.c.finished_at.is_not(None))
        .order_by(workflow.c.finished_at.desc(), workflow.c.id.desc())
        .limit(_int(_count("limit", limit)))
    )


class WorkflowListRow(NamedTuple):
    """A workflow of the list: the :data:`WORKFLOW_COLUMNS`."""

    id: int
    name: str
    status: str
    steps_total: int
    steps_left: int
    steps_failed: int
    created_at: datetime | str | None
    cancel_requested_at: datetime | str | None
    finished_at: datetime | str | None


#: Options: ``scan``, ``limit``.
RUNNING_WORKFLOWS: Final = Query(running_workflows, NoParams, WorkflowListRow)
#: Option: ``limit``.
FINISHED_WORKFLOWS: Final = Query(finished_workflows, NoParams, WorkflowListRow)


class WorkflowIdParams(TypedDict):
    """One workflow, by its id."""

    flow_id: int


def workflow(workflow: Table) -> Select[Any]:
    """Every column of workflow ``:flow_id`` (no row when there is none). Uses the primary
    key."""
    return select(workflow).where(workflow.c.id == bindparam("flow_id", type_=BigInteger))


#: Every column of the workflow table (a model's own columns too: read by name,
#: :func:`workflow_record`).
WORKFLOW: Final[Query[WorkflowIdParams, tuple[Any, ...]]] = Query(workflow, WorkflowIdParams)


def workflow_record(
    connection: Connection, workflow_table: Table, flow_id: int
) -> RowMapping | None:
    """Every column of workflow ``flow_id`` by name (:data:`WORKFLOW`), in ``connection``'s
    transaction; None when there is none."""
    return WORKFLOW.result(connection, workflow_table, {"flow_id": flow_id}).mappings().first()


#: The columns of a workflow's steps that its page draws (:func:`workflow_graph`): a step's
#: state but its times of waiting and running and its error, which the job's page shows.
WORKFLOW_GRAPH_COLUMNS: Final = tuple(
    name
    for name in STEP_STATE_COLUMNS
    if name not in ("waiting_for", "run_at", "attempted_at", "last_error")
)


def workflow_graph(table: Table, *, limit: int, history: Table | None = None) -> Any:
    """The steps of workflow ``:flow_id``, the first ``limit`` in id order (the order they
    were added): the :data:`WORKFLOW_GRAPH_COLUMNS`, what the workflow's page draws; with
    ``history``, from the history too (an ended workflow's steps, once moved).

    Through the step index only (``workflow_id, step WHERE workflow_id IS NOT NULL``, and
    the history's workflow index): the workflow's steps are read into a materialized CTE,
    which the primary key cannot serve, so the plan never walks the job table in id order
    looking for them, whatever the statistics. Narrow columns (no arguments, no error): a
    workflow of many steps costs their index entries and rows, and sends at most ``limit``
    of them.
    """
    found = workflow_steps_of(table, WORKFLOW_GRAPH_COLUMNS, history=history)
    steps = select(*found.c).cte("steps").prefix_with("MATERIALIZED")
    return select(*steps.c).order_by(steps.c.id).limit(_int(_count("limit", limit)))


class WorkflowStepRow(NamedTuple):
    """A step of :func:`workflow_graph`."""

    id: int
    step: str | None
    task: str
    queue: str
    status: str
    attempts: int
    max_attempts: int
    depends_on: list[int] | None
    if_dependency_fails: str | None
    blocked_by: int | None
    finished_at: datetime | str | None


#: Options: ``limit``, ``history``.
WORKFLOW_GRAPH: Final = Query(workflow_graph, WorkflowIdParams, WorkflowStepRow)


def workflow_gauges(table: Table, *, workflow: Table) -> Any:
    """The workflows by status, and the waiting steps of the job table by queue:
    ``status, queue, total``; ``queue`` is NULL in a row of workflows (``status``, a
    workflow's), and a queue in a row of waiting steps (``status`` ``'waiting'``).

    One sequential scan of the workflow table (it has no index on ``status``, nor on the
    running workflows: one narrow row per workflow, kept until ``sqla_jobs.prune`` deletes
    the finished ones), materialized once; then, for each running workflow, its steps
    through the step index (a waiting step is a step of a running workflow: a workflow
    ends with its last step). So the cost grows with the workflows kept and the steps of
    the running ones, never with the job table's other rows. Takes no lock.
    """
    running = _workflow_running()
    # One pass over the workflow table: the count of each status, and the running ones' ids.
    flows = (
        select(
            workflow.c.status,
            func.count().label("total"),
            func.array_agg(workflow.c.id).filter(workflow.c.status == running).label("running"),
        )
        .group_by(workflow.c.status)
        .cte("flows")
    )
    by_status = select(flows.c.status, cast(null(), Text).label("queue"), flows.c.total)
    flow_id = func.unnest(flows.c.running).table_valued("id").render_derived("flow")
    waiting: Any = literal_column(f"'{JobStatus.WAITING.value}'")
    # LATERAL with an aggregate inside: never pulled up into a join the planner may turn
    # into a scan of the job table; always the step index, once per running workflow.
    steps = (
        select(table.c.queue, func.count().label("waiting"))
        .where(
            table.c.workflow_id.is_not(None),
            table.c.workflow_id == flow_id.c.id,
            table.c.status == waiting,
        )
        .group_by(table.c.queue)
        .lateral("steps")
    )
    by_queue = (
        select(
            waiting.label("status"),
            steps.c.queue,
            func.sum(steps.c.waiting).cast(BigInteger).label("total"),
        )
        .select_from(
            flows.join(flow_id, literal_column("true")).join(steps, literal_column("true"))
        )
        .where(flows.c.status == running)
        .group_by(steps.c.queue)
    )
    return union_all(by_status, by_queue)


class WorkflowGaugeRow(NamedTuple):
    """A row of :func:`workflow_gauges`: workflows of a status (``queue`` None), or the
    waiting steps of a queue."""

    status: str
    queue: str | None
    total: int


#: Option: ``workflow`` (the workflow table of the job table's model).
WORKFLOW_GAUGES: Final = Query(workflow_gauges, NoParams, WorkflowGaugeRow)
