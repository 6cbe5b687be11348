"""The statements of an attempt's outcome and of a job's later changes: lock, complete,
fail, heartbeat, release, retry, cancel, delete (see :mod:`sqla_jobs._queries`)."""

from __future__ import annotations

from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Float,
    Insert,
    Integer,
    Select,
    Table,
    Text,
    Update,
    and_,
    bindparam,
    case,
    cast,
    column,
    delete,
    func,
    literal_column,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.sql.dml import ReturningDelete

from sqla_jobs._queries._sql import (
    _ONE,
    _SECOND,
    FenceParams,
    LeaseFenceParams,
    _cancel_requested,
    _fenced_by_key,
    _fences,
    _lit,
    _now,
    _readable_time,
)
from sqla_jobs._queries.enqueueing import (
    CONTROL_INPUTS,
    ENQUEUE_COLUMNS,
    ORDERING_COLUMNS,
    enqueue_columns,
)
from sqla_jobs._queries.rows import CompleteRow, DeleteRow, FailRow, FenceRow, LockRow
from sqla_jobs._queries.run import Query
from sqla_jobs.schema import JobStatus, names


def lock(table: Table) -> Select[Any]:
    """Lock the rows of attempts this worker holds, until the caller's transaction ends.

    The second half of a lock-held claim: :func:`claim` committed the attempt (so it counts
    even if the worker dies), and this ``SELECT ... FOR UPDATE`` holds the rows for the
    transaction that runs the handlers. Fenced by ``(id, attempts)``: an attempt whose lease
    already ran out and was taken over is not returned. Rows are locked in id order.

    The lock is ``FOR KEY SHARE``: every claim and heartbeat locks ``FOR UPDATE SKIP
    LOCKED``, which conflicts with it, so they skip the row as before; but a plain
    ``UPDATE`` of a non-key column does not wait for it, so :func:`request_cancel` can
    record a cancel request while the handler holds the row (the handler's own completion
    then waits for that request to commit, sees it, and the worker rolls back).

    Returns ``id, attempts`` and the locking transaction's start as epoch seconds (which,
    with the backend's pid, names that transaction: :func:`terminate_transactions`).
    Parameters: ``:fence_ids``, ``:fence_attempts``. Finds the rows through the primary key
    (:func:`_fenced_by_key`).
    """
    return (
        select(
            table.c.id,
            table.c.attempts,
            # Double precision, not extract's numeric: parsed once per row, and a float
            # parses several times faster than a Decimal (the same value, correctly rounded
            # either way, as terminate_transactions compares it).
            cast(func.extract("epoch", func.transaction_timestamp()), Float).label("xact_start"),
        )
        .where(_fenced_by_key(table))
        .order_by(table.c.id)
        .with_for_update(of=table, read=True, key_share=True)
    )


def complete(table: Table) -> Update:
    """Mark the given attempts succeeded, or cancelled when their cancel was requested
    (:func:`_cancel_requested`). Fenced.

    Returns ``id, attempts, task, status`` of each job it ended.

    Parameters: ``:fence_ids``, ``:fence_attempts``. Locks the matched rows (an ``UPDATE``).
    """
    _, match = _fences(table)
    return (
        update(table)
        .where(match)
        .values(
            status=case(
                (_cancel_requested(table), _lit(JobStatus.CANCELLED)),
                else_=_lit(JobStatus.SUCCEEDED),
            ),
            finished_at=_now(),
            lease_expires_at=null(),
        )
        .returning(table.c.id, table.c.attempts, table.c.task, table.c.status)
    )


def complete_held(table: Table) -> Update:
    """Mark succeeded the given attempts whose rows the caller's transaction holds locked
    (:func:`lock`), except those whose cancel was requested: a lock-held group's
    completion. Fenced; finds the rows through the primary key (:func:`_fenced_by_key`).

    A job whose cancel was requested is left as it is (running, its cancel requested): its
    handler's writes roll back, and the worker cancels it once its transaction has ended.
    Returns ``id, attempts`` of each job it completed.
    Parameters: ``:fence_ids``, ``:fence_attempts``. Locks the matched rows (an ``UPDATE``).
    """
    match = _fenced_by_key(table)
    return (
        update(table)
        .where(match, table.c.cancel_requested_at.is_(null()))
        .values(
            status=_lit(JobStatus.SUCCEEDED),
            finished_at=_now(),
            lease_expires_at=null(),
        )
        .returning(table.c.id, table.c.attempts)
    )


