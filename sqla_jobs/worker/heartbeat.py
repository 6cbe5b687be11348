"""The heartbeat: extends the leases of the attempts the worker holds.

Every third of the shortest lease in play, one statement extends every held attempt's lease
to its task's lease from now, in database time (:func:`sqla_jobs.queue.heartbeat`): those
whose handler runs, and those whose outcome waits to be written. An attempt stops being
heartbeated when its outcome is written or given up (it is then no longer held), or when a
heartbeat finds that another attempt took its job over (``lease_lost``: its handler's work
will be fenced out).

The statement skips rows that another transaction holds instead of waiting for them (a
lock-mode handler's own transaction, an outcome being written), so it cannot deadlock with
the outcome writer; a lock-mode attempt's row lock keeps other claims away meanwhile, and
an attempt whose outcome is being written is no longer at risk. Only a lease-mode attempt
whose handler still runs is taken for lost when its lease was not extended.

Progress. The latest progress each lease-mode handler reported since the last beat
(:meth:`JobContext.report_progress <sqla_jobs.JobContext.report_progress>`) is stored in
the same transaction, in one statement that skips locked rows like the lease's
(:func:`sqla_jobs.queue.outcomes.store_progress`); the outcome writer stores what is left
with the attempt's outcome.

Cancels. The heartbeat is the one place where the worker learns that a held attempt's
cancel was requested: only from the job's row in its own table
(:func:`sqla_jobs.queue.cancel_requests`, a plain read, fenced by attempt, that sees
lock-held rows too), never from a notification alone. A ``!cancel:<id>:<attempt>``
notification is a hint (any role that can connect may send one, and the channel is shared
by tables of the same name in other schemas): :meth:`Heartbeat.hint` wakes this thread,
which reads the rows of the hinted attempts it holds at once, and stops only those whose
row says so. Each beat also reads the rows of every running attempt: the fallback for a
notification the worker missed (sent while its listener was reconnecting, or a worker
without LISTEN). So a cancel reaches a handler within a round trip of the notification,
and within a third of the lease without it. The cancelled outcome itself is written only
for a row with a cancel request (:func:`sqla_jobs._queries.cancel_attempts`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection

from sqla_jobs.queue import ClaimedJob, cancel_requests, heartbeat
from sqla_jobs.queue.outcomes import store_progress
from sqla_jobs.worker.link import Link, as_session
from sqla_jobs.worker.settling import job_extra
from sqla_jobs.worker.state import Attempt, State

__all__ = ["Heartbeat"]

_T = TypeVar("_T")

logger = logging.getLogger("sqla_jobs.worker")


class Heartbeat:
    def __init__(
        self,
        state: State,
        link: Link,
        *,
        every: float,
        finished: threading.Event,
        on_database_error: Callable[[str, Exception], float],
        on_database_ok: Callable[[], None],
        on_cancel_requested: Callable[[tuple[int, int]], None] = lambda key: None,
    ) -> None:
        self.on_cancel_requested = on_cancel_requested
        self.state = state
        self.link = link
        self.every = every
        self.finished = finished
        self.on_database_error = on_database_error
        self.on_database_ok = on_database_ok

        # Attempts named by cancel notifications, not read yet (under _hint_lock).
        self._hinted: set[tuple[int, int]] = set()
        self._hint_lock = threading.Lock()
        self._wake = threading.Event()  # a hint, or the end (wake())

    def hint(self, key: tuple[int, int]) -> None:
        """A notification says attempt ``key``'s cancel was requested: read its row now (on
        this thread, not the caller's). Cheap for an attempt this worker does not hold."""
        with self._hint_lock:
            self._hinted.add(key)
        self._wake.set()

    def wake(self) -> None:
        """Wake the loop (to see that ``finished`` is set)."""
        self._wake.set()

    def loop(self) -> None:
        try:
            next_beat = time.monotonic() + self.every
            while not self.finished.is_set():
                if self._wake.wait(max(0.0, next_beat - time.monotonic())):
                    self._wake.clear()
                    if self.finished.is_set():
                        break
                    self.confirm_cancels()
                if time.monotonic() >= next_beat:
                    self.beat()
                    next_beat = time.monotonic() + self.every
        finally:
            self.link.close()

    def confirm_cancels(self) -> None:
        """Read the rows of the hinted attempts this worker holds and runs; stop those whose
        cancel was requested (see the module docstring)."""
        with self._hint_lock:
            hinted, self._hinted = self._hinted, set()
        running = [
            a.job
            for a in self.state.snapshot()
            if a.key in hinted and a.outcome is None and not a.cancel_requested and not a.lost
        ]
        if not running:
            return
        # After a database error, the next beat reads every running attempt's row anyway.
        cancels = self._transaction(lambda c: cancel_requests(as_session(c), running))
        self._cancel(cancels or [])

    def _transaction(self, work: Callable[[Connection], _T]) -> _T | None:
        """``work`` in a transaction on the heartbeat's connection; None after a database
        error (reported to the role's watch: the next beat tries again)."""
        try:
            result = self.link.transaction(work)
        except Exception as exc:
            self.on_database_error("heartbeat", exc)
            return None
        self.on_database_ok()
        return result

    def _cancel(self, cancels: list[ClaimedJob]) -> None:
        for job in cancels:
            self.on_cancel_requested((job.id, job.attempt))

    def beat(self) -> None:
        held = [a for a in self.state.snapshot() if not a.lost and a.task is not None]
        if not held:
            return
        jobs = [a.job for a in held]
        leases = [a.lease_seconds for a in held]
        sent = time.monotonic()

        running = [a.job for a in held if a.outcome is None and not a.cancel_requested]
        # The progress lease-mode handlers reported since the last beat, stored with it.
        reported = [(a, p) for a in held if (p := a.unstored_progress) is not None]

        def extend(connection: Connection) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
            session = as_session(connection)
            refused = heartbeat(session, jobs, lease=leases)
            store_progress(session, [(a.job, progress) for a, progress in reported])
            return refused, cancel_requests(session, running)

        read = self._transaction(extend)
        if read is None:
            return
        for attempt, progress in reported:
            attempt.progress_stored = progress  # or skipped (locked, lost): not tried again
        refused, cancels = read
        self._cancel(cancels)
        refused_keys = {(job.id, job.attempt) for job in refused}
        for attempt in held:
            if attempt.key not in refused_keys:
                attempt.lease_deadline = sent + attempt.lease_seconds
            elif _taken_over(attempt):
                attempt.lost = True
                logger.warning(
                    "job %d attempt %d lost its lease (another attempt owns the job); its "
                    "handler's outcome will change nothing",
                    attempt.job.id,
                    attempt.job.attempt,
                    extra=job_extra(attempt, "lease_lost"),
                )


def _taken_over(attempt: Attempt) -> bool:
    # A lease-mode attempt whose handler still runs holds no row lock, so a refused
    # heartbeat means another attempt owns the job. Anything else was merely skipped.
    task = attempt.task
    return task is not None and task.mode == "lease" and attempt.outcome is None
