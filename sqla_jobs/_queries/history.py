"""Every SQL statement of the partitioned history, as builders over the job table.

Pure functions, like :mod:`sqla_jobs._queries` (whose fence they share): they take the
job table (and the result table, where one is involved) and return a statement. The moves
are single statements, ``WITH moved AS (DELETE ... RETURNING ...) INSERT INTO history
SELECT ... FROM moved``: the row leaves the job table and enters the history in one
statement of one transaction, so a job is in one of the two tables, never both or neither,
whatever crashes when.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, datetime
from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    DateTime,
    Insert,
    Integer,
    Select,
    Table,
    Text,
    TextClause,
    and_,
    bindparam,
    case,
    cast,
    delete,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    text,
    union_all,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.dml import ReturningDelete

from sqla_jobs._queries._sql import FenceParams, _fenced_by_key, _fences, _lit, _now
from sqla_jobs._queries.outcomes import JobIdParams
from sqla_jobs._queries.rows import CompleteRow
from sqla_jobs._queries.run import Executor, NoParams, Query
from sqla_jobs.ddl import executable, qualified_name
from sqla_jobs.schema import FINISHED_STATUSES, JobStatus
from sqla_jobs.schema.history import (
    PARTITION_KEY,
    RESULT_COLUMN,
    attach_partition,
    create_detached_partition,
    create_partition,
    day_bounds,
    drop_partition,
    history_names,
    history_table,
    hold_inserts,
)
from sqla_jobs.schema.workflows import WorkflowStatus

__all__ = [
    "BRING_BACK",
    "COMPLETE",
    "DATABASE_NOW",
    "DEFAULT_ROWS_BETWEEN",
    "DELETE_DEFAULT_BEFORE",
    "LOCK_WORKFLOW",
    "MOVE_FINISHED",
    "MOVE_OUT_OF_DEFAULT",
    "PARTITIONS",
    "PRUNE_ENDED_WORKFLOWS",
    "RECORD",
    "RETRY",
    "SET_LOCK_TIMEOUT",
    "STATUS_OF",
    "STEP_WORKFLOW",
    "SWEEP",
    "SWEEP_WINDOW",
    "TRY_LOCK",
    "UTC",
    "BoundsParams",
    "CompleteParams",
    "CutoffParams",
    "ExistsRow",
    "FoundRecord",
    "IdRow",
    "LockKeyParams",
    "NowRow",
    "PartitionRow",
    "PartitionsParams",
    "SetConfigRow",
    "StatusRow",
    "SweepParams",
    "SweepWindowParams",
    "SweepWindowRow",
    "TryLockRow",
    "ValueParams",
    "WorkflowIdParams",
    "WorkflowIdRow",
    "bring_back",
    "complete",
    "database_now",
    "default_rows_between",
    "delete_default_before",
    "drop_day_partition",
    "found_record",
    "hold_maintenance_lock",
    "lock_workflow",
    "make_day_partition",
    "move_finished",
    "move_out_of_default",
    "partition_rows",
    "partitions",
    "prune_ended_workflows",
    "record",
    "retry",
    "set_lock_timeout",
    "statement_time",
    "status_of",
    "step_workflow",
    "sweep",
    "sweep_window",
    "try_lock",
    "utc",
]

_FINISHED: Final = [_lit(s) for s in FINISHED_STATUSES]
_RETRYABLE: Final = [_lit(JobStatus.DEAD), _lit(JobStatus.CANCELLED)]


def _into_history(
    table: Table,
    moved: Any,
    *,
    overrides: dict[str, ColumnElement[Any]],
    result: ColumnElement[Any],
    joined: Any = None,
) -> Insert:
    """``INSERT INTO history (...) SELECT ... FROM moved`` (the ``WITH`` at the top)."""
    history = history_table(table)
    names = [c.name for c in table.columns]
    values = [overrides.get(name, moved.c[name]) for name in names]
    source = moved if joined is None else joined
    return (
        insert(history)
        .from_select([*names, RESULT_COLUMN], select(*values, result).select_from(source))
        .add_cte(moved)
        .returning(history.c.id, history.c.attempts, history.c.task, history.c.status)
    )


def _out_of_history(
    table: Table,
    match: ColumnElement[bool],
    *,
    overrides: Callable[[Any], dict[str, ColumnElement[Any]]] | None = None,
) -> tuple[Insert, Any]:
    """``WITH back AS (DELETE FROM history WHERE match RETURNING ...) INSERT INTO jobs SELECT
    ... FROM back RETURNING id``: the history's rows that ``match`` back into the job table,
    each column as it was but those ``overrides(back)`` gives. Also returns the ``back`` CTE
    (every job column, then ``result``), for a statement that takes more from it."""
    history = history_table(table)
    back = (
        delete(history)
        .where(match)
        .returning(*(history.c[c.name] for c in table.columns), history.c[RESULT_COLUMN])
        .cte("back")
    )
    changed = {} if overrides is None else overrides(back)
    names = [c.name for c in table.columns]
    values = [changed.get(name, back.c[name]) for name in names]
    stmt = (
        insert(table)
        .from_select(names, select(*values).select_from(back))
        .add_cte(back)
        .returning(table.c.id)
    )
    return stmt, back


def complete(table: Table, *, held: bool = False) -> Insert:
    """Complete the given attempts by moving their jobs into the history, succeeded. Fenced.

    ``WITH moved AS (DELETE FROM jobs USING fence WHERE (id, attempts) match AND status =
    'running' RETURNING *) INSERT INTO history SELECT ... FROM moved``: a stale attempt
    matches no row and moves nothing. ``:results`` is a JSON object (as text) whose keys
    are ``"<id>:<attempt>"`` and values the results (``'{}'`` for none): the result is
    stored in the history row, with the job. Locks the matched job rows (a ``DELETE``);
    inserts into the history partition of today. Returns ``id, attempts, task`` of each
    completed job. Parameters: ``:fence_ids``, ``:fence_attempts``, ``:results``.

    ``held``: the rows are locked by the caller's transaction (a lock-held group, see
    :func:`sqla_jobs._queries.complete_held`): found through the primary key, and a job
    whose cancel was requested is left where it is, for the worker to cancel later.
    """
    match = _fenced_by_key(table) if held else _fences(table)[1]
    if held:
        match = and_(match, table.c.cancel_requested_at.is_(null()))
    moved = delete(table).where(match).returning(*table.columns).cte("moved")
    key = func.concat(moved.c.id, literal_column("':'"), moved.c.attempts)
    results = cast(bindparam("results", type_=Text), JSONB)
    # A job whose cancel was requested ends cancelled, its result not stored (the rule of
    # sqla_jobs._queries._sql._cancel_requested, here for the move).
    requested = moved.c.cancel_requested_at.is_not(null())
    return _into_history(
        table,
        moved,
        result=case((requested, null()), else_=results.op("->")(key)),
        overrides={
            "status": case((requested, _lit(JobStatus.CANCELLED)), else_=_lit(JobStatus.SUCCEEDED)),
            PARTITION_KEY: _now(),
            "lease_expires_at": null(),
        },
    )


def move_finished(table: Table) -> Insert:
    """Move job ``:job_id`` into the history if it is finished (dead or cancelled by the
    statement before this one, in the same transaction). Returns its ``id, attempts,
    task``, or no row when it is not finished. Locks its job row."""
    moved = (
        delete(table)
        .where(table.c.id == bindparam("job_id", type_=BigInteger), table.c.status.in_(_FINISHED))
        .returning(*table.columns)
        .cte("moved")
    )
    return _into_history(
        table,
        moved,
        overrides={PARTITION_KEY: func.coalesce(moved.c[PARTITION_KEY], _now())},
        result=null(),
    )


def sweep_window(table: Table) -> Select[Any]:
    """The highest id among the ``:scan`` ids after ``:after`` (null past the end): the
    next window of :func:`sweep`. Reads the primary key only."""
    window = (
        select(table.c.id)
        .where(table.c.id > bindparam("after", type_=BigInteger))
        .order_by(table.c.id)
        .limit(bindparam("scan", type_=Integer))
        .subquery("window")
    )
    return select(func.max(window.c.id))


def sweep(
    table: Table, result_table: Table | None = None, *, workflow: Table | None = None
) -> Insert:
    """Move the finished jobs with ids in ``(:after, :upto]`` into the history, with their
    rows of ``result_table`` (which are deleted), in one statement.

    For the jobs that finished without a move: dead by a claim (a lost lease on the last
    attempt), every finished job of a table from before it had a history, and every
    finished job of a model with workflow steps (``workflow``: its workflow table), whose
    jobs finish in place. There a step moves only once its workflow ended, under a share
    lock of the workflow's row (taken with ``SKIP LOCKED``): a retry, which locks that row
    first (:func:`step_workflow`), never finds half its workflow gone mid-way, and a
    workflow's steps move in the sweeps that cover their ids, none while it runs. Rows
    locked by someone else are skipped (``FOR UPDATE SKIP LOCKED``), left for a later
    sweep. Returns ``id, attempts, task`` of each moved job.
    """
    upto = and_(
        table.c.id > bindparam("after", type_=BigInteger),
        table.c.id <= bindparam("upto", type_=BigInteger),
    )
    finished = and_(upto, table.c.status.in_(_FINISHED))
    movable: ColumnElement[bool] = finished
    if workflow is not None:
        ended = (
            select(workflow.c.id)
            .where(
                workflow.c.id.in_(
                    select(table.c.workflow_id).where(finished, table.c.workflow_id.is_not(None))
                ),
                workflow.c.status != literal_column(f"'{WorkflowStatus.RUNNING.value}'"),
            )
            .with_for_update(read=True, skip_locked=True)
            .cte("ended_workflows")
        )
        movable = and_(
            finished,
            or_(table.c.workflow_id.is_(None), table.c.workflow_id.in_(select(ended.c.id))),
        )
    doomed = select(table.c.id).where(movable).with_for_update(skip_locked=True).cte("doomed")
    moved = delete(table).where(table.c.id == doomed.c.id).returning(*table.columns).cte("moved")
    result: ColumnElement[Any] = null()
    joined = None
    if result_table is not None:
        gone = (
            delete(result_table)
            .where(result_table.c.job_id == moved.c.id)
            .returning(result_table.c.job_id, result_table.c.value)
            .cte("gone")
        )
        joined = moved.outerjoin(gone, gone.c.job_id == moved.c.id)
        result = gone.c.value
    stmt = _into_history(
        table,
        moved,
        overrides={PARTITION_KEY: func.coalesce(moved.c[PARTITION_KEY], _now())},
        result=result,
        joined=joined,
    )
    if result_table is not None:
        stmt = stmt.add_cte(gone)
    return stmt.add_cte(doomed)


def step_workflow(table: Table) -> Select[Any]:
    """The workflow of job ``:job_id``, wherever the job is (its table, else its history):
    ``workflow_id``, null for a job that is no step; no row when there is no such job.
    Reads the primary keys; takes no lock (the caller locks the workflow next:
    :func:`lock_workflow`)."""
    history = history_table(table)
    job_id = bindparam("job_id", type_=BigInteger)
    hot = select(table.c.workflow_id, literal_column("0").label("place")).where(
        table.c.id == job_id
    )
    old = select(history.c.workflow_id, literal_column("1").label("place")).where(
        history.c.id == job_id
    )
    found = union_all(hot, old).subquery("found")
    return select(found.c.workflow_id).order_by(found.c.place).limit(1)


def lock_workflow(workflow: Table) -> Select[Any]:
    """Lock workflow ``:workflow_id``'s row (``FOR UPDATE``) until the transaction ends,
    before its steps change: the sweep skips a workflow locked so (:func:`sweep`), and
    waits for nothing. Returns its ``id``, no row when it is gone."""
    return (
        select(workflow.c.id)
        .where(workflow.c.id == bindparam("workflow_id", type_=BigInteger))
        .with_for_update()
    )


def bring_back(table: Table, result_table: Table | None = None) -> Insert:
    """Move every step of workflow ``:workflow_id`` that sits in the history back into the
    job table as it was (status, attempts, finish time kept), with its result into
    ``result_table`` (when given), in one statement: the first half of the retry of a
    step of an ended workflow, whose graph the workflow trigger then reads whole. Inserts
    fire no workflow trigger. Returns the ids. Reads the history's workflow index."""
    history = history_table(table)
    stmt, back = _out_of_history(
        table, history.c.workflow_id == bindparam("workflow_id", type_=BigInteger)
    )
    if result_table is None:
        return stmt
    results = (
        insert(result_table)
        .from_select(
            ["job_id", "task", "value", "finished_at"],
            select(
                back.c.id,
                back.c.task,
                back.c[RESULT_COLUMN],
                func.coalesce(back.c[PARTITION_KEY], _now()),
            ).where(back.c[RESULT_COLUMN].is_not(null())),
        )
        .cte("results")
    )
    return stmt.add_cte(results)


