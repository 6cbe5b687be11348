"""Administration: retry, cancel, delete, prune, vacuum, statistics, dead jobs (see
:mod:`sqla_jobs.queue`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from time import monotonic

from sqlalchemy import (
    Engine,
)
from sqlalchemy.exc import IntegrityError

from sqla_jobs import validation
from sqla_jobs._queries import workflows
from sqla_jobs._queries.admin import (
    DEAD_JOBS,
    DEAD_ROWS,
    PRUNE,
    QUEUE_STATS,
    PruneParams,
    run_vacuum,
)
from sqla_jobs._queries.outcomes import (
    CANCEL,
    CANCEL_ATTEMPTS,
    CANCEL_REQUESTS,
    DELETE_JOB,
    REQUEST_CANCEL,
    JobIdParams,
)
from sqla_jobs._queries.run import Executor, job_table_of
from sqla_jobs._queries.variant import JobTables, tables_of
from sqla_jobs.errors import (
    InvalidJobError,
    JobNotFoundError,
    JobStateError,
)
from sqla_jobs.queue._plumbing import (
    MAX_CLAIM_LIMIT,
    VACUUM_DEAD_ROWS,
    ClaimedJob,
    QueueStat,
    _check_count,
    _fence_params,
    _fenced,
    _lost,
    _one_model,
    _seconds,
)
from sqla_jobs.schema import (
    JobMixin,
    JobStatus,
    has_steps,
    names,
)
from sqla_jobs.schema.workflows import check_step_model

logger = logging.getLogger(__name__)


# -- administration ---------------------------------------------------------------------


def _admin(
    session: Executor,
    model: type[JobMixin],
    job_id: int,
    change: Callable[[JobTables, JobIdParams], bool],
    expected: str,
) -> None:
    validation.check_job_id("job_id", job_id)
    tables = tables_of(model)
    if change(tables, {"job_id": job_id}):
        return
    status = tables.status(session, job_id)
    if status is None:
        raise JobNotFoundError(f"{model.__name__} has no job {job_id}")
    raise JobStateError(f"job {job_id} is {status}; only {expected} jobs can be changed so")


def retry(session: Executor, model: type[JobMixin], job_id: int) -> None:
    """Make a dead or cancelled job pending again, runnable now, with at least one more
    attempt. Raises :class:`JobNotFoundError` or :class:`JobStateError`, the latter also
    when the job is a unique job whose key another pending or running job holds now (the
    caller's transaction stays usable: the attempt runs under a savepoint).

    For a model with ``partitioned_history``, a dead or cancelled job found in the history
    moves back into the job table (same id, ``attempts`` kept), in one statement; a step
    of a workflow there brings its workflow's steps back with it, and the workflow runs
    again (:class:`~sqla_jobs._queries.variant.StepHistoryJobTables`)."""
    try:
        with session.begin_nested():
            _admin(
                session,
                model,
                job_id,
                lambda tables, params: tables.retry(session, params["job_id"]),
                "dead or cancelled",
            )
    except IntegrityError as exc:
        if names(job_table_of(model).name).unique_index not in str(exc.orig):
            raise
        raise JobStateError(
            f"job {job_id} cannot be retried: another job holds its unique key"
        ) from exc


def cancel(session: Executor, model: type[JobMixin], job_id: int) -> JobStatus:
    """Cancel a job: at once if it is pending, by asking its worker if it is running.

    Returns the job's status once the caller commits: ``cancelled`` for a pending job (or
    one already cancelled: idempotent), ``running`` for a running one, whose cancel is now
    *requested* (:func:`sqla_jobs._queries.request_cancel`): its worker hears of it
    through a notification on the table's channel at commit (and at its next heartbeat if
    it missed that), cancels a coroutine handler, raises
    :class:`~sqla_jobs.errors.JobCancelledError` from ``ctx.raise_if_cancelled()`` in a
    thread handler, rolls a lock-mode handler's transaction back, and ends the job
    ``cancelled``, fenced by its attempt. From the request on, the job never succeeds,
    retries or runs again: a handler that ignores the request and returns ends cancelled
    all the same (its result is not stored), and if its worker died, the claim that finds
    its lease expired makes it cancelled instead of running it.

    Runs in the caller's transaction: nothing happens until the caller commits. Raises
    :class:`InvalidJobError` for a ``job_id`` that is not an integer (before any SQL),
    :class:`JobNotFoundError` when there is no such job, and :class:`JobStateError` when it
    already succeeded or is dead (use :func:`retry` first for a dead one).
    """
    validation.check_job_id("job_id", job_id)
    tables = tables_of(model)
    params: JobIdParams = {"job_id": job_id}
    if CANCEL.one(session, tables.table, params) is not None:
        tables.ended(session, job_id)  # into the history at once, for a model with one
        return JobStatus.CANCELLED
    if REQUEST_CANCEL.one(session, tables.table, params) is not None:
        return JobStatus.RUNNING
    status = tables.status(session, job_id)
    if status is None:
        raise JobNotFoundError(f"{model.__name__} has no job {job_id}")
    if status == JobStatus.CANCELLED.value:
        return JobStatus.CANCELLED
    raise JobStateError(f"job {job_id} is {status}; only pending or running jobs can be cancelled")


def cancel_attempts(session: Executor, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """End these attempts' jobs ``cancelled`` (the worker's outcome for an attempt whose
    cancel was requested). Fenced: returns the attempts that had lost their job, or
    whose job has no cancel request (those are left as they are)."""
    if not jobs:
        return []
    table = job_table_of(_one_model(jobs))
    rows = CANCEL_ATTEMPTS.tuples(session, table, _fence_params(jobs))
    return _lost(jobs, _fenced(rows))


def cancel_requests(session: Executor, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """Which of these attempts' jobs have a cancel request (:func:`cancel`). A plain read,
    no lock; the worker's heartbeat asks it, in case it missed the notification."""
    if not jobs:
        return []
    table = job_table_of(_one_model(jobs))
    asked = _fenced(CANCEL_REQUESTS.tuples(session, table, _fence_params(jobs)))
    return [job for job in jobs if (job.id, job.attempt) in asked]