def complete_and_delete(table: Table) -> ReturningDelete[Any]:
    """Delete the rows of the given succeeded attempts (seed 001's variant). Fenced.

    A job whose cancel was requested is not deleted (it is not succeeded): it comes back
    as not matched, for :func:`cancel_attempts`. Returns ``id, attempts, task`` of each
    deleted job.
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    _, match = _fences(table)
    return (
        delete(table)
        .where(match, table.c.cancel_requested_at.is_(null()))
        .returning(table.c.id, table.c.attempts, table.c.task)
    )


def store_results(result_table: Table) -> Insert:
    """Insert (or replace) result rows from ``:results``, a jsonb array of
    ``{"job_id", "task", "value"}`` objects. The finish time is the database's."""
    rows = (
        func.jsonb_to_recordset(bindparam("results", type_=JSONB))
        .table_valued(column("job_id", BigInteger), column("task", Text), column("value", JSONB))
        .render_derived(name="r", with_types=True)
    )
    stmt = insert(result_table).from_select(
        ["job_id", "task", "value", "finished_at"],
        select(rows.c.job_id, rows.c.task, rows.c.value, _now()),
    )
    return stmt.on_conflict_do_update(
        index_elements=[result_table.c.job_id],
        set_={
            "task": stmt.excluded.task,
            "value": stmt.excluded.value,
            "finished_at": stmt.excluded.finished_at,
        },
    )


def fail(table: Table) -> Update:
    """Record a failed attempt: retry it after a backoff, or make it dead. Fenced.

    The job is cancelled when its cancel was requested (:func:`_cancel_requested`), dead
    when this was its last attempt (``attempts >= max_attempts``) or when ``:retry`` is
    false; otherwise it is pending again at ``statement_timestamp()`` plus
    ``:delay_seconds`` if given, else plus an exponential backoff with jitter, computed in
    the database from the row's own attempt count::

        least(:cap, :base * 2 ^ least(attempts - 1, 60)) * (1 + :jitter * (2 * random() - 1))

    Parameters: ``:job_id``, ``:attempt``, ``:error``, ``:retry``, ``:delay_seconds`` (null for
    the backoff), ``:base``, ``:cap``, ``:jitter``. Returns ``id, status, run_at`` (NULL where
    Python cannot hold it: :func:`_readable_time`).
    """
    now = _now()
    is_dead = or_(
        table.c.attempts >= table.c.max_attempts,
        ~bindparam("retry", type_=Boolean),
    )
    # The exponent is clamped: 2.0 ^ 1024 overflows float8, and the cap is reached long
    # before 2 ^ 60 anyway.
    exponent = func.least(table.c.attempts - _ONE, literal_column("60"))
    backoff = func.least(
        bindparam("cap", type_=Float),
        bindparam("base", type_=Float) * func.power(literal_column("2.0"), exponent),
    ) * (_ONE + bindparam("jitter", type_=Float) * (literal_column("2") * func.random() - _ONE))
    delay = func.coalesce(bindparam("delay_seconds", type_=Float), backoff)
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.attempts == bindparam("attempt", type_=Integer),
            table.c.status == _lit(JobStatus.RUNNING),
        )
        .values(
            status=case(
                (_cancel_requested(table), _lit(JobStatus.CANCELLED)),
                (is_dead, _lit(JobStatus.DEAD)),
                else_=_lit(JobStatus.PENDING),
            ),
            run_at=case(
                (or_(is_dead, _cancel_requested(table)), table.c.run_at),
                else_=now + delay * _SECOND,
            ),
            finished_at=case((or_(is_dead, _cancel_requested(table)), now), else_=null()),
            last_error=bindparam("error", type_=Text),
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id, table.c.status, _readable_time(table.c.run_at))
    )