def prune_ended_workflows(table: Table, *, workflow: Table) -> ReturningDelete[Any]:
    """Retention of a model with steps and a history: delete up to ``:limit`` workflows
    that finished before ``:cutoff`` and have no step left in the job table (theirs are in
    the history, or gone with its partitions), oldest first; one locked by a retry is
    skipped. Returns their ``id``."""
    steps = select(table.c.id).where(table.c.workflow_id == workflow.c.id)
    doomed = (
        select(workflow.c.id)
        .where(
            workflow.c.finished_at < bindparam("cutoff", type_=DateTime(timezone=True)),
            ~steps.exists(),
        )
        .order_by(workflow.c.finished_at)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True)
    )
    return (
        delete(workflow).where(workflow.c.id.in_(doomed.scalar_subquery())).returning(workflow.c.id)
    )


def retry(table: Table) -> Insert:
    """Move dead or cancelled job ``:job_id`` back from the history into the job table,
    pending and runnable now, with at least one more attempt (``attempts`` kept: the fence
    stays sound). Its result, if any, stays behind with the history row it came from, which
    is deleted. Returns the id, or no row when the history has no such dead or cancelled
    job. The insert wakes listeners like an enqueue (the NOTIFY trigger)."""
    history = history_table(table)
    one = literal_column("1", Integer)

    def pending(back: Any) -> dict[str, ColumnElement[Any]]:
        return {
            "status": _lit(JobStatus.PENDING),
            "run_at": _now(),
            "max_attempts": func.greatest(back.c.max_attempts, back.c.attempts + one),
            PARTITION_KEY: null(),
            "lease_expires_at": null(),
            "leased_by": null(),
        }

    match = and_(
        history.c.id == bindparam("job_id", type_=BigInteger),
        history.c.status.in_(_RETRYABLE),
    )
    return _out_of_history(table, match, overrides=pending)[0]


