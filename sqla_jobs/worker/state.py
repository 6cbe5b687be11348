"""What the worker's threads share: the attempts it holds, its slots, the outcomes to write.

The rule this module exists for: **every claimed attempt reaches exactly one outcome**
(complete, fail, cancel, release, lost, or committed by its own lock-mode transaction). It
lives in one place, :meth:`State.settle`: the first outcome given for an attempt is kept, any
later one is refused. The handler path settles every attempt it starts in a ``finally``
(:mod:`sqla_jobs.worker.runner`), and shutdown settles whatever is still unsettled as a
release through the same method, so a handler that finishes after the worker gave its job
back changes nothing.

A cancel (:func:`sqla_jobs.cancel` of a running job) is one more outcome, fixed here too:
once the worker has heard of the request (:meth:`State.request_cancel`), whatever the
handler ends with (it returned, it raised, it was cancelled) is settled as ``cancel``, and
an attempt whose handler has not started yet is settled as ``cancel`` at once.

An attempt's life here::

    admit()  ->  held, busy (a slot taken, or a place in the fetch loop's prefetch)
    start()  ->  its handler may start (refused once its outcome is fixed)
    settle() ->  outcome fixed, slot free, queued for the outcome writer
    written()->  no longer held (its outcome is committed, or given up): no more heartbeats

Backpressure. A settled attempt frees its slot at once, but stays held until its outcome is
written; the fetch loop claims nothing while :data:`UNWRITTEN_MAX` or more settled outcomes
wait for the writer (:meth:`State.wait_for_room`). So a writer that falls behind (a slow
disk, a lock wait) slows the claims down to its pace instead of letting held attempts pile
up: the memory they take, the heartbeat that extends all their leases in one statement, and
their leases, which run out while their outcomes wait, all stay bounded.

Locking rules
    One lock, :attr:`State.lock`, guards every mutable field of :class:`State` and the
    ``outcome``, ``settled_at``, ``started_at`` and ``cancel_requested`` fields of every
    :class:`Attempt`. It is held only for bookkeeping: never across database calls, handler
    calls or logging, and no other lock is taken while it is held. Two conditions share it:
    ``changed`` (a slot freed, a wake-up arrived, the worker is stopping: the fetch loop
    waits on it) and ``outcomes_ready`` (the outcome writer waits on it). Fields of an
    attempt outside that list are written by one thread only, as noted on each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from sqla_jobs.errors import JobTimeoutError
from sqla_jobs.queue import ClaimedJob
from sqla_jobs.registry import Task

__all__ = ["UNWRITTEN_MAX", "WRITE_BATCH", "Attempt", "Kind", "Outcome", "State"]

#: The most outcomes the outcome writer takes to write in one transaction.
WRITE_BATCH: Final = 1000
#: The most settled outcomes that may wait for the outcome writer before the fetch loop
#: stops claiming: two of the writer's batches, one being written and one gathering.
UNWRITTEN_MAX: Final = 2 * WRITE_BATCH


class Kind(enum.Enum):
    """What became of an attempt."""

    COMPLETE = "complete"  # the handler returned: mark the job succeeded (with its result)
    FAIL = "fail"  # the handler raised (or could not run): retry later, or dead
    CANCEL = "cancel"  # its cancel was requested: mark the job cancelled
    RELEASE = "release"  # not run to the end: give the job back, the attempt not charged
    LOST = "lost"  # another attempt owns the job: nothing to write
    COMMITTED = "committed"  # a lock-mode handler's transaction completed it: nothing to write
    SNOOZE = "snooze"  # the handler asked to run again later (Snooze): pending, no attempt spent

    # Members are singletons that compare by identity: hash them by identity too, in C.
    # (Enum's own __hash__ is Python code, and kinds are hashed for every job written.)
    __hash__ = object.__hash__

    @property
    def writes(self) -> bool:
        """Whether an outcome of this kind takes a statement to write."""
        return self in _WRITES


_WRITES = frozenset((Kind.COMPLETE, Kind.FAIL, Kind.CANCEL, Kind.RELEASE, Kind.SNOOZE))
#: The outcomes a cancel requested turns into a cancel: whatever the handler did.
_HANDLER_ENDS = frozenset((Kind.COMPLETE, Kind.FAIL, Kind.SNOOZE))


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: Kind
    result: Any = None  # COMPLETE: the handler's result; SNOOZE: the delay (a timedelta)
    error: str | BaseException = ""
    retry: bool = True
    # The log action of a failure: job_failed (logged when written), or an action already
    # logged when it was decided (unknown_task, attempts_exhausted, ...).
    action: str = "job_failed"
    why: str = ""  # for LOST and RELEASE: said in the log

    @property
    def writes(self) -> bool:
        return self.kind.writes


@dataclass(eq=False, slots=True)
class Attempt:
    """One claimed attempt held by this worker."""

    job: ClaimedJob
    task: Task[Any] | None
    claimed_at: float  # monotonic: when the claim that made it was sent
    # Monotonic time before which the database's lease surely still holds: measured from
    # when the claim (or the last heartbeat) was *sent*, so it never overestimates the
    # lease, and no wall clock is compared with the database's. Written by the fetch loop
    # at admission and by the heartbeat afterwards.
    lease_deadline: float
    outcome: Outcome | None = None  # under State.lock, by State.settle only
    settled_at: float = 0.0  # under State.lock
    started_at: float = 0.0  # under State.lock, by State.start
    lost: bool = False  # by the heartbeat: its lease was taken over; no more heartbeats
    # By the handler thread: (backend pid, transaction start) of a lock-mode attempt's open
    # transaction, so that shutdown can end that transaction and nothing else.
    backend: tuple[int, float] | None = None
    # By the handler thread: the future of a coroutine handler, cancelled at shutdown.
    future: concurrent.futures.Future[Any] | None = None
    # Under State.lock, by State.request_cancel only (read without it: a bool, set once):
    # the job's cancel was requested. JobContext.cancelled reads it.
    cancel_requested: bool = False
    # By the event loop's thread: the asyncio task awaiting a coroutine handler, which a
    # cancel request cancels.
    aio_task: asyncio.Task[Any] | None = None
    # Under State.lock, by State.time_out only (read without it, like cancel_requested): the
    # attempt ran past its time limit. JobContext.cancelled reads it.
    timed_out: bool = False
    # Monotonic: when its handler must have ended (its time limit from its start), or 0.0
    # for none. Under State.lock, by State.start.
    deadline: float = 0.0
    # By the handler thread (JobContext.report_progress): the latest progress it reported,
    # and by the heartbeat or the outcome writer: the last one they stored (the same object
    # once stored). A lock-mode handler's progress is written through its own transaction.
    progress: dict[str, Any] | None = None
    progress_stored: dict[str, Any] | None = None
    progress_at: float = 0.0  # monotonic: when a lock-mode handler's progress was written
    # Under State.lock: settled at its time limit while its handler still runs, which keeps
    # its slot (State.busy) until it returns (State.settle releases it then).
    overrun: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.job.id, self.job.attempt)

    @property
    def lease_seconds(self) -> float:
        task = self.task
        return task.lease.total_seconds() if task is not None else 0.0

    @property
    def unstored_progress(self) -> dict[str, Any] | None:
        """The progress its lease-mode handler reported since the last one stored, or None."""
        progress = self.progress
        if progress is None or progress is self.progress_stored:
            return None
        task = self.task
        return progress if task is not None and task.mode == "lease" else None

    @property
    def time_limit(self) -> float:
        """Seconds its handler may run: the job's own limit, else its task's; 0.0 for none."""
        limit = self.job.time_limit
        if limit is None:
            task = self.task
            limit = None if task is None else task.time_limit
        return 0.0 if limit is None else limit.total_seconds()


_CANCELLED = Outcome(Kind.CANCEL, why="its cancel was requested")


@dataclass
class State:
    """The bookkeeping every worker thread shares; see the module docstring for its rules."""

    concurrency: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: dict[tuple[int, int], Attempt] = field(default_factory=dict)
    # Admitted attempts not yet settled: running, or waiting for a handler thread (a
    # prefetched attempt, claimed ahead of a free slot: see the fetch loop).
    busy: int = 0
    settled_count: int = 0  # attempts settled so far (the fetch loop's measure of the rate)
    outcomes: list[Attempt] = field(default_factory=list)  # settled, not yet taken to write
    woken: bool = False  # a notification (or the listener's reconnection) since the last claim
    accepting: bool = True  # False once shutdown took over the unsettled attempts
    # What the waiting threads wait for, so that settle() wakes them only when it happened
    # (a wake-up per job costs more than a quick job): the count of busy attempts the fetch
    # loop waits to fall to (-1: it is not waiting for room), and whether the writer waits
    # for a first outcome.
    busy_wanted: int = -1
    writer_waiting: bool = False
    fetch_waits_for_writer: bool = False  # the fetch loop waits for written() (backpressure)
    # Started attempts with a time limit, not settled and not yet past it, by key (at most
    # the running attempts: settle() takes each out), and the earliest of their deadlines
    # the time-limit watcher waits for (inf: none).
    limited: dict[tuple[int, int], Attempt] = field(default_factory=dict)
    next_deadline: float = math.inf
    # Attempts settled at their time limit whose handlers still run, by key.
    overrunning: dict[tuple[int, int], Attempt] = field(default_factory=dict)
    closed: bool = False  # the worker has stopped: the time limits are no longer watched

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)
        self.outcomes_ready = threading.Condition(self.lock)
        self.deadline_added = threading.Condition(self.lock)

    # -- the fetch loop's side ----------------------------------------------------------

    def admit(self, attempts: list[Attempt]) -> bool:
        """Hold newly claimed attempts, each busy until settled. False (and nothing held)
        once shutdown has begun giving attempts back: the caller releases them itself."""
        with self.lock:
            if not self.accepting:
                return False
            held = self.held
            for attempt in attempts:
                held[attempt.key] = attempt
            self.busy += len(attempts)
            return True

    def free_slots(self) -> int:
        with self.lock:
            return self.concurrency - self.busy

    def _behind(self) -> bool:
        # Settled attempts still held: their outcomes wait for (or are being written by) the
        # outcome writer.
        return len(self.held) - self.busy >= UNWRITTEN_MAX

    def wait_for_room(self, capacity: int, at_least: int, gather: float, timeout: float) -> int:
        """Wait until fewer than ``capacity`` attempts are busy (``timeout`` at most), then
        up to ``gather`` seconds more while fewer than ``at_least`` places are free and
        handlers are running: one claim for many jobs costs less than one claim each.
        Returns the free places (``capacity`` less the busy attempts). ``capacity`` is the
        concurrency plus the prefetch the fetch loop allows itself. While the outcome writer
        is behind (see the module docstring), waits for it first: 0 if it still is after
        ``timeout``."""
        with self.lock:
            if self._behind():
                self.fetch_waits_for_writer = True
                try:
                    if not self.changed.wait_for(lambda: not self._behind(), timeout):
                        return 0
                finally:
                    self.fetch_waits_for_writer = False
            try:
                if self.busy >= capacity:
                    self.busy_wanted = capacity - 1
                    self.changed.wait_for(lambda: self.busy < capacity, timeout)
                free = capacity - self.busy
                if 0 < free < at_least and self.busy:
                    self.busy_wanted = capacity - at_least
                    self.changed.wait_for(lambda: capacity - self.busy >= at_least, gather)
                    free = capacity - self.busy
                return free
            finally:
                self.busy_wanted = -1

    def settled(self) -> int:
        """How many attempts were settled so far."""
        with self.lock:
            return self.settled_count

    def wait_for_wakeup(self, timeout: float) -> None:
        """Wait for a notification, a stop or ``timeout``; forget the notification."""
        with self.lock:
            if not self.woken:
                self.changed.wait(timeout)
            self.woken = False

    def wake(self) -> None:
        """A job may be waiting (a NOTIFY, the listener reconnected, a stop): claim now."""
        with self.lock:
            self.woken = True
            self.changed.notify_all()

    # -- the one outcome per attempt ----------------------------------------------------

    def settle(self, attempt: Attempt, outcome: Outcome) -> bool:
        """Fix ``attempt``'s outcome, free its slot and queue it for the outcome writer.

        The first outcome wins; a later one is refused (returns False) and changes
        nothing: this is where "exactly one outcome per attempt" holds. Once the attempt's
        cancel was requested, a completion or a failure is settled as a cancel: the job
        ends cancelled whatever its handler did (the statements hold the same rule for a
        request the worker has not heard of yet).
        """
        with self.lock:
            if attempt.outcome is not None:
                if attempt.overrun:  # its handler, settled at its time limit, has returned
                    attempt.overrun = False
                    del self.overrunning[attempt.key]
                    self._free_slot()
                return False
            if attempt.cancel_requested and outcome.kind in _HANDLER_ENDS:
                outcome = _CANCELLED
            attempt.outcome = outcome
            attempt.settled_at = time.monotonic()
            if attempt.deadline:
                self.limited.pop(attempt.key, None)
            self.settled_count += 1
            self.outcomes.append(attempt)
            if self.writer_waiting:
                self.outcomes_ready.notify()
            self._free_slot()
            return True

    def _free_slot(self) -> None:
        # Under self.lock.
        self.busy -= 1
        if self.busy == self.busy_wanted:  # once, as it falls to what the loop waits for
            self.changed.notify_all()

    def time_out(self, now: float) -> list[Attempt]:
        """Wait for the next time limit to pass (or the worker to stop), then end the
        attempts whose limits have passed: each is marked ``timed_out`` (its handler sees
        ``ctx.cancelled``), and a lease-mode one is settled as a failure with a
        :class:`~sqla_jobs.errors.JobTimeoutError` at once, keeping its slot until its
        handler returns (``overrun``). A lock-mode one is left to end with its handler,
        whose transaction holds the job's row: its result is refused then
        (:meth:`Runner.returned <sqla_jobs.worker.runner.Runner.returned>`). Returns the
        attempts that ran past their limits (the caller cancels their coroutines)."""
        with self.lock:
            if not self.closed:
                wait = self.next_deadline - now
                if wait > 0:
                    self.deadline_added.wait(None if wait == math.inf else wait)
            due = time.monotonic()
            late = [a for a in self.limited.values() if a.deadline <= due]
            for attempt in late:
                del self.limited[attempt.key]
                attempt.timed_out = True
            self.next_deadline = min((a.deadline for a in self.limited.values()), default=math.inf)
        for attempt in late:
            task = attempt.task
            if task is not None and task.mode == "lock":
                continue
            limit = attempt.time_limit
            error = JobTimeoutError(
                f"job {attempt.job.id} attempt {attempt.job.attempt} ran past its time limit "
                f"of {limit:g} seconds"
            )
            with self.lock:
                # Its slot stays taken until its handler returns (settle() frees it then).
                if attempt.outcome is None:
                    attempt.overrun = True
                    self.overrunning[attempt.key] = attempt
                    self.busy += 1
            # A failure like any other (the writer logs job_failed or job_dead when it is
            # written); the watcher logs job_timed_out as the limit passes.
            if not self.settle(attempt, Outcome(Kind.FAIL, error=error)):
                with self.lock:  # it ended meanwhile: no overrun after all
                    if attempt.overrun:
                        attempt.overrun = False
                        del self.overrunning[attempt.key]
                        self._free_slot()
        return late

    def overruns(self) -> list[tuple[int, float]]:
        """``(job id, seconds since its time limit)`` of each handler still running past
        its limit (its attempt settled already): for health and metrics."""
        now = time.monotonic()
        with self.lock:
            return [(a.job.id, now - a.deadline) for a in self.overrunning.values()]

    def close(self) -> None:
        """The worker has stopped: wake the time-limit watcher to end."""
        with self.lock:
            self.closed = True
            self.deadline_added.notify_all()

    def request_cancel(self, key: tuple[int, int]) -> Attempt | None:
        """The job's cancel was requested: mark the attempt so that its handler can see it
        and its outcome is a cancel; settle it as a cancel at once if its handler has not
        started. Returns the attempt when its handler is running (the caller cancels a
        coroutine), None otherwise (unknown here, settled already, or settled now)."""
        with self.lock:
            attempt = self.held.get(key)
            if attempt is None or attempt.outcome is not None or attempt.cancel_requested:
                return None
            attempt.cancel_requested = True
            if attempt.started_at:
                return attempt
        self.settle(attempt, _CANCELLED)
        return None

    def start(self, attempt: Attempt) -> bool:
        """Mark the attempt's handler as starting; False when its outcome is fixed already
        (shutdown gave it back while it waited for a thread): then it must not start."""
        limit = attempt.time_limit
        with self.lock:
            if attempt.outcome is not None:
                return False
            attempt.started_at = now = time.monotonic()
            if limit:
                attempt.deadline = deadline = now + limit
                self.limited[attempt.key] = attempt
                if deadline < self.next_deadline:  # the earliest now: the watcher waits for it
                    self.next_deadline = deadline
                    self.deadline_added.notify()
            return True

    def abandon(self, why: str) -> list[Attempt]:
        """Shutdown: stop admitting, and settle every unsettled attempt as a release.
        Returns the attempts so settled (their handlers may still be running)."""
        with self.lock:
            self.accepting = False
            unsettled = [a for a in self.held.values() if a.outcome is None]
        released = Outcome(Kind.RELEASE, why=why)
        return [attempt for attempt in unsettled if self.settle(attempt, released)]

    # -- the outcome writer's side ------------------------------------------------------

    def take_outcomes(self, limit: int, gather: float, timeout: float) -> list[Attempt]:
        """The next outcomes to write: waits ``timeout`` at most for a first one, then, while
        handlers are still running and more keep arriving, ``gather`` seconds at a time for
        more (a commit costs more than the wait, and quick jobs finish within it)."""
        with self.lock:
            if not self.outcomes:
                self.writer_waiting = True
                try:
                    self.outcomes_ready.wait(timeout)
                finally:
                    self.writer_waiting = False
            seen = 0
            while seen < len(self.outcomes) < limit and self.busy:
                seen = len(self.outcomes)
                self.outcomes_ready.wait(gather)  # not woken by settle(): a plain pause
            taken, self.outcomes = self.outcomes[:limit], self.outcomes[limit:]
            return taken

    def written(self, attempts: Iterable[Attempt]) -> None:
        """These attempts' outcomes are committed (or given up): no longer held."""
        with self.lock:
            held = self.held
            for attempt in attempts:
                job = attempt.job
                key = (job.id, job.attempt)
                if held.get(key) is attempt:
                    del held[key]
            if self.fetch_waits_for_writer and not self._behind():
                self.changed.notify_all()

    # -- the heartbeat's and the supervisor's side --------------------------------------

    def snapshot(self) -> list[Attempt]:
        """The attempts held right now."""
        with self.lock:
            return list(self.held.values())

    def unwritten(self) -> int:
        with self.lock:
            return len(self.outcomes)