def delete(session: Executor, model: type[JobMixin], job_id: int) -> None:
    """Delete a job that is not running (pending, succeeded, dead or cancelled), in the
    caller's transaction. Raises :class:`JobNotFoundError`, or :class:`JobStateError` when
    the job is running (its attempt owns it until it ends). A stored result row of the job
    is kept (results are deliberately not tied to job rows; see :class:`JobResultMixin`).
    """
    _admin(
        session,
        model,
        job_id,
        lambda tables, params: DELETE_JOB.one(session, tables.table, params) is not None,
        "pending or finished",
    )


def prune(
    session: Executor,
    model: type[JobMixin],
    *,
    older_than: timedelta | float,
    limit: int = 10_000,
) -> int:
    """Delete one batch: up to ``limit`` finished jobs (succeeded, dead, cancelled) that
    finished more than ``older_than`` ago, by the database's clock, oldest ids first.
    Returns how many were deleted.

    One call deletes one batch, in the caller's transaction. To delete them all, call it
    again, each time in a new transaction (so that no transaction holds a long delete),
    until it returns less than ``limit``. ``sqla-jobs prune --batch-size N`` is that loop:
    one batch of ``N`` per transaction until a batch comes back short.

    A model with ``partitioned_history`` keeps no finished job here to delete: its history
    is pruned by dropping whole partitions, which :func:`sqla_jobs.history.drop_partitions`
    and ``sqla-jobs prune`` do; this raises :class:`ConfigurationError` for it.

    A model with workflow steps deletes a step only with its workflow: each call also
    deletes the workflows that finished more than ``older_than`` ago, whole (the workflow
    row and its steps; as many as hold fewer than ``limit`` steps before the last one
    taken), and counts their steps among the jobs deleted."""
    tables = tables_of(model)
    tables.check_prunable()
    _check_count("limit", limit, MAX_CLAIM_LIMIT * 100)
    seconds = _seconds("older_than", older_than)
    params: PruneParams = {"older_than_seconds": seconds, "limit": limit}
    if not has_steps(model):
        return PRUNE.result(session, tables.table, params).rowcount
    # Workflow steps go with their workflow, once it finished: never one by one.
    deleted = PRUNE.result(session, tables.table, params, steps=True).rowcount
    flows = workflows.PRUNE_WORKFLOWS.rows(session, check_step_model(model), params)
    if flows:
        ids = [flow.id for flow in flows]
        deleted += len(workflows.PRUNE_STEPS.rows(session, tables.table, {"workflow_ids": ids}))
    return deleted