def status_of(table: Table) -> Select[Any]:
    """The status of job ``:job_id`` in the history (no row when it is not there)."""
    history = history_table(table)
    return select(history.c.status).where(history.c.id == bindparam("job_id", type_=BigInteger))


def record(table: Table) -> Select[Any]:
    """Job ``:job_id``'s full row wherever it is: every job column, then ``result`` (null
    in the job table) and ``in_history``. At most one row (a job is in one table). Reads
    the job table's primary key and each history partition's."""
    history = history_table(table)
    job_id = bindparam("job_id", type_=BigInteger)
    hot = select(
        *table.columns,
        cast(null(), JSONB).label(RESULT_COLUMN),
        literal_column("false").label("in_history"),
    ).where(table.c.id == job_id)
    old = select(
        *(history.c[c.name] for c in table.columns),
        history.c[RESULT_COLUMN],
        literal_column("true").label("in_history"),
    ).where(history.c.id == job_id)
    return select(union_all(hot, old).subquery("found"))


# -- maintenance ---------------------------------------------------------------------------


def try_lock() -> Select[Any]:
    """``pg_try_advisory_xact_lock`` on ``:lock_key`` (hashed): true when this transaction
    now holds the maintenance lock of one history, false when another run holds it. Held
    until the transaction ends; never waits."""
    key = func.hashtextextended(bindparam("lock_key", type_=Text), literal_column("0"))
    return select(func.pg_try_advisory_xact_lock(key))


