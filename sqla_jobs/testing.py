"""Helpers for your own tests: what did this transaction enqueue?

They read through your session, so they see the jobs your code added in the test's
transaction, flushed or not, and work with the usual fixture that rolls the whole test back::

    def test_checkout_sends_a_receipt(session):
        checkout(session, order_id=7)
        assert_enqueued(session, EmailJob, task="send_receipt", args={"order": 7})

:func:`run_inline` runs the enqueued jobs inside the test's own transaction, with the
registry's handlers, and records their outcomes without committing anything::

    def test_checkout_sends_a_receipt_for_real(session):
        checkout(session, order_id=7)
        (run,) = run_inline(session, registry)
        assert run.status is JobStatus.SUCCEEDED
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from sqlalchemy.orm import Session

from sqla_jobs._queries.enqueueing import enqueued_jobs
from sqla_jobs.context import JobContext
from sqla_jobs.errors import ConfigurationError, InvalidJobError, LeaseLostError
from sqla_jobs.queue import ClaimedJob, claim, complete_attempts, fail
from sqla_jobs.registry import Registry
from sqla_jobs.schema import JobMixin, JobStatus

__all__ = ["InlineRun", "assert_enqueued", "assert_not_enqueued", "enqueued", "run_inline"]

#: The worker name the inline runner claims under (``leased_by`` of the jobs it runs).
INLINE_WORKER: Final = "inline"

_Job = TypeVar("_Job", bound=JobMixin)


def enqueued(
    session: Session,
    model: type[_Job],
    *,
    task: str | None = None,
    queue: str | None = None,
    args: Mapping[str, Any] | None = None,
    status: JobStatus | str = JobStatus.PENDING,
) -> list[_Job]:
    """The jobs of ``model`` in ``status`` (default pending) visible to ``session``,
    oldest first, filtered by ``task``, ``queue`` and ``args`` (a subset match: every given
    key must be present with an equal value). Flushes the session first."""
    session.flush()
    return enqueued_jobs(
        session,
        model,
        status=JobStatus(status).value,
        task=task,
        queue=queue,
        args=None if args is None else dict(args),
    )


def assert_enqueued(
    session: Session,
    model: type[_Job],
    *,
    task: str | None = None,
    queue: str | None = None,
    args: Mapping[str, Any] | None = None,
    count: int | None = None,
) -> list[_Job]:
    """Assert that at least one (or exactly ``count``) matching pending job exists; return
    them. The failure message lists what was enqueued instead."""
    found = enqueued(session, model, task=task, queue=queue, args=args)
    if (count is None and not found) or (count is not None and len(found) != count):
        everything = enqueued(session, model)
        wanted = {k: v for k, v in (("task", task), ("queue", queue), ("args", args)) if v}
        raise AssertionError(
            f"expected {count if count is not None else 'at least one'} pending "
            f"{model.__name__} matching {wanted}, found {len(found)}; pending: "
            f"{[(job.task, job.queue, job.args) for job in everything]}"
        )
    return found


def assert_not_enqueued(
    session: Session,
    model: type[_Job],
    *,
    task: str | None = None,
    queue: str | None = None,
    args: Mapping[str, Any] | None = None,
) -> None:
    """Assert that no matching pending job exists."""
    assert_enqueued(session, model, task=task, queue=queue, args=args, count=0)


@dataclass(frozen=True, slots=True)
class InlineRun:
    """One job that :func:`run_inline` ran: what its handler returned or raised, and the
    status it left the job in (``succeeded``; ``pending`` for a failure that will retry
    later; ``dead``; ``cancelled`` never, nothing cancels it here)."""

    job: ClaimedJob
    status: JobStatus
    result: Any = None
    error: BaseException | None = None

    @property
    def job_id(self) -> int:
        return self.job.id

    @property
    def task(self) -> str:
        return self.job.task


def run_inline(
    session: Session,
    registry: Registry,
    *,
    queues: str | Iterable[str] | None = None,
    limit: int = 1000,
) -> list[InlineRun]:
    """Run the registry's runnable jobs inside ``session``'s transaction; return what ran.

    For your tests: it claims the jobs your code enqueued in the test's transaction (flushed
    or not; committed ones too) in ``session`` itself, runs each with the registry's handler
    and a :class:`~sqla_jobs.JobContext` whose ``session`` is ``session`` (for lease-mode
    tasks as well as lock-mode ones), and records the outcome with the queue's own
    :func:`~sqla_jobs.complete` (storing the result in the registry's ``result_model``) or
    :func:`~sqla_jobs.fail` (with the task's retry policy: a failed job is pending again
    later, or dead). It never commits: the usual fixture that rolls the test back leaves
    nothing behind. Each job runs in a savepoint, so a handler that raises leaves none of
    its writes, as in lock mode. Jobs the handlers enqueue run too, in claim order, until
    no job is runnable or ``limit`` jobs ran; a retry waits for its backoff, so it does
    not run again here.

    ``queues`` defaults to the registry's queues. A coroutine handler runs on an event loop
    of its own (call this from synchronous test code); it gets ``ctx.session`` too, not
    ``ctx.async_session``. Leases and heartbeats play no part, and nothing is cancelled.

    Example, with the ``session`` fixture of docs/how-to/testing.md::

        def test_checkout_charges_the_order(session):
            checkout(session, order_id=7)
            runs = run_inline(session, registry)
            assert [(run.task, run.status) for run in runs] == [("charge", JobStatus.SUCCEEDED)]
            assert session.get(Payment, 7) is not None  # the handler's write, not committed
    """
    given: object = limit
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise InvalidJobError("limit", f"must be an integer >= 1, got {given!r}")
    checked: object = registry
    if not isinstance(checked, Registry):
        raise ConfigurationError(f"run_inline needs a Registry, not {checked!r}")
    model = registry.model
    names = registry.queues if queues is None else queues
    session.flush()
    runs: list[InlineRun] = []
    while len(runs) < limit:
        jobs = claim(session, model, queues=names, limit=1, worker=INLINE_WORKER)
        if not jobs:
            break
        runs.append(_run_one(session, registry, jobs[0]))
    return runs


def _run_one(session: Session, registry: Registry, job: ClaimedJob) -> InlineRun:
    task = registry.get(job.task)
    if task is None:
        error = LookupError(f"unknown task {job.task!r}: not registered in {registry!r}")
        outcome = fail(session, job, error, retry=False)
        return InlineRun(job, outcome.status, error=error)
    ctx = JobContext(job, INLINE_WORKER, session)
    savepoint = session.begin_nested()
    try:
        result = task.function(ctx)
        if result is not None and inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        session.flush()
    except Exception as exc:
        savepoint.rollback()
        outcome = fail(session, job, exc, policy=task.retry)
        return InlineRun(job, outcome.status, error=exc)
    savepoint.commit()
    result_model = registry.result_model
    stored = result is not None and result_model is not None
    lost, cancelled = complete_attempts(
        session,
        [job],
        results=[result] if stored else None,
        result_model=result_model if stored else None,
    )
    if lost:  # the handler changed the job row itself
        raise LeaseLostError(f"job {job.id}: its handler changed its row; it was not completed")
    status = JobStatus.CANCELLED if cancelled else JobStatus.SUCCEEDED
    return InlineRun(job, status, result=result)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