def heartbeat(table: Table) -> Update:
    """Extend the leases of the given attempts, each to ``now + its lease``. Fenced.

    One statement for the whole batch, whatever the attempts' leases (``:fence_leases``
    pairs a lease in seconds with each fence). It never waits on a row lock: the rows are
    locked in id order with ``SKIP LOCKED``, so a row that another transaction holds (a
    lock-mode handler's, an outcome being written, a claim taking over an expired lease) is
    skipped, not waited for, and a heartbeat can take part in no deadlock.

    Only ``lease_expires_at`` changes; it is a key of the running index (which lets a claim
    find expired leases without reading live ones), so the update is not HOT: each heartbeat
    adds an entry to the job table's indexes. Returns ``id, attempts`` of the attempts whose
    lease was extended.
    Parameters: ``:fence_ids``, ``:fence_attempts``, ``:fence_leases``.
    """
    pairs, match = _fences(table, leases=True)
    held = (
        select(table.c.id, pairs.c.lease)
        .select_from(table)
        .join(pairs, match)
        .order_by(table.c.id)
        .with_for_update(of=table, skip_locked=True)
        .cte("held")
    )
    return (
        update(table)
        .where(table.c.id == held.c.id)
        .values(lease_expires_at=_now() + held.c.lease * _SECOND)
        .returning(table.c.id, table.c.attempts)
    )


def progress(table: Table) -> Update:
    """Store the progress running attempts reported: ``:progress``, a JSON array (as text)
    of ``{"id", "attempt", "value", "message"}`` objects. Fenced (a finished or taken-over
    attempt's progress is dropped). Each row's ``progress`` becomes ``{"value", "message",
    "at"}``, ``at`` the database's time.

    Like :func:`heartbeat` it never waits on a row lock (``SKIP LOCKED``, in id order): a
    row another transaction holds is left for the next write, and this statement takes part
    in no deadlock. ``progress`` is indexed by nothing, so the update is HOT where the page
    has room. Returns ``id, attempts`` of the attempts whose progress was stored.
    """
    reported = (
        func.jsonb_to_recordset(func.cast(bindparam("progress", type_=Text), JSONB))
        .table_valued(
            column("id", BigInteger),
            column("attempt", Integer),
            column("value", Float),
            column("message", Text),
        )
        .render_derived(name="p", with_types=True)
    )
    held = (
        select(table.c.id, reported.c.value, reported.c.message)
        .select_from(table)
        .join(
            reported,
            and_(table.c.id == reported.c.id, table.c.attempts == reported.c.attempt),
        )
        .where(table.c.status == _lit(JobStatus.RUNNING))
        .order_by(table.c.id)
        .with_for_update(of=table, skip_locked=True)
        .cte("held")
    )
    stored = func.jsonb_build_object(
        literal_column("'value'"),
        held.c.value,
        literal_column("'message'"),
        held.c.message,
        literal_column("'at'"),
        _now(),
    )
    return (
        update(table)
        .where(table.c.id == held.c.id)
        .values(progress=stored)
        .returning(table.c.id, table.c.attempts)
    )