def set_lock_timeout() -> Select[Any]:
    """``set_config('lock_timeout', :value, true)``: for the rest of the transaction."""
    return select(
        func.set_config(
            literal_column("'lock_timeout'"), bindparam("value", type_=Text), literal_column("true")
        )
    )


def database_now() -> Select[Any]:
    """``statement_timestamp()``: the database's clock."""
    return select(_now())


def utc() -> Select[Any]:
    """``set_config('TimeZone', 'UTC', true)``: partition bounds print in UTC for the rest
    of the transaction."""
    return select(
        func.set_config(
            literal_column("'TimeZone'"), literal_column("'UTC'"), literal_column("true")
        )
    )


def partitions() -> TextClause:
    """The partitions of history table ``:history`` (a qualified name): ``name`` and
    ``bound`` (``pg_get_expr`` of the bound: ``FOR VALUES FROM (...) TO (...)`` or
    ``DEFAULT``). Reads the catalog; takes no lock."""
    return text(
        "SELECT c.relname AS name, pg_get_expr(c.relpartbound, c.oid) AS bound "
        "FROM pg_catalog.pg_inherits AS i JOIN pg_catalog.pg_class AS c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = to_regclass(:history) ORDER BY c.relname"
    )


def default_rows_between(table: Table) -> TextClause:
    """Whether the history's ``DEFAULT`` partition holds a row finished in ``[:start,
    :end)``: then the day partition cannot be created (PostgreSQL refuses a partition whose
    rows sit in the default one)."""
    n = history_names(table.name, table.schema)
    return text(
        f"SELECT EXISTS (SELECT 1 FROM {qualified_name(n.default_partition, table.schema)} "
        f"WHERE {PARTITION_KEY} >= :start AND {PARTITION_KEY} < :end)"
    )


