"""The fetch loop: claims jobs for free slots and hands them to the handler threads.

One claim per round, in a short transaction of its own that commits (the attempt is
counted, the lease starts): up to as many jobs as there are free slots plus the prefetch,
at most ``batch_size``. When a claim comes back short, the loop waits for a NOTIFY from an
enqueuer's commit (:mod:`sqla_jobs.worker.listener`), for the listener to reconnect, or for
the poll interval, whichever comes first: polling is the source of truth. After a database
error it waits out a backoff, cut short when the listener reconnects (the server is back).

The claim's lease is the shortest of the tasks its queues serve; jobs of tasks with a longer
lease get theirs extended in the same transaction, so every attempt starts with its own
task's lease.

Prefetch. With a backlog, the loop claims ahead of its free slots: the jobs beyond them wait
in the runner's queue for a handler thread, so that the next claim is in flight while the
handlers run the last one's jobs, and neither the database nor the handlers wait for the
other. By default the prefetch follows the handlers' rate: the jobs they settle, at the rate
they settled over the last ``RATE_WINDOW``, in ``PREFETCH_HORIZON`` (50 ms) or in
``PREFETCH_COVER`` claim round trips if those take longer, at most one batch
(``batch_size``): :func:`default_prefetch`. So a prefetched job waits about 50 ms at most
for a handler, whatever the jobs' speed: quick jobs never wait for a claim and are claimed
in large batches (handlers settling 20,000 jobs/s prefetch a batch, whatever the
concurrency), slow ones are not hoarded (handlers settling 10 jobs/s prefetch none).
``prefetch=N`` fixes it instead (0: claim for free slots only). A prefetched job's lease
runs while it waits: the heartbeat extends it like any held attempt's, and the runner gives
it back unstarted if it ran out all the same (:data:`sqla_jobs.worker.runner.LEASE_MARGIN`).
Shutdown gives back prefetched jobs as it does every attempt not started (released, not
charged).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from sqlalchemy import Connection

from sqla_jobs.observer import NO_OBSERVER, Observer
from sqla_jobs.queue import ClaimedJob, heartbeat, release
from sqla_jobs.queue.claiming import claim_waiting
from sqla_jobs.registry import Registry
from sqla_jobs.schema import JobMixin
from sqla_jobs.worker.link import Link, as_session
from sqla_jobs.worker.runner import Runner
from sqla_jobs.worker.state import Attempt, State

__all__ = ["Fetcher", "default_prefetch"]

logger = logging.getLogger("sqla_jobs.worker")

#: How long a claim may wait for more slots to free when only a few are (seconds).
GATHER: Final = 0.002
#: Jobs claimed between two looks at the table's dead rows (:func:`sqla_jobs.vacuum`).
VACUUM_EVERY: Final = 5_000
#: The default prefetch holds the jobs the handlers settle in this many claim round trips,
PREFETCH_COVER: Final = 2.0
#: or in this long (seconds), whichever is longer: about the longest a prefetched job waits
#: for a handler. (Two round trips alone, a few milliseconds, made the claims of a worker of
#: concurrency 4 small, and its drain of no-op jobs half as fast as with prefetch=500.)
PREFETCH_HORIZON: Final = 0.05
#: How long the handlers' rate is measured over (seconds).
RATE_WINDOW: Final = 0.05
#: How much of a new claim round trip goes into the smoothed one.
SMOOTHING: Final = 0.2


def default_prefetch(rate: float, claim_seconds: float, batch_size: int) -> int:
    """The default prefetch: the jobs handlers settling ``rate`` per second settle in
    :data:`PREFETCH_HORIZON`, or in :data:`PREFETCH_COVER` claim round trips of
    ``claim_seconds`` if those take longer; at most ``batch_size``."""
    covered = max(PREFETCH_HORIZON, PREFETCH_COVER * claim_seconds)
    return min(batch_size, int(rate * covered))


class Fetcher:
    def __init__(
        self,
        state: State,
        runner: Runner,
        registry: Registry,
        link: Link,
        *,
        model: type[JobMixin],
        queues: Sequence[str],
        batch_size: int,
        poll_interval: float,
        worker_name: str,
        stopping: threading.Event,
        on_database_error: Callable[[str, Exception], float],
        on_database_ok: Callable[[], None],
        observer: Observer = NO_OBSERVER,
        prefetch: int | None = None,
    ) -> None:
        self.state = state
        self.runner = runner
        self.observer = observer
        self.registry = registry
        self.link = link
        self.model = model
        self.queues = list(queues)
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.worker_name = worker_name
        self.stopping = stopping
        self.on_database_error = on_database_error
        self.on_database_ok = on_database_ok
        leases = [t.lease.total_seconds() for t in registry.tasks_in(self.queues)]
        self.claim_lease = min(leases or [registry.default_lease.total_seconds()])
        self.keys = registry.ordering_keys  # claim keyed jobs too
        self.queue_limits = registry.queue_limits or None  # None: the plain claim, as ever
        self.rate_limits = registry.rate_limits or None
        self.fair_shares = registry.fair_shares or None
        # When the last claim held a rate-limited queue back: how soon it may allow more.
        self.rate_wait: float | None = None
        self.min_claim = max(1, min(batch_size, state.concurrency) // 2)
        # The prefetch: fixed (``prefetch``), or following the handlers' rate up to a batch.
        self.prefetch_fixed = prefetch
        self.rate = 0.0  # attempts settled per second over the last window
        self.rate_mark = (time.monotonic(), 0)  # the window's start: when, settled then
        self.claim_seconds = 0.0  # a claim's round trip, smoothed
        # Each task's lease in seconds, looked up once per task, not once per job.
        self.leases: dict[str, float] = {}
        self.beat = time.monotonic()  # when the loop last went round (for health)
        # Jobs claimed since the vacuum role was last woken (see lifecycle's "vacuum").
        self.claimed_since_vacuum = 0
        self.vacuum_due = threading.Event()

    def loop(self) -> None:
        backlog = False
        try:
            while not self.stopping.is_set():
                self.beat = time.monotonic()
                # With a backlog (the last claim came back full), a claim for many slots
                # costs less than one per slot: wait a moment for a few to free. Without
                # one, claim at once: a job just enqueued should not wait.
                at_least = self.min_claim if backlog else 1
                capacity = self.state.concurrency + self.prefetch()
                free = self.state.wait_for_room(capacity, at_least, GATHER, self.poll_interval)
                if free <= 0 or self.stopping.is_set():
                    continue
                limit = min(free, self.batch_size)
                sent = time.monotonic()
                try:
                    jobs = self.link.transaction(functools.partial(self._claim, limit=limit))
                except Exception as exc:
                    delay = self.on_database_error("claim", exc)
                    self.state.wait_for_wakeup(delay)
                    continue
                self.on_database_ok()
                took = time.monotonic() - sent
                self.observer.claimed(jobs, took)
                if jobs:
                    self.claim_seconds += SMOOTHING * (took - self.claim_seconds)
                    self._hand_out(jobs, sent)
                    self.claimed_since_vacuum += len(jobs)
                    if self.claimed_since_vacuum >= VACUUM_EVERY:
                        self.claimed_since_vacuum = 0
                        self.vacuum_due.set()
                backlog = len(jobs) == limit
                if not backlog:
                    # A rate-limited queue held back: claim again when its window allows
                    # more, not at the next poll.
                    wait = self.poll_interval
                    if self.rate_wait is not None:
                        wait = min(wait, self.rate_wait)
                    self.state.wait_for_wakeup(wait)
        finally:
            self.link.close()
            self.beat = time.monotonic()

    def prefetch(self) -> int:
        """How many jobs this round may claim beyond the free slots (module docstring)."""
        if self.prefetch_fixed is not None:
            return self.prefetch_fixed
        now = time.monotonic()
        start, settled_then = self.rate_mark
        if now - start >= RATE_WINDOW:
            settled = self.state.settled()
            self.rate = (settled - settled_then) / (now - start)
            self.rate_mark = (now, settled)
        return default_prefetch(self.rate, self.claim_seconds, self.batch_size)

    def _claim(self, connection: Connection, limit: int) -> list[ClaimedJob]:
        session = as_session(connection)
        jobs, self.rate_wait = claim_waiting(
            session,
            self.model,
            queues=self.queues,
            limit=limit,
            lease=self.claim_lease,
            worker=self.worker_name,
            keys=self.keys,
            queue_limits=self.queue_limits,
            rate_limits=self.rate_limits,
            fair_shares=self.fair_shares,
        )
        # Looked up per task, not per job: a batch holds few tasks.
        longer = {
            name: lease
            for name in {job.task for job in jobs}
            if (lease := self._lease(name)) > self.claim_lease
        }
        if longer:
            extend = [job for job in jobs if job.task in longer]
            heartbeat(session, extend, lease=[longer[job.task] for job in extend])
        if jobs and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "claimed %d jobs",
                len(jobs),
                extra={
                    "action": "job_claimed",
                    "count": len(jobs),
                    "job_ids": [j.id for j in jobs],
                },
            )
        return jobs

    def _lease(self, name: str) -> float:
        lease = self.leases.get(name)
        if lease is None:
            task = self.registry.get(name)
            lease = task.lease.total_seconds() if task is not None else self.claim_lease
            self.leases[name] = lease
        return lease

    def _hand_out(self, jobs: list[ClaimedJob], sent: float) -> None:
        # Each task and lease deadline looked up once per task in the batch, not per job.
        names = {job.task for job in jobs}
        task_of = {name: self.registry.get(name) for name in names}
        deadline_of = {name: sent + self._lease(name) for name in names}
        attempts = [Attempt(job, task_of[job.task], sent, deadline_of[job.task]) for job in jobs]
        if self.state.admit(attempts):
            self.runner.submit(attempts)
            return
        # The worker is shutting down and took over its unsettled attempts already: these
        # came back from a claim that was still running. Give them back here.
        try:
            self.link.transaction(lambda c: release(as_session(c), jobs))
        except Exception as exc:
            self.on_database_error("releasing a late claim", exc)
            return
        logger.info(
            "gave back %d jobs claimed while the worker was stopping",
            len(jobs),
            extra={"action": "jobs_released", "count": len(jobs), "job_ids": [j.id for j in jobs]},
        )