def release(table: Table) -> Update:
    """Give back the given attempts unfinished: pending again, runnable now. Fenced.

    A job whose cancel was requested is not given back: it ends cancelled instead.

    ``attempts`` stays (it is the fence, and must never repeat); ``max_attempts`` grows by
    one instead, so a job given back at shutdown loses none of its remaining attempts.
    Returns ``id, attempts`` of the released attempts.
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    _, match = _fences(table)
    return (
        update(table)
        .where(match)
        .values(
            status=case(
                (_cancel_requested(table), _lit(JobStatus.CANCELLED)),
                else_=_lit(JobStatus.PENDING),
            ),
            run_at=_now(),
            max_attempts=table.c.max_attempts + _ONE,
            finished_at=case((_cancel_requested(table), _now()), else_=null()),
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id, table.c.attempts)
    )


def snooze(table: Table) -> Update:
    """Snooze attempt ``:attempt`` of job ``:job_id``: pending again at ``now()`` plus
    ``:delay_seconds``, without spending an attempt, unless the job snoozed
    ``:max_snoozes`` times already (then nothing changes: the caller fails the attempt).
    Fenced.

    As :func:`release` does, ``attempts`` stays (the fence never repeats) and
    ``max_attempts`` grows by one; ``snoozes`` counts the snooze. A job whose cancel was
    requested ends cancelled instead. Returns ``id, status``.
    """
    cancelled = _cancel_requested(table)
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.attempts == bindparam("attempt", type_=Integer),
            table.c.status == _lit(JobStatus.RUNNING),
            table.c.snoozes < bindparam("max_snoozes", type_=Integer),
        )
        .values(
            status=case((cancelled, _lit(JobStatus.CANCELLED)), else_=_lit(JobStatus.PENDING)),
            run_at=case(
                (cancelled, table.c.run_at),
                else_=_now() + bindparam("delay_seconds", type_=Float) * _SECOND,
            ),
            max_attempts=case((cancelled, table.c.max_attempts), else_=table.c.max_attempts + _ONE),
            snoozes=case((cancelled, table.c.snoozes), else_=table.c.snoozes + _ONE),
            finished_at=case((cancelled, _now()), else_=null()),
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id, table.c.status)
    )


def retry(table: Table) -> Update:
    """Make a dead or cancelled job ``:job_id`` pending again, runnable now.

    It gets at least one more attempt; ``attempts`` is kept, so fencing stays sound; a
    cancel request it carried is cleared. Returns the id, or no row when the job is not
    dead or cancelled.
    """
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.status.in_([_lit(JobStatus.DEAD), _lit(JobStatus.CANCELLED)]),
        )
        .values(
            status=_lit(JobStatus.PENDING),
            run_at=_now(),
            max_attempts=func.greatest(table.c.max_attempts, table.c.attempts + _ONE),
            finished_at=null(),
            lease_expires_at=null(),
            leased_by=null(),
            cancel_requested_at=null(),
        )
        .returning(table.c.id)
    )


def cancel(table: Table) -> Update:
    """Cancel pending (or waiting: a workflow step) job ``:job_id``. Returns the id, or no
    row when it is neither.

    A running job is not cancelled here: its attempt owns it until it ends.
    """
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.status.in_([_lit(JobStatus.PENDING), _lit(JobStatus.WAITING)]),
        )
        .values(status=_lit(JobStatus.CANCELLED), finished_at=_now())
        .returning(table.c.id)
    )


def delete_job(table: Table) -> ReturningDelete[Any]:
    """Delete job ``:job_id`` unless it is running. Returns the id, or no row when the job
    is running (or does not exist).

    A running job is not deleted: its attempt owns it until it ends, and would find its row
    gone. Locks the row (a ``DELETE``); uses the primary key.
    """
    return (
        delete(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.status != _lit(JobStatus.RUNNING),
        )
        .returning(table.c.id)
    )


#: The NOTIFY payload that asks a worker to stop attempt ``<attempt>`` of job ``<id>``:
#: ``"!cancel:<id>:<attempt>"``, sent on the table's channel. A queue name cannot begin
#: with ``!`` (:data:`sqla_jobs.validation.NAME_RULE`), so it is never taken for one.
CANCEL_PAYLOAD_PREFIX: Final = "!cancel:"


def request_cancel(table: Table) -> Update:
    """Ask the running attempt of job ``:job_id`` to stop: set ``cancel_requested_at``
    (kept if set already: idempotent) and notify the table's channel with
    ``!cancel:<id>:<attempt>`` (:data:`CANCEL_PAYLOAD_PREFIX`), delivered at commit.

    Returns ``id, attempts`` (and the notification's empty value), or no row when the job
    is not running. Locks the row like any ``UPDATE``; a lock-held handler's ``FOR KEY
    SHARE`` lock (:func:`lock`) does not make it wait.
    """
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.status == _lit(JobStatus.RUNNING),
        )
        .values(cancel_requested_at=func.coalesce(table.c.cancel_requested_at, _now()))
        .returning(table.c.id, table.c.attempts, cancel_notification(table))
    )


def cancel_notification(table: Table) -> ColumnElement[Any]:
    """``pg_notify(<channel>, '!cancel:<id>:<attempts>')`` of an updated row: what tells
    its worker that its cancel was requested (delivered at commit)."""
    payload: ColumnElement[str] = (
        literal_column(f"'{CANCEL_PAYLOAD_PREFIX}'")
        + func.cast(table.c.id, Text)
        + literal_column("':'")
        + func.cast(table.c.attempts, Text)
    )
    channel: ColumnElement[str] = literal_column(
        "'" + names(table.name).channel.replace("'", "''") + "'"
    )
    return func.pg_notify(channel, payload)


def cancel_attempts(table: Table) -> Update:
    """End the given attempts' jobs ``cancelled`` (a worker's cancel outcome). Fenced.

    Only a job whose cancel was requested in the database (:func:`request_cancel`, by a
    role that may write the row; :func:`_cancel_requested`) is cancelled: this statement is
    where that rule lives. A notification on the table's channel is no proof of a request
    (any role that can connect may send one, from any schema), so an attempt without one
    comes back unmatched, like an attempt fenced out, and its job is left as it is.

    Returns ``id, attempts`` of the cancelled jobs.
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    _, match = _fences(table)
    return (
        update(table)
        .where(match, _cancel_requested(table))
        .values(
            status=_lit(JobStatus.CANCELLED),
            finished_at=_now(),
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id, table.c.attempts)
    )