def move_out_of_default(table: Table, day_partition: str) -> TextClause:
    """Move the ``DEFAULT`` partition's rows finished in ``[:start, :end)`` into the table
    ``day_partition`` (a detached partition-to-be, same columns in the same order), in one
    statement. Returns their ids."""
    n = history_names(table.name, table.schema)
    default = qualified_name(n.default_partition, table.schema)
    return text(
        f"WITH moved AS (DELETE FROM {default} WHERE {PARTITION_KEY} >= :start "
        f"AND {PARTITION_KEY} < :end RETURNING *) "
        f"INSERT INTO {qualified_name(day_partition, table.schema)} "
        "SELECT * FROM moved RETURNING id"
    )


def delete_default_before(table: Table) -> TextClause:
    """Delete up to ``:limit`` rows finished before ``:cutoff`` from the history's
    ``DEFAULT`` partition (rows that came while no day partition took them: retention by
    DELETE, the rare case). Returns their ids."""
    n = history_names(table.name, table.schema)
    default = qualified_name(n.default_partition, table.schema)
    return text(
        f"DELETE FROM {default} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {default} "
        f"WHERE {PARTITION_KEY} < :cutoff LIMIT :limit)) RETURNING id"
    )


# -- the queries: each statement above with the record of its parameters and its row ----------


class CompleteParams(FenceParams):
    """The attempts to complete (:func:`complete`) and their results: a JSON object as text,
    ``{"<id>:<attempt>": result}`` (``"{}"`` for none)."""

    results: str


class SweepWindowParams(TypedDict):
    """The window after id ``after``, of ``scan`` ids (:func:`sweep_window`)."""

    after: int
    scan: int


class SweepParams(TypedDict):
    """The ids in ``(after, upto]`` (:func:`sweep`)."""

    after: int
    upto: int


class LockKeyParams(TypedDict):
    """One history's maintenance lock key (:func:`try_lock`)."""

    lock_key: str


