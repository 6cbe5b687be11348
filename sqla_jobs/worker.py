"""The worker: claims jobs, runs their handlers, records what happened.

::

    worker = Worker(registry, engine, queues=["email"], concurrency=8)
    worker.run()          # blocks; SIGTERM/SIGINT stop it gracefully, a second one at once

Or from the command line: ``sqla-jobs worker myapp.tasks:registry --queues email``.

How a job goes through it
    A **fetch loop** claims up to as many jobs as there are free slots, in one short
    transaction that commits (the attempt is counted, the lease starts). It waits for a
    NOTIFY from the enqueuer's commit (:mod:`sqla_jobs.notifier`) or for the poll interval,
    whichever comes first; polling is the source of truth. Plain functions run on a pool of
    ``concurrency`` threads, coroutines on one event loop thread; ``concurrency`` bounds the
    jobs in flight either way. A claimed batch wakes one handler thread, which runs its jobs
    one after another (quick jobs cost no thread switch each); jobs that have waited a few
    milliseconds behind a slow one are handed to more threads. The fetch loop, the outcome
    writer and the heartbeat each keep one pool connection and run Core transactions on it.

    **Lease mode.** A heartbeat thread extends the leases of the jobs in flight every third
    of the shortest lease. Completions go to an **outcome writer** thread that commits
    whatever has accumulated in one transaction (``complete_many``; failures with
    ``fail``), so a busy worker completes in batches and an idle one at once. Every outcome
    is fenced by the attempt: one whose lease ran out and was taken over changes nothing and
    is logged as ``lease_lost``.

    **Lock mode.** The handler thread opens a transaction, locks the job's row (fenced),
    runs the handler with that transaction's session, completes the job in it and commits:
    the handler's writes and the completion commit together, or not at all. If the handler
    raises, the transaction rolls back and the failure is recorded by the outcome writer.
    Lock-held jobs are not heartbeated; their row lock keeps every other claim away.

    A job whose task the registry does not know is made dead with a clear ``last_error``
    (kept for inspection, ``sqla-jobs retry`` brings it back). A job claimed past its
    ``max_attempts`` (its earlier attempts died with their worker) is made dead without
    running, so a job that kills its worker does not loop forever.

Shutdown
    The first SIGTERM or SIGINT (or :meth:`Worker.stop`) stops the claiming; running jobs
    get ``grace`` seconds to finish. The jobs still running then are given back
    (``release``: runnable at once, the attempt not charged) after the worker has terminated
    its own lock-mode transactions, and :meth:`Worker.run` returns 0. A second signal exits
    the process at once with status 128 + the signal number; its jobs come back when their
    leases run out.

Faults
    Every thread catches and logs its errors and keeps going; database errors are retried
    with exponential backoff (``database_error``, then ``database_recovered``). A thread
    that dies of a bug anyway is logged (``thread_crashed``) and restarted. The fetch loop's
    progress is watched: :meth:`Worker.health` and :meth:`Worker.is_healthy` report it, a
    stuck loop is logged (``fetch_loop_stuck``), and ``health_file`` is touched every second
    while the worker is healthy, for a liveness probe.

The events the worker logs are listed in :mod:`sqla_jobs.events`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final, Literal, cast

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from sqla_jobs import statements, validation
from sqla_jobs.backoff import Backoff
from sqla_jobs.errors import ConfigurationError, InvalidJobError, LeaseLostError
from sqla_jobs.events import describe
from sqla_jobs.notifier import Notifier
from sqla_jobs.queue import (
    MAX_CLAIM_LIMIT,
    ClaimedJob,
    claim,
    complete_many,
    default_worker_name,
    fail,
    heartbeat,
    lock,
    release,
)
from sqla_jobs.registry import JobContext, Registry, Task
from sqla_jobs.schema import JobStatus

__all__ = ["Worker", "WorkerHealth"]

logger = logging.getLogger(__name__)

_SUPERVISE_EVERY: Final = 0.1
_HEALTH_FILE_EVERY: Final = 1.0
_STUCK_LOG_EVERY: Final = 10.0
_RELEASE_LOCK_TIMEOUT: Final = "5s"
_MAX_OUTCOME_BATCH: Final = 1000
_OUTCOME_GATHER: Final = 0.001
_SPILL_AFTER: Final = 0.002
_CLAIM_GATHER: Final = 0.005
# How long a completion may wait for the fetch loop's next claim before the outcome writer
# commits it on its own (a claim that waits on a lock must not hold completions back).
_HANDOFF_WAIT: Final = 0.05


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    """A snapshot of the worker's liveness.

    ``healthy`` means every runtime thread is alive and the fetch loop went round within
    ``stuck_after`` seconds. ``database_ok`` is whether the last database call succeeded: a
    worker waiting out a database outage is alive (restarting it would not help), but not
    doing work.
    """

    healthy: bool
    fetch_loop_age: float
    database_ok: bool
    listening: bool
    in_flight: int
    dead_threads: tuple[str, ...]


@dataclass(eq=False)
class _Attempt:
    """One claimed attempt in flight in this worker."""

    job: ClaimedJob
    task: Task[Any] | None
    lost: bool = False
    ended: bool = False  # its outcome is committed
    # Backend pid of the lock-mode transaction holding the row, while it is open.
    lock_pid: int | None = None
    future: concurrent.futures.Future[Any] | None = None
    queued_at: float = 0.0  # when it was queued for a handler thread
    posted: bool = False  # its handler is done: its outcome waits to be written


@dataclass(eq=False)
class _Outcome:
    attempt: _Attempt
    kind: Literal["complete", "fail", "release"]
    result: Any = None
    error: str | BaseException = ""
    retry: bool = True
    action: str = "job_failed"
    posted_at: float = 0.0
    # Written by the outcome writer only (a combined claim transaction with it failed).
    writer_only: bool = False


@dataclass
class _Thread:
    name: str
    target: Callable[[], None]
    thread: threading.Thread | None = field(default=None)


class _Link:
    """A pool connection that one runtime thread keeps from one transaction to the next.

    A checkout from the pool and an ORM Session around it cost more CPU than the claim or
    completion statement they carry, so the fetch loop, the outcome writer and the heartbeat
    keep a Core connection of their own instead. After any error it goes back to the pool
    (which finds a broken one by its reset, or by ``pool_pre_ping`` at the next checkout)
    and the next transaction takes another.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.connection: Connection | None = None

    def connect(self) -> Connection:
        connection = self.connection
        if connection is None or connection.closed or connection.invalidated:
            self.close()
            connection = self.connection = self.engine.connect()
        return connection

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """One transaction on the kept connection: committed, or rolled back on an error."""
        connection = self.connect()
        try:
            with connection.begin():
                yield connection
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            try:
                connection.close()
            except Exception as exc:  # a broken connection: the pool discards it
                logger.debug(
                    "closing a connection failed: %s",
                    describe(exc),
                    extra={"action": "database_error"},
                )