def cancel_requests(table: Table) -> Select[Any]:
    """Which of the given attempts have a cancel request: ``id, attempts``. Fenced.

    A plain read (no row lock, so it also sees the rows that lock-held handlers hold):
    what the worker acts on before it stops a handler, whether a cancel notification
    woke it or its heartbeat asks (the fallback for a notification it missed).
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    pairs, match = _fences(table)
    return (
        select(table.c.id, table.c.attempts)
        .select_from(table)
        .join(pairs, match)
        .where(_cancel_requested(table))
    )


def own_columns(table: Table) -> Select[Any]:
    """The model's own columns (:func:`enqueue_columns` past :data:`ENQUEUE_COLUMNS`) of
    job ``:job_id``, by primary key; no lock. What a handler's ``ctx.columns`` reads."""
    own = [
        name
        for name in enqueue_columns(table)[len(ENQUEUE_COLUMNS) :]
        if name not in ORDERING_COLUMNS and name not in CONTROL_INPUTS
    ]
    return select(*(table.c[name] for name in own)).where(
        table.c.id == bindparam("job_id", type_=BigInteger)
    )


# -- the queries: each statement above with the record of its parameters and its row ----------


class ResultsParams(TypedDict):
    """Results to store (:func:`store_results`): ``{"job_id", "task", "value"}`` each."""

    results: list[dict[str, Any]]


class FailParams(TypedDict):
    """One failed attempt (:func:`fail`): its fence, the error, and how to retry it."""

    job_id: int
    attempt: int
    error: str
    retry: bool
    #: None: the exponential backoff of ``base``, ``cap`` and ``jitter``.
    delay_seconds: float | None
    base: float
    cap: float
    jitter: float


class ProgressParams(TypedDict):
    """Progress to store (:func:`progress`): a JSON array of ``{"id", "attempt", "value",
    "message"}`` objects, as text."""

    progress: str


class SnoozeRow(NamedTuple):
    """The job :func:`snooze` changed, and its status: ``pending``, or ``cancelled`` when
    its cancel was requested."""

    id: int
    status: str


class SnoozeParams(TypedDict):
    """One snoozed attempt (:func:`snooze`): its fence, its delay, and the snooze cap."""

    job_id: int
    attempt: int
    delay_seconds: float
    max_snoozes: int


class JobIdParams(TypedDict):
    job_id: int


class IdRow(NamedTuple):
    """The job a statement changed."""

    id: int


class RequestedRow(NamedTuple):
    """The running job whose cancel :func:`request_cancel` requested, its attempt, and the
    notification it sent (``pg_notify``'s void)."""

    id: int
    attempts: int
    pg_notify: Any = None


LOCK: Final = Query(lock, FenceParams, LockRow)
COMPLETE: Final = Query(complete, FenceParams, CompleteRow)
COMPLETE_HELD: Final = Query(complete_held, FenceParams, FenceRow)
COMPLETE_AND_DELETE: Final = Query(complete_and_delete, FenceParams, DeleteRow)
STORE_RESULTS: Final[Query[ResultsParams, tuple[()]]] = Query(store_results, ResultsParams)
FAIL: Final = Query(fail, FailParams, FailRow)
SNOOZE: Final = Query(snooze, SnoozeParams, SnoozeRow)
PROGRESS: Final = Query(progress, ProgressParams, FenceRow)
HEARTBEAT: Final = Query(heartbeat, LeaseFenceParams, FenceRow)
RELEASE: Final = Query(release, FenceParams, FenceRow)
CANCEL_ATTEMPTS: Final = Query(cancel_attempts, FenceParams, FenceRow)
RETRY: Final = Query(retry, JobIdParams, IdRow)
CANCEL: Final = Query(cancel, JobIdParams, IdRow)
DELETE_JOB: Final = Query(delete_job, JobIdParams, IdRow)
REQUEST_CANCEL: Final = Query(request_cancel, JobIdParams, RequestedRow)
CANCEL_REQUESTS: Final = Query(cancel_requests, FenceParams, FenceRow)
#: The job model's own columns of one job (their names differ by model: read by name).
OWN_COLUMNS: Final[Query[JobIdParams, tuple[Any, ...]]] = Query(own_columns, JobIdParams)