class ValueParams(TypedDict):
    """A setting's value, as text (:func:`set_lock_timeout`: ``"200ms"``)."""

    value: str


class PartitionsParams(TypedDict):
    """A history table's qualified name (:func:`partitions`)."""

    history: str


class BoundsParams(TypedDict):
    """A day's bounds, ``[start, end)`` (:func:`default_rows_between`,
    :func:`move_out_of_default`)."""

    start: datetime
    end: datetime


class CutoffParams(TypedDict):
    """Up to ``limit`` rows finished before ``cutoff`` (:func:`delete_default_before`)."""

    cutoff: datetime
    limit: int


class WorkflowIdParams(TypedDict):
    """One workflow (:func:`lock_workflow`, :func:`bring_back`)."""

    workflow_id: int


class WorkflowIdRow(NamedTuple):
    """A job's workflow, None for a job that is no step."""

    workflow_id: int | None


class SweepWindowRow(NamedTuple):
    """The last id of the next window, None past the end."""

    max: int | None


class IdRow(NamedTuple):
    id: int


class StatusRow(NamedTuple):
    status: str


class TryLockRow(NamedTuple):
    """Whether this transaction now holds the maintenance lock."""

    pg_try_advisory_xact_lock: bool


class SetConfigRow(NamedTuple):
    """The setting's new value."""

    set_config: str


class NowRow(NamedTuple):
    statement_timestamp: datetime


class PartitionRow(NamedTuple):
    """A partition's name, and its bound's text (``FOR VALUES FROM (...) TO (...)``,
    ``DEFAULT``)."""

    name: str
    bound: str | None


class ExistsRow(NamedTuple):
    exists: bool


#: The hot path's completion into the history (``held=True``: the lock-held group's).
COMPLETE: Final = Query(complete, CompleteParams, CompleteRow)
MOVE_FINISHED: Final = Query(move_finished, JobIdParams, CompleteRow)
SWEEP_WINDOW: Final = Query(sweep_window, SweepWindowParams, SweepWindowRow)
#: ``result_table=``: the result table whose rows move with their jobs; ``workflow=``: the
#: workflow table of a model with steps.
SWEEP: Final = Query(sweep, SweepParams, CompleteRow)
RETRY: Final = Query(retry, JobIdParams, IdRow)
STEP_WORKFLOW: Final = Query(step_workflow, JobIdParams, WorkflowIdRow)
LOCK_WORKFLOW: Final = Query(lock_workflow, WorkflowIdParams, IdRow)
#: ``result_table=``: the result table the steps' results go back into.
BRING_BACK: Final = Query(bring_back, WorkflowIdParams, IdRow)
#: ``workflow=``: the workflow table.
PRUNE_ENDED_WORKFLOWS: Final = Query(prune_ended_workflows, CutoffParams, IdRow)
STATUS_OF: Final = Query(status_of, JobIdParams, StatusRow)
#: Every job column (their names differ by model: read by name), then ``result`` and
#: ``in_history``; see :func:`found_record`.
RECORD: Final[Query[JobIdParams, tuple[Any, ...]]] = Query(record, JobIdParams)
TRY_LOCK: Final = Query(try_lock, LockKeyParams, TryLockRow)
SET_LOCK_TIMEOUT: Final = Query(set_lock_timeout, ValueParams, SetConfigRow)
DATABASE_NOW: Final = Query(database_now, NoParams, NowRow)
UTC: Final = Query(utc, NoParams, SetConfigRow)
PARTITIONS: Final = Query(partitions, PartitionsParams, PartitionRow)
DEFAULT_ROWS_BETWEEN: Final = Query(default_rows_between, BoundsParams, ExistsRow)
#: ``day_partition=``: the detached partition-to-be the rows move into.
MOVE_OUT_OF_DEFAULT: Final = Query(move_out_of_default, BoundsParams, IdRow)
DELETE_DEFAULT_BEFORE: Final = Query(delete_default_before, CutoffParams, IdRow)


class FoundRecord(NamedTuple):
    """Job's full row as :data:`RECORD` finds it: every job column by name, its result and
    whether it is in the history."""

    values: dict[str, Any]
    result: Any
    in_history: bool