def _core(connection: Connection) -> Session:
    # The queue functions the worker runs on its own connections (a lease-mode claim,
    # complete_many, fail, heartbeat, release, lock) only call ``execute``, which a Core
    # Connection has with the same signature; no ORM Session is needed around them.
    return cast(Session, connection)


def _job_extra(job: ClaimedJob, action: str, **more: Any) -> dict[str, Any]:
    return {
        "action": action,
        "job_id": job.id,
        "task": job.task,
        "queue": job.queue,
        "attempt": job.attempt,
        **more,
    }


class Worker:
    """Runs the jobs of ``registry`` from ``queues`` (default: every queue it has tasks in).

    ``engine`` must be a PostgreSQL engine (psycopg 3) whose pool holds at least
    ``concurrency + 3`` connections (one per lock-mode handler, the fetch loop, the outcome
    writer, the heartbeat), plus one for the listener; ``pool_pre_ping=True`` makes the
    first statement after a server restart succeed instead of failing once.

    ``poll_interval`` is the longest time a runnable job waits for an idle worker when no
    notification arrives (a delayed job starts within one interval of its ``run_at``);
    ``batch_size`` caps one claim (default: ``concurrency``); ``grace`` is how long running
    jobs may finish after a stop is asked for; ``listen=False`` turns LISTEN/NOTIFY off.
    """

    def __init__(
        self,
        registry: Registry,
        engine: Engine,
        *,
        queues: Iterable[str] | None = None,
        concurrency: int = 4,
        batch_size: int | None = None,
        poll_interval: float = 1.0,
        grace: float = 30.0,
        listen: bool = True,
        name: str | None = None,
        stuck_after: float | None = None,
        health_file: str | os.PathLike[str] | None = None,
        handle_signals: bool = True,
    ) -> None:
        if not isinstance(registry, Registry):
            raise ConfigurationError(f"expected a sqla_jobs Registry, not {registry!r}")
        if not _positive_int(concurrency):
            raise ConfigurationError(f"concurrency must be a positive integer, not {concurrency!r}")
        if batch_size is not None and not 1 <= batch_size <= MAX_CLAIM_LIMIT:
            raise ConfigurationError(f"batch_size must be in [1, {MAX_CLAIM_LIMIT}]")
        for label, value in (("poll_interval", poll_interval), ("grace", grace)):
            if not value >= 0:
                raise ConfigurationError(f"{label} must not be negative, got {value!r}")
        self.registry = registry
        self.engine = engine
        self.model = registry.model
        self.queues = [
            validation.check_name("queues", queue)
            for queue in dict.fromkeys(queues or registry.queues)
        ]
        if not self.queues:
            raise ConfigurationError("a worker needs at least one queue")
        self.concurrency = concurrency
        self.batch_size = batch_size or concurrency
        self._min_claim = max(1, min(self.batch_size, concurrency) // 2)
        self.poll_interval = max(poll_interval, 0.01)
        self.grace = grace
        self.listen = listen
        self.name = name or default_worker_name()
        self.stuck_after = stuck_after or max(30.0, 3 * self.poll_interval)
        self.health_file = Path(health_file) if health_file is not None else None
        self.handle_signals = handle_signals

        tasks = registry.tasks_in(self.queues)
        leases = [task.lease for task in tasks] or [registry.default_lease]
        # The claim's lease is the shortest of the tasks that may come out of these queues;
        # jobs of longer-lease tasks get theirs extended in the claim's own transaction.
        self._claim_lease = min(leases).total_seconds()
        self._heartbeat_every = max(0.05, self._claim_lease / 3)
        self._needs_loop = any(task.is_async for task in tasks)
        self._table = self.model.__table__  # type: ignore[attr-defined]

        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._notified = False
        self._in_flight: dict[tuple[int, int], _Attempt] = {}
        # Outcomes waiting to be written (under self._lock). Successful ones are taken by the
        # fetch loop into its next claim's transaction when it is about to claim, the rest
        # (and those, when it is not) by the outcome writer.
        self._pending: list[_Outcome] = []
        self._settling = 0  # attempts in _in_flight whose outcome is posted, not yet written
        self._fetch_will_claim = False
        self._outcome_ready = threading.Condition(self._lock)
        # Jobs waiting for a handler thread. A batch is added at once and wakes one idle
        # handler, which passes the wake-up on while jobs remain: quick jobs are run by the
        # few threads that come back first, slow ones each get a thread of their own.
        self._work: deque[_Attempt] = deque()
        self._work_ready = threading.Condition(threading.Lock())
        self._idle_handlers = 0
        self._handlers_stop = False

        self._stop_requested = False
        self._stop_signal: int | None = None
        self._signals = 0
        self._stopping = threading.Event()  # no more claims
        self._finished = threading.Event()  # grace over: background loops end
        self._fetch_beat = time.monotonic()
        self._database_ok = True
        self._last_stuck_log = 0.0
        self._threads: list[_Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notifier: Notifier | None = None
        self._running = False

    # -- public -------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped; return the exit status (0 after a graceful stop)."""
        if self._running:
            raise ConfigurationError("this worker is already running")
        self._running = True
        previous = self._install_signal_handlers()
        try:
            self._start()
            last_health_write = 0.0
            while not self._stop_requested:
                time.sleep(_SUPERVISE_EVERY)
                self._supervise()
                now = time.monotonic()
                if now - last_health_write >= _HEALTH_FILE_EVERY:
                    self._write_health_file()
                    last_health_write = now
            return self._shutdown()
        finally:
            self._restore_signal_handlers(previous)

    def stop(self, *, graceful: bool = True) -> None:
        """Ask a running worker to stop (from any thread): like SIGTERM, or with
        ``graceful=False`` without the grace period (running jobs are released at once)."""
        if not graceful:
            self.grace = 0.0
        self._stop_requested = True

    def health(self) -> WorkerHealth:
        """The worker's liveness; see :class:`WorkerHealth`."""
        age = time.monotonic() - self._fetch_beat
        dead = tuple(t.name for t in self._threads if t.thread is None or not t.thread.is_alive())
        if self._notifier is not None and not self._notifier.is_alive():
            dead += ("notifier",)
        with self._lock:
            in_flight = len(self._in_flight)
        return WorkerHealth(
            healthy=self._running and not dead and age < self.stuck_after,
            fetch_loop_age=age,
            database_ok=self._database_ok,
            listening=self._notifier is not None and self._notifier.connected,
            in_flight=in_flight,
            dead_threads=dead,
        )

    def is_healthy(self) -> bool:
        """Whether every runtime thread is alive and the fetch loop is going round."""
        return self.health().healthy

    # -- start, supervise, stop ---------------------------------------------------------

    def _start(self) -> None:
        self._threads = [
            _Thread("fetch", self._fetch_loop),
            _Thread("outcomes", self._outcome_loop),
            _Thread("heartbeat", self._heartbeat_loop),
        ]
        self._threads += [
            _Thread(f"handler-{n}", self._handler_loop) for n in range(self.concurrency)
        ]
        if self._needs_loop:
            self._loop = asyncio.new_event_loop()
            self._threads.append(_Thread("event-loop", self._event_loop))
        for spec in self._threads:
            self._spawn(spec)
        if self.listen:
            self._start_notifier()
        logger.info(
            "worker %s started: queues %s, concurrency %d",
            self.name,
            ",".join(self.queues),
            self.concurrency,
            extra={
                "action": "worker_started",
                "worker": self.name,
                "queues": self.queues,
                "concurrency": self.concurrency,
                "model": self.model.__name__,
            },
        )
        idle = [q for q in self.queues if not self.registry.tasks_in([q])]
        if idle:
            logger.warning(
                "no task of the registry uses queue %s: its jobs will be made dead as unknown",
                ",".join(idle),
                extra={"action": "queue_without_tasks", "queues": idle},
            )

    def _start_notifier(self) -> None:
        self._notifier = Notifier(
            self.engine,
            self._table,
            on_notify=self._on_notify,
            on_connect=self._wake,
            name=f"sqla-jobs-{self.name}-notifier",
        )
        self._notifier.start()

    def _spawn(self, spec: _Thread) -> None:
        def guarded() -> None:
            try:
                spec.target()
            except BaseException:
                logger.critical(
                    "worker thread %s crashed",
                    spec.name,
                    exc_info=True,
                    extra={"action": "thread_crashed", "thread_name": spec.name},
                )

        spec.thread = threading.Thread(
            target=guarded, name=f"sqla-jobs-{self.name}-{spec.name}", daemon=True
        )
        spec.thread.start()

    def _supervise(self) -> None:
        if not self._stopping.is_set():  # threads end on purpose once stopping
            for spec in self._threads:
                if spec.thread is not None and not spec.thread.is_alive():
                    logger.error(
                        "worker thread %s is dead; restarting it",
                        spec.name,
                        extra={"action": "thread_crashed", "thread_name": spec.name},
                    )
                    self._spawn(spec)
            if self._notifier is not None and not self._notifier.is_alive():
                logger.error(
                    "the notifier thread is dead; restarting it",
                    extra={"action": "thread_crashed", "thread_name": "notifier"},
                )
                self._start_notifier()
        age = time.monotonic() - self._fetch_beat
        now = time.monotonic()
        if (
            not self._stopping.is_set()
            and age >= self.stuck_after
            and now - self._last_stuck_log >= _STUCK_LOG_EVERY
        ):
            self._last_stuck_log = now
            logger.error(
                "the fetch loop has not gone round for %.0fs (a claim waiting on a lock, or a "
                "connection that hangs)",
                age,
                extra={"action": "fetch_loop_stuck", "seconds": round(age, 1)},
            )

    def _write_health_file(self) -> None:
        if self.health_file is None or not self.is_healthy():
            return
        try:
            self.health_file.write_text(f"{time.time():.3f}\n")
        except OSError as exc:
            logger.warning(
                "cannot write the health file %s: %s",
                self.health_file,
                describe(exc),
                extra={"action": "health_file_error", "error": describe(exc)},
            )

    def _install_signal_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return previous
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes: only set flags here (taking a lock
        # the interrupted code may hold would deadlock), or leave at once.
        self._signals += 1
        if self._signals > 1:
            # Not through logging: a handler lock held by the interrupted code would deadlock.
            name = signal.Signals(signum).name
            os.write(2, f"sqla-jobs: second {name}: exiting at once\n".encode())
            os._exit(128 + signum)
        self._stop_signal = signum
        self._stop_requested = True

    def _shutdown(self) -> int:
        signum = self._stop_signal
        logger.info(
            "stopping: no more claims; waiting up to %.0fs for %d running jobs",
            self.grace,
            len(self._in_flight),
            extra={
                "action": "worker_stopping",
                "signal": signum,
                "grace": self.grace,
                "in_flight": len(self._in_flight),
            },
        )
        self._stopping.set()
        self._wake()
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            with self._lock:
                if not self._in_flight and self._fetch_idle():
                    break
            time.sleep(0.02)
            self._supervise()
        # The fetch loop saw _stopping: wait for a claim still in progress, whose jobs are
        # in flight once it returns.
        fetch = self._threads[0].thread
        if fetch is not None:
            fetch.join(max(5.0, self.poll_interval))
        self._finished.set()
        for spec in self._threads[1:3]:  # the outcome writer and the heartbeat
            if spec.thread is not None:
                spec.thread.join(5.0)
        with self._lock:
            leftover = list(self._in_flight.values())
        released = self._release(leftover) if leftover else 0
        self._stop_handlers()
        if self._notifier is not None:
            self._notifier.stop()
        logger.info(
            "worker %s stopped; %d unfinished jobs given back",
            self.name,
            released,
            extra={"action": "worker_stopped", "worker": self.name, "released": released},
        )
        self._running = False
        return 0

    def _fetch_idle(self) -> bool:
        fetch = self._threads[0].thread
        return fetch is None or not fetch.is_alive()

    def _stop_handlers(self) -> None:
        with self._work_ready:  # jobs still queued were released with the others
            self._handlers_stop = True
            self._work.clear()
            self._work_ready.notify_all()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_tasks, loop)
        deadline = time.monotonic() + 0.5  # handlers still running are daemon threads
        for spec in self._threads[3:]:
            if spec.thread is not None:
                spec.thread.join(max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.call_soon(loop.stop)

    def _release(self, attempts: Sequence[_Attempt]) -> int:
        """Give back jobs the worker will not finish; returns how many were released."""
        pids = [a.lock_pid for a in attempts if a.lock_pid is not None]
        jobs = [a.job for a in attempts if not a.lost]
        backoff = Backoff(initial=0.1, cap=1.0)
        for _ in range(5):
            try:
                with Session(self.engine) as session, session.begin():
                    if pids:
                        # Our own lock-mode transactions still hold these rows: end them, so
                        # that the release does not wait for handlers that will never finish.
                        session.execute(statements.terminate_backends(), {"pids": pids})
                        session.execute(
                            statements.set_local_lock_timeout(),
                            {"timeout": _RELEASE_LOCK_TIMEOUT},
                        )
                    lost = release(session, jobs) if jobs else []
            except Exception as exc:
                delay = backoff.next_delay()
                logger.warning(
                    "could not release %d jobs (%s); retrying in %.1fs",
                    len(jobs),
                    describe(exc),
                    delay,
                    extra={"action": "database_error", "error": describe(exc), "delay": delay},
                )
                time.sleep(delay)
                continue
            released = len(jobs) - len(lost)
            logger.info(
                "gave back %d unfinished jobs",
                released,
                extra={
                    "action": "jobs_released",
                    "count": released,
                    "job_ids": [job.id for job in jobs],
                },
            )
            return released
        logger.error(
            "could not release %d unfinished jobs; they run again when their leases end",
            len(jobs),
            extra={"action": "database_error", "job_ids": [job.id for job in jobs]},
        )
        return 0

    # -- the fetch loop -----------------------------------------------------------------

    def _on_notify(self, payload: str) -> None:
        if payload in self.queues:
            self._wake()

    def _wake(self) -> None:
        with self._wakeup:
            self._notified = True
            self._wakeup.notify_all()

    def _fetch_loop(self) -> None:
        backoff = Backoff()
        link = _Link(self.engine)
        done: list[_Outcome] = []
        try:
            while not self._stopping.is_set():
                self._fetch_beat = time.monotonic()
                with self._wakeup:
                    # Until it waits for a notification, the loop claims again as soon as
                    # slots free: completions posted meanwhile are left for that claim's
                    # transaction (one commit for both), not written on their own.
                    self._fetch_will_claim = True
                    free = self.concurrency - self._busy()
                    if free <= 0:
                        self._wait(self._slot_free_or_stopping)
                        continue
                    if free < self._min_claim and self._busy():
                        # A few slots free while jobs run: give others a moment to free
                        # too, so that one claim fills many slots instead of one each.
                        self._wakeup.wait_for(self._enough_free_or_stopping, _CLAIM_GATHER)
                        free = self.concurrency - self._busy()
                    # While handlers keep finishing jobs, let them: a commit costs more than
                    # the wait, and a batch of quick jobs finishes within it.
                    while free < self.batch_size and self._busy() and self._pending:
                        self._wakeup.wait(_OUTCOME_GATHER)
                        now_free = self.concurrency - self._busy()
                        if now_free == free or self._stopping.is_set():
                            break
                        free = now_free
                    self._notified = False
                    done = self._take_completions()
                limit = min(free, self.batch_size)
                try:
                    jobs = self._claim(link, limit, done)
                except Exception as exc:
                    self._give_back(done)
                    done = []
                    self._idle_fetch()
                    self._database_failed("claim", exc, backoff, self._stopping)
                    continue
                self._database_recovered(backoff)
                if done:
                    self._done_many([outcome.attempt for outcome in done])
                    done = []
                if jobs:
                    self._dispatch(jobs)
                if len(jobs) == limit:
                    continue  # there may be more right away
                with self._wakeup:
                    self._fetch_will_claim = False
                    self._outcome_ready.notify_all()
                    self._wait(self._notified_or_stopping)
        finally:
            self._give_back(done)
            self._idle_fetch()
            link.close()
        self._fetch_beat = time.monotonic()

    def _busy(self) -> int:
        # Holding self._lock: the attempts whose handler has not finished.
        return len(self._in_flight) - self._settling

    def _idle_fetch(self) -> None:
        with self._wakeup:
            self._fetch_will_claim = False
            self._outcome_ready.notify_all()

    def _take_completions(self) -> list[_Outcome]:
        """Holding self._lock: take the successful outcomes for the next claim's transaction."""
        pending = self._pending
        if not pending:
            return []
        taken: list[_Outcome] = []
        kept: list[_Outcome] = []
        for outcome in pending:
            if (
                outcome.kind == "complete"
                and not outcome.writer_only
                and len(taken) < _MAX_OUTCOME_BATCH
            ):
                taken.append(outcome)
            else:
                kept.append(outcome)
        self._pending = kept
        return taken

    def _give_back(self, outcomes: Sequence[_Outcome]) -> None:
        """Completions whose claim transaction failed (nothing of it happened): the outcome
        writer retries them on their own."""
        if not outcomes:
            return
        with self._wakeup:
            for outcome in outcomes:
                outcome.writer_only = True
            self._pending.extend(outcomes)
            self._outcome_ready.notify_all()

    def _wait(self, predicate: Callable[[], bool]) -> None:
        # Holding self._wakeup: wait until ``predicate`` or the poll interval. While jobs
        # wait for a handler, look every _SPILL_AFTER whether they waited too long.
        deadline = time.monotonic() + self.poll_interval
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if not self._work:  # only this thread adds to it
                self._wakeup.wait(remaining)
                continue
            self._wakeup.wait(min(remaining, _SPILL_AFTER))
            self._spill()

    def _enough_free_or_stopping(self) -> bool:
        free = self.concurrency - self._busy()
        return self._stopping.is_set() or free >= self._min_claim

    def _slot_free_or_stopping(self) -> bool:
        return self._stopping.is_set() or self._busy() < self.concurrency

    def _notified_or_stopping(self) -> bool:
        return self._stopping.is_set() or self._notified

    def _claim(self, link: _Link, limit: int, done: Sequence[_Outcome] = ()) -> list[ClaimedJob]:
        """Claim up to ``limit`` jobs; complete ``done`` first in the same transaction.

        The completions are marked ended only once that transaction has committed; if it
        fails, nothing of it happened and the caller gives them back to be written again.
        """
        if not done:
            return self._claim_in(link, limit, ())
        # Held until the attempts are marked ended (see _write_outcomes).
        with self._commit_lock:
            jobs = self._claim_in(link, limit, done)
            for outcome in done:
                outcome.attempt.ended = True
        return jobs

    def _claim_in(self, link: _Link, limit: int, done: Sequence[_Outcome]) -> list[ClaimedJob]:
        lost: list[ClaimedJob] = []
        with link.begin() as connection:
            session = _core(connection)
            if done:
                lost = self._complete(session, [(o.attempt, o.result) for o in done])
            jobs = claim(
                session,
                self.model,
                queues=self.queues,
                limit=limit,
                lease=self._claim_lease,
                worker=self.name,
            )
            longer: dict[float, list[ClaimedJob]] = {}
            for job in jobs:
                task = self.registry.get(job.task)
                if task is not None and task.mode == "lease":
                    seconds = task.lease.total_seconds()
                    if seconds > self._claim_lease:
                        longer.setdefault(seconds, []).append(job)
            for seconds, group in longer.items():
                heartbeat(session, group, lease=seconds)
        if done:
            self._log_completions(done, lost)
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

    def _dispatch(self, jobs: Sequence[ClaimedJob]) -> None:
        get_task = self.registry.get
        attempts = [_Attempt(job, get_task(job.task)) for job in jobs]
        with self._lock:
            for attempt in attempts:
                self._in_flight[(attempt.job.id, attempt.job.attempt)] = attempt
        runnable: list[_Attempt] = []
        for attempt in attempts:
            job, task = attempt.job, attempt.task
            if task is None:
                known = ", ".join(sorted(t.name for t in self.registry)) or "none"
                message = (
                    f"unknown task {job.task!r}: no handler is registered for it in this "
                    f"worker's registry (known tasks: {known}); the job is kept as dead, retry "
                    "it once a worker knows the task"
                )
                logger.error(message, extra=_job_extra(job, "unknown_task"))
                self._post(
                    _Outcome(attempt, "fail", error=message, retry=False, action="unknown_task")
                )
            elif job.attempt > job.max_attempts:
                message = (
                    f"attempt {job.attempt} exceeds max_attempts {job.max_attempts}: earlier "
                    "attempts ended without an outcome (their worker died or lost the lease); "
                    "not run again"
                )
                logger.error(message, extra=_job_extra(job, "attempts_exhausted"))
                self._post(
                    _Outcome(
                        attempt, "fail", error=message, retry=False, action="attempts_exhausted"
                    )
                )
            elif task.is_async and task.mode == "lease":
                self._run_coroutine(attempt)
            else:
                runnable.append(attempt)
        if runnable:
            now = time.monotonic()
            for attempt in runnable:
                attempt.queued_at = now
            with self._work_ready:
                self._work.extend(runnable)
                if self._idle_handlers:
                    self._work_ready.notify()

    def _database_failed(
        self, what: str, exc: Exception, backoff: Backoff, until: threading.Event
    ) -> None:
        """Log a failed database call and wait out the backoff (or until ``until``)."""
        self._database_ok = False
        delay = backoff.next_delay()
        logger.warning(
            "database error in %s (%s); retrying in %.1fs",
            what,
            describe(exc),
            delay,
            extra={
                "action": "database_error",
                "operation": what,
                "error": describe(exc),
                "delay": round(delay, 3),
                "failures": backoff.failures,
            },
        )
        until.wait(delay)

    def _database_recovered(self, backoff: Backoff) -> None:
        self._database_ok = True
        if backoff.reset():
            logger.info("the database answers again", extra={"action": "database_recovered"})

    # -- running handlers -----------------------------------------------------------------

    def _handler_loop(self) -> None:
        while True:
            attempt = self._next_work()
            if attempt is None:
                return
            try:
                assert attempt.task is not None
                if attempt.task.mode == "lock":
                    self._run_locked(attempt)
                else:
                    self._run_leased(attempt)
            except Exception:  # the run functions catch everything; this is a bug
                logger.critical(
                    "unexpected error running a job",
                    exc_info=True,
                    extra={"action": "thread_crashed"},
                )

    def _next_work(self) -> _Attempt | None:
        """The next queued job, waiting for one; None when the handlers are to stop."""
        with self._work_ready:
            self._idle_handlers += 1
            try:
                while not self._work and not self._handlers_stop:
                    self._work_ready.wait()
            finally:
                self._idle_handlers -= 1
            if self._handlers_stop:
                return None
            return self._work.popleft()

    def _spill(self) -> None:
        """Wake idle handlers for jobs that have waited in the queue too long.

        A batch wakes one handler, which runs its jobs one after another: quick jobs then
        cost no thread switch each. Jobs queued behind a slow one are handed to more
        handlers once the first of them has waited ``_SPILL_AFTER``.
        """
        with self._work_ready:
            work = self._work
            if not work or not self._idle_handlers:
                return
            if time.monotonic() - work[0].queued_at >= _SPILL_AFTER:
                self._work_ready.notify(min(len(work), self._idle_handlers))

    def _event_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            if self._finished.is_set():
                loop.close()

    def _checked(self, result: Any) -> Any:
        # A result jsonb cannot store fails its job here, not the whole batch at commit.
        if self.registry.result_model is not None and result is not None:
            validation.check_json("result", result)
        return result

    def _call(self, task: Task[Any], ctx: JobContext) -> Any:
        if not task.is_async:
            return task.function(ctx)
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(task.function(ctx), self._loop).result()

    def _run_leased(self, attempt: _Attempt) -> None:
        job, task = attempt.job, attempt.task
        assert task is not None
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("job started", extra=_job_extra(job, "job_started"))
        try:
            result = self._checked(task.function(JobContext(job, self.name)))
        except BaseException as exc:
            self._post(_Outcome(attempt, "fail", error=exc))
        else:
            self._post(_Outcome(attempt, "complete", result=result))

    def _run_coroutine(self, attempt: _Attempt) -> None:
        job, task, loop = attempt.job, attempt.task, self._loop
        assert task is not None
        assert loop is not None
        logger.debug("job started", extra=_job_extra(job, "job_started"))
        future = asyncio.run_coroutine_threadsafe(task.function(JobContext(job, self.name)), loop)
        attempt.future = future

        def done(future: concurrent.futures.Future[Any]) -> None:
            if future.cancelled():
                return  # shutdown: the job is released
            error = future.exception()
            if error is None:
                try:
                    result = self._checked(future.result())
                except InvalidJobError as exc:
                    error = exc
                else:
                    self._post(_Outcome(attempt, "complete", result=result))
                    return
            self._post(_Outcome(attempt, "fail", error=error))

        future.add_done_callback(done)

    def _run_locked(self, attempt: _Attempt) -> None:
        job, task = attempt.job, attempt.task
        assert task is not None
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("job started", extra=_job_extra(job, "job_started"))
        committing = False
        try:
            with Session(self.engine) as session:
                transaction = session.begin()
                if not lock(session, [job]):
                    session.rollback()
                    self._lost(attempt, "its lease ran out before the worker could lock it")
                    self._done_many([attempt])
                    return
                attempt.lock_pid = _backend_pid(session.connection())
                try:
                    result = self._checked(self._call(task, JobContext(job, self.name, session)))
                    if session.get_transaction() is not transaction or not transaction.is_active:
                        raise ConfigurationError(
                            "the handler ended the claim's transaction (commit, rollback or "
                            "close); a lock-mode handler must leave it to the worker"
                        )
                except BaseException as exc:
                    attempt.lock_pid = None
                    _rollback_quietly(session)
                    self._post(_Outcome(attempt, "fail", error=exc))
                    return
                lost = self._complete(session, [(attempt, result)])
                committing = True
                session.commit()
                attempt.lock_pid = None
            self._log_completed(attempt, {(j.id, j.attempt) for j in lost})
            self._done_many([attempt])
        except Exception as exc:
            # The database failed under the worker (a lost connection, a restart), not the
            # handler. Give the job back: the release is fenced, so if the commit did go
            # through it changes nothing, and otherwise the job is runnable again at once.
            attempt.lock_pid = None
            self._database_ok = False
            if committing:
                logger.warning(
                    "the commit of lock-mode job %d failed (%s): if it did not go through, the "
                    "job is given back",
                    job.id,
                    describe(exc),
                    extra=_job_extra(job, "outcome_unknown", error=describe(exc)),
                )
            else:
                logger.warning(
                    "database error running lock-mode job %d (%s): nothing of it was "
                    "committed; the job is given back",
                    job.id,
                    describe(exc),
                    extra=_job_extra(job, "database_error", error=describe(exc)),
                )
            self._post(_Outcome(attempt, "release"))

    # -- outcomes -------------------------------------------------------------------------

    def _complete(self, session: Session, done: Sequence[tuple[_Attempt, Any]]) -> list[ClaimedJob]:
        """Complete these attempts in ``session``'s transaction; return the lost ones."""
        result_model = self.registry.result_model
        plain = [a.job for a, result in done if result_model is None or result is None]
        lost = complete_many(session, plain)
        if result_model is not None:
            with_results = [(a.job, result) for a, result in done if result is not None]
            if with_results:
                lost += complete_many(
                    session,
                    [job for job, _ in with_results],
                    results=[result for _, result in with_results],
                    result_model=result_model,
                )
        return lost

    def _post(self, outcome: _Outcome) -> None:
        """A handler is done with its attempt: its slot is free, its outcome to be written."""
        with self._wakeup:
            attempt = outcome.attempt
            key = (attempt.job.id, attempt.job.attempt)
            if not attempt.posted and self._in_flight.get(key) is attempt:
                attempt.posted = True
                self._settling += 1
            outcome.posted_at = time.monotonic()
            self._pending.append(outcome)
            self._wakeup.notify_all()  # a slot is free: the fetch loop
            if outcome.kind != "complete" or not self._fetch_will_claim:
                # (A completion left to the fetch loop wakes the writer only when due.)
                self._outcome_ready.notify()

    def _outcome_loop(self) -> None:
        backoff = Backoff()
        link = _Link(self.engine)
        batch: list[_Outcome] = []
        try:
            while True:
                if not batch:
                    batch = self._next_outcomes()
                    if not batch:
                        return  # finished
                try:
                    self._write_outcomes(link, batch)
                except Exception as exc:
                    if self._finished.is_set():
                        return  # the unwritten ones are still in flight: released at shutdown
                    self._database_failed("recording outcomes", exc, backoff, self._finished)
                    continue
                self._database_recovered(backoff)
                batch = []
        finally:
            link.close()

    def _next_outcomes(self) -> list[_Outcome]:
        """The outcome writer's next batch, waiting for one; empty once the worker finished.

        Successful outcomes are left to the fetch loop while it is about to claim (it commits
        them with its claim), unless they have waited ``_HANDOFF_WAIT`` for it.
        """
        with self._outcome_ready:
            while True:
                batch, wait = self._writer_share()
                if batch:
                    break
                if self._finished.is_set():
                    return []
                self._outcome_ready.wait(min(wait, 0.2))
            # Whatever else is ready joins this transaction: batches grow with load. While
            # other jobs run, their outcomes are given a moment to arrive: a commit costs
            # more than the wait, and a batch of quick jobs finishes within it.
            while len(batch) < _MAX_OUTCOME_BATCH and self._busy():
                self._outcome_ready.wait(_OUTCOME_GATHER)
                more, _ = self._writer_share(_MAX_OUTCOME_BATCH - len(batch))
                if not more:
                    break
                batch += more
            return batch

    def _writer_share(self, room: int = _MAX_OUTCOME_BATCH) -> tuple[list[_Outcome], float]:
        """Holding self._lock: take the outcomes for the writer; and how long until a
        completion left to the fetch loop is due."""
        pending = self._pending
        if not pending:
            return [], 1.0
        if not self._fetch_will_claim or self._stopping.is_set():
            taken, self._pending = pending[:room], pending[room:]
            return taken, 1.0
        due = time.monotonic() - _HANDOFF_WAIT
        taken, kept = [], []
        wait = 1.0
        for outcome in pending:
            if len(taken) < room and (
                outcome.kind != "complete" or outcome.writer_only or outcome.posted_at <= due
            ):
                taken.append(outcome)
            else:
                kept.append(outcome)
                wait = min(wait, outcome.posted_at - due)
        self._pending = kept
        return taken, max(wait, 0.001)

    def _write_outcomes(self, link: _Link, batch: Sequence[_Outcome]) -> None:
        completed = [o for o in batch if o.kind == "complete"]
        failed = [o for o in batch if o.kind == "fail"]
        released = [o for o in batch if o.kind == "release"]
        statuses: list[JobStatus | None] = []
        given_back: list[ClaimedJob] = []
        # Held until the attempts are marked ended, so that a heartbeat that found these jobs
        # finished does not take them for lost leases.
        with self._commit_lock:
            with link.begin() as connection:
                session = _core(connection)
                lost = self._complete(session, [(o.attempt, o.result) for o in completed])
                for outcome in failed:
                    task = outcome.attempt.task
                    policy = task.retry if task is not None else self.registry.default_retry
                    try:
                        status = fail(
                            session,
                            outcome.attempt.job,
                            outcome.error,
                            retry=outcome.retry,
                            policy=policy,
                        ).status
                    except LeaseLostError:  # the fenced UPDATE matched nothing; no harm done
                        status = None
                    statuses.append(status)
                if released:
                    jobs = [o.attempt.job for o in released]
                    kept_back = release(session, jobs)
                    given_back = [job for job in jobs if job not in kept_back]
            for outcome in batch:
                outcome.attempt.ended = True
        self._log_completions(completed, lost)
        for outcome, status in zip(failed, statuses, strict=True):
            self._log_failed(outcome, status)
        if given_back:
            logger.info(
                "gave back %d jobs after database errors",
                len(given_back),
                extra={
                    "action": "jobs_released",
                    "count": len(given_back),
                    "job_ids": [job.id for job in given_back],
                },
            )
        self._done_many([outcome.attempt for outcome in batch])

    def _log_completions(self, completed: Sequence[_Outcome], lost: Sequence[ClaimedJob]) -> None:
        if lost:
            lost_keys = {(job.id, job.attempt) for job in lost}
            for outcome in completed:
                self._log_completed(outcome.attempt, lost_keys)
        elif logger.isEnabledFor(logging.DEBUG):
            for outcome in completed:
                logger.debug(
                    "job succeeded", extra=_job_extra(outcome.attempt.job, "job_succeeded")
                )

    def _log_completed(self, attempt: _Attempt, lost_keys: set[tuple[int, int]]) -> None:
        job = attempt.job
        if (job.id, job.attempt) in lost_keys:
            self._lost(attempt, "its completion was dropped")
        else:
            logger.debug("job succeeded", extra=_job_extra(job, "job_succeeded"))

    def _log_failed(self, outcome: _Outcome, status: JobStatus | None) -> None:
        job = outcome.attempt.job
        error = outcome.error
        text = describe(error) if isinstance(error, BaseException) else error
        if status is None:
            self._lost(outcome.attempt, "its failure was dropped")
        elif outcome.action != "job_failed":
            pass  # unknown task or exhausted attempts: logged when claimed
        elif status is JobStatus.DEAD:
            logger.error(
                "job %d (%s) failed on attempt %d of %d and is dead: %s",
                job.id,
                job.task,
                job.attempt,
                job.max_attempts,
                text,
                extra=_job_extra(job, "job_dead", error=text),
            )
        else:
            logger.warning(
                "job %d (%s) failed on attempt %d of %d, will retry: %s",
                job.id,
                job.task,
                job.attempt,
                job.max_attempts,
                text,
                extra=_job_extra(job, "job_failed", error=text),
            )

    def _lost(self, attempt: _Attempt, what: str) -> None:
        attempt.lost = True  # no more heartbeats for it
        job = attempt.job
        logger.warning(
            "job %d attempt %d lost its lease (another attempt owns the job); %s",
            job.id,
            job.attempt,
            what,
            extra=_job_extra(job, "lease_lost"),
        )

    def _done_many(self, attempts: Iterable[_Attempt]) -> None:
        # One wake-up for the batch: the fetch loop then claims for all the freed slots at
        # once, instead of one job per slot as they free one by one.
        with self._wakeup:
            pop = self._in_flight.pop
            for attempt in attempts:
                if pop((attempt.job.id, attempt.job.attempt), None) is attempt and attempt.posted:
                    self._settling -= 1
            self._wakeup.notify_all()

    # -- heartbeat ------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        link = _Link(self.engine)
        try:
            self._heartbeats(link)
        finally:
            link.close()

    def _heartbeats(self, link: _Link) -> None:
        backoff = Backoff()
        while not self._finished.wait(self._heartbeat_every):
            with self._lock:
                leased = [
                    a
                    for a in self._in_flight.values()
                    if a.task is not None and a.task.mode == "lease" and not a.lost
                ]
            if not leased:
                continue
            groups: dict[float, list[_Attempt]] = {}
            for attempt in leased:
                assert attempt.task is not None
                groups.setdefault(attempt.task.lease.total_seconds(), []).append(attempt)
            try:
                lost: list[ClaimedJob] = []
                with link.begin() as connection:
                    for seconds, group in groups.items():
                        jobs = [a.job for a in group]
                        lost += heartbeat(_core(connection), jobs, lease=seconds)
            except Exception as exc:
                self._database_failed("heartbeat", exc, backoff, self._finished)
                continue
            self._database_recovered(backoff)
            by_key = {(a.job.id, a.job.attempt): a for a in leased}
            with self._commit_lock:  # an outcome committed meanwhile is not a lost lease
                lost_attempts = [by_key[(j.id, j.attempt)] for j in lost]
                lost_attempts = [a for a in lost_attempts if not a.ended]
            for attempt in lost_attempts:
                self._lost(attempt, "its heartbeat was refused")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _backend_pid(connection: Connection) -> int | None:
    dbapi_connection: Any = connection.connection.dbapi_connection
    info = getattr(dbapi_connection, "info", None)
    pid = getattr(info, "backend_pid", None)
    return pid if isinstance(pid, int) else None


def _rollback_quietly(session: Session) -> None:
    try:
        session.rollback()
    except Exception as exc:  # a broken connection: the server rolls back for us
        logger.debug("rollback failed: %s", describe(exc), extra={"action": "database_error"})
