"""The outcome writer: commits settled attempts' outcomes, in batches, on a kept connection.

A busy worker completes in batches (whatever settled while the last commit ran, plus
whatever settles within a millisecond or so while handlers keep finishing), an idle one at
once. Every write is fenced by the attempt: one whose lease ran out and was taken over
changes nothing and is logged as ``lease_lost``.

Poison outcomes. An outcome the database refuses for what it is, not for the database's
state (a result a trigger or constraint of the user's rejects, a value the driver cannot
send), must not hold the others back. When a batch fails with anything but a transient
error, it is split in halves and each half written on its own, down to the one outcome
that fails; that job is then failed with a readable error instead (so it is retried, and
ends dead after ``max_attempts``). If even that cannot be written, the outcome is given up:
the attempt is no longer held or heartbeated, and its lease runs out like a crashed
worker's. Transient errors (the server gone, a lock timeout) retry the whole batch with
backoff.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

from sqlalchemy import Connection

from sqla_jobs._queries.variant import tables_of
from sqla_jobs.errors import LeaseLostError
from sqla_jobs.events import describe
from sqla_jobs.observer import NO_OBSERVER, Finish, Observer
from sqla_jobs.policy import RetryPolicy
from sqla_jobs.queue import ClaimedJob, cancel_attempts, complete_attempts, fail, release
from sqla_jobs.queue.outcomes import snooze, store_progress
from sqla_jobs.registry import Registry
from sqla_jobs.schema import JobStatus
from sqla_jobs.worker.link import Link, as_session, is_transient
from sqla_jobs.worker.settling import job_extra
from sqla_jobs.worker.state import WRITE_BATCH, Attempt, Kind, State

__all__ = ["OutcomeWriter"]

logger = logging.getLogger("sqla_jobs.worker")

GATHER: Final = 0.001


class OutcomeWriter:
    """Writes what :class:`~sqla_jobs.worker.state.State` queues; see the module docstring."""

    def __init__(
        self,
        state: State,
        registry: Registry,
        link: Link,
        *,
        finished: threading.Event,
        on_database_error: Callable[[str, Exception], float],
        on_database_ok: Callable[[], None],
        observer: Observer = NO_OBSERVER,
    ) -> None:
        self.state = state
        self.registry = registry
        self.observer = observer
        self.link = link
        self.finished = finished
        self.on_database_error = on_database_error
        self.on_database_ok = on_database_ok
        # A finished job with an ordering key may free its key for the next job, and one of
        # a limited queue a slot of its queue, which no NOTIFY announces: with keyed jobs or
        # queue limits, every written batch wakes the fetch loop.
        self.wake_after_write = registry.ordering_keys or bool(registry.queue_limits)

    def loop(self) -> None:
        """Until the worker has finished and nothing is left to write."""
        try:
            while True:
                batch = self.state.take_outcomes(WRITE_BATCH, GATHER, timeout=0.2)
                if not batch:
                    if self.finished.is_set():
                        return
                    continue
                while not self._write_or_split(batch):
                    if self.finished.is_set():
                        return  # the database is down at exit: leases run out instead
        finally:
            self.link.close()

    def _write_or_split(self, batch: Sequence[Attempt]) -> bool:
        """Write ``batch``; False after a transient error (the caller retries it all)."""
        try:
            self._write(batch)
        except Exception as exc:
            if is_transient(exc):
                self.finished.wait(self.on_database_error("recording outcomes", exc))
                return False
            if len(batch) == 1:
                return self._write_instead(batch[0], exc)
            middle = len(batch) // 2
            return self._write_or_split(batch[:middle]) and self._write_or_split(batch[middle:])
        self.on_database_ok()
        return True

    def _write(self, batch: Sequence[Attempt]) -> None:
        by_kind: dict[Kind, list[Attempt]] = {}
        for attempt in batch:
            assert attempt.outcome is not None
            kind = attempt.outcome.kind
            if kind in by_kind:
                by_kind[kind].append(attempt)
            else:
                by_kind[kind] = [attempt]
        lost: set[tuple[int, int]] = set()
        statuses: dict[tuple[int, int], JobStatus] = {}
        if any(kind.writes for kind in by_kind):
            lost, statuses = self.link.transaction(lambda c: self._statements(c, by_kind))
        # An attempt is logged as cancelled when its outcome was a cancel, or when the
        # database made its completion or failure a cancel (a request the worker had not
        # heard of yet).
        self.state.written(batch)
        if self.wake_after_write:
            self.state.wake()
        if (
            len(by_kind) == 1
            and Kind.COMPLETE in by_kind
            and not (lost or statuses or logger.isEnabledFor(logging.DEBUG))
            and self.observer is NO_OBSERVER
        ):
            return  # the common case: all succeeded, nothing to log or report
        self._log(batch, lost, statuses)

    def _statements(
        self, connection: Connection, by_kind: dict[Kind, list[Attempt]]
    ) -> tuple[set[tuple[int, int]], dict[tuple[int, int], JobStatus]]:
        session = as_session(connection)
        lost: list[ClaimedJob] = []
        statuses: dict[tuple[int, int], JobStatus] = {}
        # Progress reported since the last heartbeat: stored before the outcomes, so that a
        # finished job keeps its handler's last report (a moment's work for batches without).
        # Not marked stored here: a batch tried again (a transient error, a split) stores it
        # again, and once the outcome is written nothing else does (the fence refuses it).
        reported = [
            (a.job, p)
            for attempts in by_kind.values()
            for a in attempts
            if a.progress is not None and (p := a.unstored_progress) is not None
        ]
        if reported:
            store_progress(session, reported)
        completed = by_kind.get(Kind.COMPLETE, [])
        jobs = [a.job for a in completed]
        result_model = self.registry.result_model
        history = bool(jobs) and tables_of(jobs[0].model).keeps_results
        results = (
            [a.outcome.result if a.outcome is not None else None for a in completed]
            if history or result_model is not None
            else []
        )
        cancelled: list[ClaimedJob] = []
        batches: list[tuple[list[ClaimedJob], list[Any] | None]]
        if history:
            # A model with history keeps results in its history rows, in one statement.
            batches = [(jobs, results)]
        elif result_model is None or all(result is None for result in results):
            batches = [(jobs, None)]
        else:
            pairs = list(zip(completed, results, strict=True))
            stored = [(a.job, result) for a, result in pairs if result is not None]
            batches = [
                ([a.job for a, result in pairs if result is None], None),
                ([job for job, _ in stored], [result for _, result in stored]),
            ]
        for jobs, values in batches:
            lost_now, cancelled_now = complete_attempts(
                session, jobs, results=values, result_model=result_model if values else None
            )
            lost += lost_now
            cancelled += cancelled_now
        for job in cancelled:
            statuses[(job.id, job.attempt)] = JobStatus.CANCELLED
        cancels = by_kind.get(Kind.CANCEL, [])
        if cancels:
            lost += cancel_attempts(session, [a.job for a in cancels])
        for attempt in sorted(by_kind.get(Kind.FAIL, []), key=lambda a: a.job.id):
            outcome = attempt.outcome
            assert outcome is not None
            try:
                statuses[attempt.key] = fail(
                    session,
                    attempt.job,
                    outcome.error,
                    retry=outcome.retry,
                    policy=self._policy(attempt),
                ).status
            except LeaseLostError:  # fenced out; nothing changed
                lost.append(attempt.job)
        for attempt in sorted(by_kind.get(Kind.SNOOZE, []), key=lambda a: a.job.id):
            outcome = attempt.outcome
            assert outcome is not None
            try:
                statuses[attempt.key] = snooze(
                    session, attempt.job, outcome.result, policy=self._policy(attempt)
                )
            except LeaseLostError:  # fenced out; nothing changed
                lost.append(attempt.job)
        released = by_kind.get(Kind.RELEASE, [])
        if released:
            lost += release(session, [a.job for a in released])
        return {(job.id, job.attempt) for job in lost}, statuses

    def _policy(self, attempt: Attempt) -> RetryPolicy:
        task = attempt.task
        return task.retry if task is not None else self.registry.default_retry

    def _write_instead(self, attempt: Attempt, exc: Exception) -> bool:
        """The database refused this one outcome: fail the job with a readable error
        instead; if even that is refused, give the outcome up."""
        assert attempt.outcome is not None
        error = (
            f"the {attempt.outcome.kind.value} outcome of attempt {attempt.job.attempt} could "
            f"not be stored: {type(exc).__name__}: {describe(exc)}"
        )
        logger.error(
            "job %d: %s", attempt.job.id, error, extra=job_extra(attempt, "outcome_refused")
        )
        try:
            status = self.link.transaction(
                lambda c: fail(as_session(c), attempt.job, error, policy=self._policy(attempt))
            ).status
        except LeaseLostError:
            status = None
        except Exception as second:
            if is_transient(second):
                self.finished.wait(self.on_database_error("recording outcomes", second))
                return False
            logger.error(
                "job %d: its failure could not be stored either (%s); the outcome is given up "
                "and the job runs again when its lease ends",
                attempt.job.id,
                describe(second),
                extra=job_extra(attempt, "outcome_dropped", error=describe(second)),
            )
            self.state.written([attempt])
            return True
        self.state.written([attempt])
        if status is None:
            _log_lost(attempt, "its failure was fenced out")
            self._report(attempt, "lost")
        else:
            _log_failure(attempt, status, error)
            self._report(attempt, "dead" if status is JobStatus.DEAD else "failed")
        return True

    def _report(self, attempt: Attempt, how: Finish) -> None:
        started = attempt.started_at
        handler_seconds = attempt.settled_at - started if started else None
        self.observer.finished(attempt.job, how, handler_seconds)

    def _log(
        self,
        batch: Sequence[Attempt],
        lost: set[tuple[int, int]],
        statuses: dict[tuple[int, int], JobStatus],
    ) -> None:
        debug = logger.isEnabledFor(logging.DEBUG)
        report = self.observer is not NO_OBSERVER
        released: dict[str, list[int]] = {}
        for attempt in batch:
            outcome = attempt.outcome
            assert outcome is not None
            kind = outcome.kind
            how: Finish
            if kind is Kind.COMPLETE and not lost and not statuses:  # the common case
                if debug:
                    logger.debug("job succeeded", extra=job_extra(attempt, "job_succeeded"))
                if report:
                    self._report(attempt, "succeeded")
                continue
            if attempt.key in lost or kind is Kind.LOST:
                _log_lost(attempt, outcome.why or f"its {kind.value} was fenced out")
                how = "lost"
            elif kind is Kind.CANCEL or statuses.get(attempt.key) is JobStatus.CANCELLED:
                logger.info(
                    "job %d (%s) is cancelled (attempt %d)",
                    attempt.job.id,
                    attempt.job.task,
                    attempt.job.attempt,
                    extra=job_extra(attempt, "job_cancelled"),
                )
                how = "cancelled"
            elif kind is Kind.FAIL:
                error = outcome.error
                text = describe(error) if isinstance(error, BaseException) else error
                status = statuses[attempt.key]
                if outcome.action == "job_failed":
                    _log_failure(attempt, status, text)
                how = "dead" if status is JobStatus.DEAD else "failed"
            elif kind is Kind.RELEASE:
                released.setdefault(outcome.why, []).append(attempt.job.id)
                how = "released"
            elif kind is Kind.SNOOZE:
                status = statuses[attempt.key]
                if status is JobStatus.PENDING:
                    logger.info(
                        "job %d (%s) snoozed for %g seconds (attempt %d not spent)",
                        attempt.job.id,
                        attempt.job.task,
                        outcome.result.total_seconds(),
                        attempt.job.attempt,
                        extra=job_extra(attempt, "job_snoozed"),
                    )
                    how = "snoozed"
                else:  # it had snoozed too often: failed instead (snooze says why)
                    _log_failure(attempt, status, "it snoozed too often")
                    how = "dead" if status is JobStatus.DEAD else "failed"
            else:
                if debug:
                    logger.debug("job succeeded", extra=job_extra(attempt, "job_succeeded"))
                how = "succeeded"
            self._report(attempt, how)
        for why, job_ids in released.items():
            logger.info(
                "gave back %d jobs: %s",
                len(job_ids),
                why,
                extra={
                    "action": "jobs_released",
                    "count": len(job_ids),
                    "job_ids": job_ids,
                    "reason": why,
                },
            )


def _log_lost(attempt: Attempt, what: str) -> None:
    if attempt.lost:
        return  # the heartbeat said so already
    attempt.lost = True
    job = attempt.job
    logger.warning(
        "job %d attempt %d lost its lease (another attempt owns the job); %s",
        job.id,
        job.attempt,
        what,
        extra=job_extra(attempt, "lease_lost"),
    )


def _log_failure(attempt: Attempt, status: JobStatus, text: str) -> None:
    job = attempt.job
    if status is JobStatus.DEAD:
        logger.error(
            "job %d (%s) failed on attempt %d of %d and is dead: %s",
            job.id,
            job.task,
            job.attempt,
            job.max_attempts,
            text,
            extra=job_extra(attempt, "job_dead", error=text),
        )
    else:
        logger.warning(
            "job %d (%s) failed on attempt %d of %d, will retry: %s",
            job.id,
            job.task,
            job.attempt,
            job.max_attempts,
            text,
            extra=job_extra(attempt, "job_failed", error=text),
        )