def found_record(executor: Executor, table: Table, job_id: int) -> FoundRecord | None:
    """Job ``job_id``'s row wherever it is (:data:`RECORD`), in ``executor``'s transaction;
    None when it is in neither table."""
    row = RECORD.result(executor, table, {"job_id": job_id}).mappings().first()
    if row is None:
        return None
    return FoundRecord(
        values={c.name: row[c.name] for c in table.columns},
        result=row[RESULT_COLUMN],
        in_history=bool(row["in_history"]),
    )


# -- the maintenance's operations: several statements of one transaction, the caller's ------


def statement_time(executor: Executor) -> datetime:
    """The database's clock (:data:`DATABASE_NOW`), in ``executor``'s transaction."""
    row = DATABASE_NOW.one(executor, None, {})
    assert row is not None  # a SELECT without FROM returns its one row
    return row.statement_timestamp


def partition_rows(executor: Executor, table: Table) -> list[PartitionRow]:
    """The partitions of ``table``'s history (:data:`PARTITIONS`), their bounds printed in
    UTC: :data:`UTC` first sets the time zone for the rest of ``executor``'s transaction."""
    names = history_names(table.name, table.schema)
    UTC.result(executor, None, {})
    return PARTITIONS.rows(executor, None, {"history": qualified_name(names.table, table.schema)})


def hold_maintenance_lock(connection: Connection, table: Table, lock_timeout: float) -> bool:
    """Set ``lock_timeout`` (seconds) for the rest of ``connection``'s transaction
    (:data:`SET_LOCK_TIMEOUT`), then try for ``table``'s history's maintenance lock
    (:data:`TRY_LOCK`): whether the transaction now holds it. The caller began the
    transaction, and its end releases the lock; never waits."""
    SET_LOCK_TIMEOUT.result(connection, None, {"value": f"{int(lock_timeout * 1000)}ms"})
    key = history_names(table.name, table.schema).lock_key
    row = TRY_LOCK.one(connection, None, {"lock_key": key})
    return row is not None and bool(row.pg_try_advisory_xact_lock)


def make_day_partition(connection: Connection, table: Table, day: date) -> int:
    """Create ``day``'s partition of ``table``'s history in ``connection``'s transaction (the
    caller's, which holds the maintenance lock: :func:`hold_maintenance_lock`); returns how
    many rows of that day moved into it from the ``DEFAULT`` partition.

    Inserts into the history are held first (:func:`~sqla_jobs.schema.history.hold_inserts`),
    so that no row of the day can reach ``DEFAULT`` after the look for one
    (:data:`DEFAULT_ROWS_BETWEEN`). With none there, the partition is created attached;
    otherwise (PostgreSQL refuses a partition whose rows sit in the ``DEFAULT`` one) it is
    built beside the history, the rows move in (:data:`MOVE_OUT_OF_DEFAULT`), and it is
    attached: all in this transaction, so in the order written."""
    schema = table.schema
    start, end = day_bounds(day)
    bounds: BoundsParams = {"start": start, "end": end}
    connection.execute(executable(hold_inserts(table.name, schema)))
    crowded = DEFAULT_ROWS_BETWEEN.one(connection, table, bounds)
    if crowded is None or not crowded.exists:
        connection.execute(executable(create_partition(table.name, day, schema)))
        return 0
    connection.execute(executable(create_detached_partition(table.name, day, schema)))
    name = history_names(table.name, schema).partition(day)
    moved = MOVE_OUT_OF_DEFAULT.rows(connection, table, bounds, day_partition=name)
    connection.execute(executable(attach_partition(table.name, day, schema)))
    return len(moved)


def drop_day_partition(connection: Connection, table: Table, name: str) -> None:
    """Drop the history partition ``name`` of ``table``'s schema (``DROP TABLE IF EXISTS``),
    in ``connection``'s transaction (the caller's, which holds the maintenance lock)."""
    connection.execute(executable(drop_partition(name, table.schema)))
