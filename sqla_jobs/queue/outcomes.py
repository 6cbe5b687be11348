"""What an attempt becomes: complete, fail, heartbeat, release (see
:mod:`sqla_jobs.queue`)."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqla_jobs import validation
from sqla_jobs._queries._sql import LeaseFenceParams
from sqla_jobs._queries.outcomes import (
    FAIL,
    HEARTBEAT,
    PROGRESS,
    RELEASE,
    SNOOZE,
    FailParams,
    SnoozeParams,
)
from sqla_jobs._queries.run import Executor, job_table_of
from sqla_jobs._queries.variant import Completion, Result, tables_of
from sqla_jobs.errors import (
    InvalidJobError,
    JobCancelledError,
    LeaseLostError,
)
from sqla_jobs.policy import RetryPolicy
from sqla_jobs.queue._plumbing import (
    _NO_RESULT,
    DEFAULT_LEASE,
    MAX_ERROR_CHARS,
    ClaimedJob,
    FailOutcome,
    _encode,
    _fence_params,
    _fenced,
    _lost,
    _one_model,
    _seconds,
)
from sqla_jobs.schema import (
    JobResultMixin,
    JobStatus,
)

# -- outcomes ---------------------------------------------------------------------------


def complete(
    session: Executor,
    job: ClaimedJob,
    *,
    result: Any = _NO_RESULT,
    result_model: type[JobResultMixin] | None = None,
) -> None:
    """Mark this attempt's job succeeded, optionally storing ``result`` in ``result_model``.

    Runs in the caller's transaction: the completion commits together with the caller's
    other writes. ``result_model`` defaults to the job model's own ``result_model`` (see
    :class:`~sqla_jobs.JobMixin`). Raises :class:`LeaseLostError` when the attempt no longer
    owns the job (nothing changes then), and :class:`InvalidJobError` for a result jsonb
    cannot store. When the job's cancel was requested (:func:`cancel`) it is made
    ``cancelled`` instead, its result not stored, and :class:`JobCancelledError` is raised:
    commit as usual to record it (or roll back: the job still ends cancelled, once the
    attempt's lease runs out).
    """
    results = None if result is _NO_RESULT else [result]
    lost, cancelled = complete_attempts(session, [job], results=results, result_model=result_model)
    if lost:
        raise LeaseLostError(
            f"job {job.id} attempt {job.attempt} no longer owns the job; nothing was changed"
        )
    if cancelled:
        raise JobCancelledError(
            f"job {job.id} was cancelled while attempt {job.attempt} ran: it is cancelled, "
            "not succeeded, and its result was not stored"
        )


def complete_many(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    *,
    results: Sequence[Any] | None = None,
    result_model: type[JobResultMixin] | None = None,
) -> list[ClaimedJob]:
    """Complete a batch of attempts in one statement (two with results).

    ``results``, if given, pairs with ``jobs`` by position and needs ``result_model`` (by
    default the job model's ``result_model``). Returns the attempts that had lost their job
    (fenced out, nothing changed for them); the others are succeeded, or deleted if the
    model sets ``delete_on_success``, or cancelled (their results not stored) when their
    cancel was requested.
    """
    return complete_attempts(session, jobs, results=results, result_model=result_model)[0]


def complete_attempts(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    *,
    results: Sequence[Any] | None = None,
    result_model: type[JobResultMixin] | None = None,
) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
    """:func:`complete_many`, also saying which of the jobs ended cancelled instead (their
    cancel was requested): returns ``(lost, cancelled)``."""
    if not jobs:
        return [], []
    done, cancelled = _complete(session, jobs, results, result_model, held=False)
    if not cancelled:
        return ([] if len(done) == len(jobs) else _lost(jobs, done)), []
    ended_cancelled = [job for job in jobs if (job.id, job.attempt) in cancelled]
    return _lost(jobs, done | cancelled), ended_cancelled


def complete_held(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    *,
    results: Sequence[Any] | None = None,
    result_model: type[JobResultMixin] | None = None,
) -> list[ClaimedJob]:
    """:func:`complete_many` for attempts whose rows the caller's transaction holds locked
    (:func:`lock`), as a lock-held worker completes its group: each row is found through
    its primary key (:func:`sqla_jobs._queries.complete_held`), and a job whose cancel
    was requested is left untouched, still running. Returns the attempts not completed
    (their cancel requested, or no longer theirs): roll back what was done for them, and
    cancel them (fenced) once this transaction has ended."""
    if not jobs:
        return []
    done, cancelled = _complete(session, jobs, results, result_model, held=True)
    return _lost(jobs, done | cancelled)


def _complete(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    results: Sequence[Any] | None,
    result_model: type[JobResultMixin] | None,
    *,
    held: bool,
) -> Completion:
    # The results are checked here, before any SQL; how the completion is written and where
    # the results go is the model's variant's (sqla_jobs._queries.variant).
    stored = None
    if results is not None:
        if len(results) != len(jobs):
            raise InvalidJobError("results", f"has {len(results)} items for {len(jobs)} jobs")
        for value in results:
            validation.check_json("result", value)
        stored = [
            Result(job.id, job.attempt, job.task, value)
            for job, value in zip(jobs, results, strict=True)
        ]
    return tables_of(_one_model(jobs)).complete(
        session,
        _fence_params(jobs),
        len(jobs),
        held=held,
        results=stored,
        result_model=result_model,
    )


def storable_text(text: str) -> str:
    """``text`` as a PostgreSQL text column stores it: NUL replaced, and lone surrogates
    (``os.fsdecode`` of a file name that is not UTF-8) written as ``\\udcff`` escapes,
    which the driver could not encode."""
    text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _error_text(error: str | BaseException) -> str:
    if isinstance(error, BaseException):
        try:
            text = "".join(traceback.format_exception(error))
        except Exception:  # an exception whose __str__ raises: say what it was at least
            text = f"{type(error).__name__} (its message could not be read)"
    else:
        text = str(error)
    # Keep the end of a long traceback, where the cause is.
    if len(text) > MAX_ERROR_CHARS:
        text = "...\n" + text[-MAX_ERROR_CHARS:]
    return storable_text(text)


def fail(
    session: Executor,
    job: ClaimedJob,
    error: str | BaseException,
    *,
    retry: bool = True,
    delay: timedelta | float | None = None,
    policy: RetryPolicy | None = None,
) -> FailOutcome:
    """Record that this attempt failed with ``error`` (a message or an exception).

    The job is retried after ``delay`` if given, else after the ``policy``'s exponential
    backoff with jitter, both measured from the database's clock; it is dead instead when
    this was its last attempt or ``retry`` is false, and ``cancelled`` when its cancel was
    requested (:func:`cancel`). The error (a traceback for an
    exception) is kept in ``last_error``, which nothing else clears: a job that later
    succeeds keeps it, so it is the last error of any attempt. Raises
    :class:`LeaseLostError` when the attempt no longer owns the job, and then nothing
    changes.
    """
    policy = policy or RetryPolicy()
    table = job_table_of(job.model)
    params: FailParams = {
        "job_id": job.id,
        "attempt": job.attempt,
        "error": _error_text(error),
        "retry": bool(retry),
        "delay_seconds": None if delay is None else _seconds("delay", delay),
        "base": policy.base.total_seconds(),
        "cap": policy.cap.total_seconds(),
        "jitter": policy.jitter,
    }
    row = FAIL.one(session, table, params)
    if row is None:
        raise LeaseLostError(
            f"job {job.id} attempt {job.attempt} no longer owns the job; nothing was changed"
        )
    if row.status == JobStatus.DEAD.value:
        # Dead: into the history (a model with one), in the same transaction as the failure.
        tables_of(job.model).ended(session, job.id)
    return FailOutcome(job_id=row.id, status=JobStatus(row.status), run_at=row.run_at)


def snooze(
    session: Executor,
    job: ClaimedJob,
    delay: timedelta | float,
    *,
    policy: RetryPolicy | None = None,
) -> JobStatus:
    """Run this attempt's job again after ``delay`` (database time), without spending an
    attempt: the job is pending at ``now() + delay``, its ``max_attempts`` one larger and
    its ``snoozes`` counted (what a handler's :class:`~sqla_jobs.Snooze` does in a worker).

    Returns the job's status: ``pending``; ``cancelled`` when its cancel was requested; or,
    for a job that snoozed :data:`~sqla_jobs.validation.MAX_SNOOZES` times already, what
    :func:`fail` (with ``policy``) made of the attempt instead, with an error that says so.
    Raises :class:`LeaseLostError` when the attempt no longer owns the job (nothing
    changes), and :class:`InvalidJobError` for a bad ``delay``, before any SQL.
    """
    seconds = validation.check_snooze_delay("delay", delay).total_seconds()
    table = job_table_of(job.model)
    params: SnoozeParams = {
        "job_id": job.id,
        "attempt": job.attempt,
        "delay_seconds": seconds,
        "max_snoozes": validation.MAX_SNOOZES,
    }
    row = SNOOZE.one(session, table, params)
    if row is None:  # lost, or snoozed too often: the failure tells them apart (fenced)
        error = (
            f"the job asked to snooze after {validation.MAX_SNOOZES} snoozes, the most a job "
            "may take; this attempt fails instead"
        )
        return fail(session, job, error, policy=policy).status
    if row.status == JobStatus.CANCELLED.value:
        tables_of(job.model).ended(session, job.id)
    return JobStatus(row.status)


def report_progress(session: Executor, job: ClaimedJob, value: float, message: str = "") -> bool:
    """Store this attempt's progress in its job's ``progress`` column now: ``{"value",
    "message", "at"}`` (``at`` in database time). Fenced, and it never waits on a row
    lock: returns False when nothing was stored (the attempt no longer owns the job, or
    another transaction holds its row). A worker's handler calls
    :meth:`JobContext.report_progress <sqla_jobs.JobContext.report_progress>` instead,
    which writes no more often than the heartbeat. Bad input raises
    :class:`InvalidJobError` before any SQL.
    """
    report = validation.check_progress(value, message)
    return bool(store_progress(session, [(job, report)]))


def store_progress(
    session: Executor, reports: Sequence[tuple[ClaimedJob, dict[str, Any]]]
) -> set[tuple[int, int]]:
    """Store checked progress reports (:func:`~sqla_jobs.validation.check_progress`'s), one
    statement for the batch; returns the ``(id, attempt)`` of those stored."""
    if not reports:
        return set()
    table = job_table_of(_one_model([job for job, _ in reports]))
    document = _encode(
        [{"id": job.id, "attempt": job.attempt, **report} for job, report in reports]
    )
    return _fenced(PROGRESS.tuples(session, table, {"progress": document}))


def heartbeat(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    *,
    lease: timedelta | float | Sequence[timedelta | float] = DEFAULT_LEASE,
) -> list[ClaimedJob]:
    """Extend these attempts' leases to ``lease`` from now, in database time.

    ``lease`` is one duration for all, or a sequence with one per job. One statement for
    the batch; it never waits on a row lock (see :func:`sqla_jobs._queries.heartbeat`).
    Returns the attempts whose lease was not extended: their lease had run out and another
    attempt took over, or the job is finished, or its row was locked by another transaction
    at that moment (a lock-held job's own transaction: its row lock keeps every other claim
    away already). Stop working on a lease-mode attempt returned here.
    """
    if not jobs:
        return []
    table = job_table_of(_one_model(jobs))
    if isinstance(lease, timedelta | float | int):
        seconds = [_seconds("lease", lease)] * len(jobs)
    else:
        seconds = [_seconds("lease", value) for value in lease]
        if len(seconds) != len(jobs):
            raise InvalidJobError("lease", f"has {len(seconds)} items for {len(jobs)} jobs")
    fences = _fence_params(jobs)
    params: LeaseFenceParams = {
        "fence_ids": fences["fence_ids"],
        "fence_attempts": fences["fence_attempts"],
        "fence_leases": ",".join(map(repr, seconds)),
    }
    rows = HEARTBEAT.tuples(session, table, params)
    return _lost(jobs, _fenced(rows))


def release(session: Executor, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """Give these attempts' jobs back unfinished, runnable at once by any worker.

    For a worker shutting down with work it will not finish. The attempt is not charged
    against the job (``max_attempts`` grows by one); a job whose cancel was requested ends
    ``cancelled`` instead. Returns the attempts that had already lost their job.
    """
    if not jobs:
        return []
    table = job_table_of(_one_model(jobs))
    rows = RELEASE.tuples(session, table, _fence_params(jobs))
    return _lost(jobs, _fenced(rows))