def vacuum(engine: Engine, model: type[JobMixin], *, min_dead_rows: int = VACUUM_DEAD_ROWS) -> bool:
    """Vacuum the job table if it holds at least ``min_dead_rows`` dead row versions; return
    whether a ``VACUUM`` was run.

    Why: a claim reads the pending index from its head, and every job claimed since the last
    vacuum leaves a dead entry there, so claims get slower the more jobs are claimed between
    vacuums (measured on PostgreSQL 15: a 1M-job drain without a vacuum ran at 0.39 of the
    rate of 50k-job drains beside it; with this, called every 5,000 jobs, at 0.90).
    Autovacuum wakes up once a minute per database at best, and may be off or busy; the
    processes that claim call this instead, every few thousand jobs they claim (the check is
    one read of the statistics; the VACUUM runs only past the threshold), so that no one has
    to tune autovacuum::

        # in a thread of its own, after every 5,000 jobs this process claimed
        sqla_jobs.vacuum(engine, EmailJob)

    It reads the table's dead row count from PostgreSQL's statistics (no table access), and
    only if that reaches ``min_dead_rows`` runs :func:`sqla_jobs._queries.vacuum`: a
    ``VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON)``, which skips the table when another vacuum of
    it (autovacuum's, another worker's) is running, and blocks no claim, enqueue or outcome.
    Many workers calling it need no coordination. It takes time (a pass over every index of
    the table): call it from a thread of its own, never from a loop that claims.

    VACUUM cannot run in a transaction, so this takes an :class:`~sqlalchemy.engine.Engine`
    and runs on a connection of its own in autocommit mode, returned to the pool afterwards:
    nothing of the caller's transactions is involved. A vacuum removes only the rows that no
    open transaction can still see: a long transaction anywhere on the server (an idle one,
    a long report) leaves the dead entries in place until it ends.
    """
    table = job_table_of(model)
    threshold: object = min_dead_rows
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise InvalidJobError("min_dead_rows", f"must be an integer >= 0, got {threshold!r}")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        row = DEAD_ROWS.one(connection, table, {})
        dead = 0 if row is None else row.dead_rows
        if dead < min_dead_rows:
            return False
        started = monotonic()
        run_vacuum(connection, table)
    seconds = monotonic() - started
    logger.info(
        "vacuumed %s (%d dead row versions) in %.2f s",
        table.fullname,
        dead,
        seconds,
        extra={"action": "table_vacuumed", "dead_rows": dead, "seconds": seconds},
    )
    return True


def queue_stats(session: Executor, model: type[JobMixin]) -> list[QueueStat]:
    """Live job counts by queue and status (``pending``, ``running``, ``dead``), with the
    runnable count and the age of the oldest runnable job, and the expired leases.

    Cheap at any size of history: it reads only the pending, running and dead partial
    indexes (:func:`sqla_jobs._queries.queue_stats`), so its cost grows with the jobs
    waiting, running and dead, never with the succeeded and cancelled rows, which it does
    not count. For a model with ``partitioned_history`` the dead count includes the dead
    jobs in its history table (read from the history's dead index, not from the history).
    Ages are the database's clock. Takes no lock; runs in the caller's
    transaction. For the server-wide gauges (vacuum, table size) see
    :func:`sqla_jobs.health.read_gauges`.
    """
    tables = tables_of(model)
    return [
        QueueStat(
            queue=row.queue,
            status=JobStatus(row.status),
            count=int(row.total),
            oldest_pending_seconds=(
                None if row.oldest_runnable_seconds is None else float(row.oldest_runnable_seconds)
            ),
            runnable=int(row.runnable),
            expired_leases=int(row.expired),
        )
        # A model with partitioned_history keeps its dead jobs in its history table: they
        # are read there too (from the history's dead index), other models pay nothing.
        for row in QUEUE_STATS.rows(session, tables.table, {}, history=tables.history)
    ]


@dataclass(frozen=True, slots=True)
class DeadJob:
    """A row of :func:`dead_jobs`."""

    id: int
    queue: str
    task: str
    attempts: int
    finished_at: datetime | None
    last_error: str | None


def dead_jobs(session: Executor, model: type[JobMixin], *, limit: int = 20) -> list[DeadJob]:
    """The ``limit`` most recently finished dead jobs, newest first, with their last error
    (for a model with ``partitioned_history``, those in its history table too)."""
    tables = tables_of(model)
    _check_count("limit", limit, MAX_CLAIM_LIMIT)
    rows = DEAD_JOBS.rows(session, tables.table, {"limit": limit}, history=tables.history)
    return [
        DeadJob(
            id=row.id,
            queue=row.queue,
            task=row.task,
            attempts=row.attempts,
            finished_at=row.finished_at,
            last_error=row.last_error,
        )
        for row in rows
    ]
