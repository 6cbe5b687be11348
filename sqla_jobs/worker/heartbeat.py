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

Each beat also asks, in the same transaction, which held attempts have a cancel request
(:func:`sqla_jobs.queue.cancel_requests`, a plain read that sees lock-held rows too): the
fallback for a cancel notification the worker missed (sent while its listener was
reconnecting, or a worker without LISTEN). So a cancel reaches a handler within about a
second through the notification, and within a third of the lease without it.

The row decides, never the notification: a ``!cancel`` notification only wakes the heartbeat
early (:meth:`Heartbeat.wake`), and the handler is stopped when this read finds the request
in the worker's own table. ``NOTIFY`` needs no privilege and a channel is shared by every
schema's table of that name, so a notification proves nothing; a request written in the row
(by a role that may update the job) is what a cancel is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import Connection

from sqla_jobs.queue import ClaimedJob, cancel_requests, heartbeat
from sqla_jobs.worker.link import Link, as_session
from sqla_jobs.worker.runner import job_extra
from sqla_jobs.worker.state import Attempt, State

__all__ = ["Heartbeat"]

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
        # Set to beat now rather than at the next period: a cancel notification, or the
        # worker finishing (then the loop ends).
        self.woken = threading.Event()

    def wake(self) -> None:
        """Beat now (a cancel notification arrived: the beat reads whether it is real)."""
        self.woken.set()

    def loop(self) -> None:
        try:
            while True:
                self.woken.wait(self.every)
                self.woken.clear()
                if self.finished.is_set():
                    return
                self.beat()
        finally:
            self.link.close()

    def beat(self) -> None:
        held = [a for a in self.state.snapshot() if not a.lost and a.task is not None]
        if not held:
            return
        jobs = [a.job for a in held]
        leases = [a.lease_seconds for a in held]
        sent = time.monotonic()

        running = [a.job for a in held if a.outcome is None and not a.cancel_requested]

        def extend(connection: Connection) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
            session = as_session(connection)
            return heartbeat(session, jobs, lease=leases), cancel_requests(session, running)

        try:
            refused, cancels = self.link.transaction(extend)
        except Exception as exc:
            self.on_database_error("heartbeat", exc)
            return
        self.on_database_ok()
        for job in cancels:
            self.on_cancel_requested((job.id, job.attempt))
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
