"""Running handlers: the one path every claimed attempt takes to its outcome.

:meth:`Runner.run` is that path. Whatever the handler is (a function, a coroutine function,
a sync wrapper around one, an object whose ``__call__`` is ``async def``), it is called on a
handler thread, and when what it returns is awaitable, that is awaited on the runner's event
loop (started on first use) while the thread waits for it. Whatever happens, the end of its
:class:`Settling` block hands the attempt's outcome to
:meth:`State.settle <sqla_jobs.worker.state.State.settle>` exactly once:

* the handler returned: ``complete`` (with its result, once checked storable);
* it raised, or its result cannot be stored: ``fail``;
* no handler is registered for the task, or the attempt exceeds ``max_attempts``: ``fail``
  without retry (logged at once);
* its lease may have run out before the handler could start (the worker was stopped or
  starved): ``release``, and the handler never starts (the rule "a lease is checked before
  a handler starts" lives in :meth:`Runner.admit`, which a lock group's every attempt
  passes too);
* lock mode (:mod:`sqla_jobs.worker.locked`, which runs queued lock-mode attempts in one
  transaction, a group, each in a :class:`Settling` of its own): the group's transaction
  committed the completion (``committed``), or the row was no longer this attempt's
  (``lost``, the handler's writes rolled back), or the job's cancel was requested
  (``cancel``, the handler's writes rolled back), or the database failed under the group
  (``release``);
* the job's cancel was requested while the handler ran: ``cancel``, whatever the handler
  did (:meth:`State.settle <sqla_jobs.worker.state.State.settle>` holds that rule;
  :meth:`Runner.request_cancel` tells the handler).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from sqlalchemy.orm import Session

from sqla_jobs import hooks, validation
from sqla_jobs._queries.variant import tables_of
from sqla_jobs.context import ColumnLoader, JobContext, Snooze
from sqla_jobs.errors import JobTimeoutError
from sqla_jobs.observer import NO_OBSERVER
from sqla_jobs.queue import ClaimedJob, UnreadableJson, job_columns
from sqla_jobs.registry import Registry, Task
from sqla_jobs.worker import locked
from sqla_jobs.worker.processes import ProcessPool, check_process_tasks
from sqla_jobs.worker.settling import Settling, job_extra
from sqla_jobs.worker.state import Attempt, Kind, Outcome, State

__all__ = ["Runner"]

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

_T = TypeVar("_T")

logger = logging.getLogger("sqla_jobs.worker")

#: A handler does not start when less than this is left of its lease (seconds).
LEASE_MARGIN: Final = 0.05
#: How long queued jobs wait behind a running one before every idle thread is woken.
SPILL: Final = 0.002


async def _awaited(awaitable: Awaitable[_T], attempt: Attempt, context: contextvars.Context) -> _T:
    # The handler thread's context variables (the attempt's trace span among them), in the
    # event loop task's own copy of its context: the coroutine runs as if called there.
    for variable, value in context.items():
        variable.set(value)
    task = asyncio.current_task()
    attempt.aio_task = task
    if (attempt.cancel_requested or attempt.timed_out) and task is not None:
        # Asked (or past its time limit) before the coroutine started (see
        # Runner.request_cancel and Runner._limit_loop): it is cancelled at its first await.
        task.cancel()
    return await awaitable


async def _in_context(awaitable: Awaitable[_T], context: contextvars.Context) -> _T:
    for variable, value in context.items():
        variable.set(value)
    return await awaitable


class Runner:
    """``concurrency`` handler threads taking attempts from one queue, and an event loop
    thread for handlers that return awaitables."""

    def __init__(
        self,
        state: State,
        registry: Registry,
        worker_name: str,
        prefix: str,
        *,
        session_factory: Callable[[], Session],
        async_session_factory: Callable[[], AsyncSession] | None,
        processes: int | None = None,
    ) -> None:
        self.state = state
        self.registry = registry
        self.worker_name = worker_name
        self.prefix = prefix
        self.session_factory = session_factory
        self.async_session_factory = async_session_factory
        self.pooled = False  # behind a transaction pooler (set by the worker at start)
        self.unreadable = 0  # jobs ended dead because their row could not be read (admit)
        self.observer = NO_OBSERVER  # set by the worker (its metrics)
        self._queue: collections.deque[Attempt] = collections.deque()
        # One lock for the queue and its two conditions, taken directly where no wait
        # follows (a Condition's own __enter__ is one more Python call per job).
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._spill = threading.Condition(self._lock)
        self._spill_due = 0.0  # when to look whether queued jobs wait behind slow ones
        self._spill_mark = 0  # self._taken then
        self._taken = 0  # jobs taken from the queue so far
        self._working = 0  # lock groups running a statement of their own (lock, commit)
        # By task: its slowest recent lock-mode handler (seconds), which sizes a lock
        # group's chunks (sqla_jobs.worker.locked).
        self.lock_pace: dict[str, float] = {}
        self._idle = 0
        self._closed = False
        self.threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._own_loop = True
        self.columns_loader: ColumnLoader = self._load_columns  # one bound method, not one per job
        # Whether results are stored (checked then): once, not per job.
        self._stores = registry.result_model is not None or tables_of(registry.model).keeps_results
        # The child processes of process tasks (sqla_jobs.worker.processes): their functions
        # checked now, before any SQL; started with the handler threads when there are any.
        self._process_tasks = bool(check_process_tasks(registry))
        self._processes = ProcessPool(
            processes or min(state.concurrency, os.cpu_count() or 1), prefix
        )

    def request_cancel(self, key: tuple[int, int]) -> None:
        """The cancel of attempt ``key`` (job id, attempt) was requested (the heartbeat read
        it in the job's row; a notification alone never gets here): a handler not started
        is settled as a cancel at once; a running thread handler sees ``ctx.cancelled``; a
        running coroutine handler is cancelled on its event loop. Nothing for an attempt
        this worker does not hold."""
        attempt = self.state.request_cancel(key)
        if attempt is None:
            return
        logger.info(
            "job %d: cancel requested while it runs; stopping it",
            attempt.job.id,
            extra=job_extra(attempt, "job_cancel_requested"),
        )
        self._cancel_coroutine(attempt)

    def _cancel_coroutine(self, attempt: Attempt) -> None:
        # A process handler's child is killed (its thread raises at once).
        self._processes.stop(attempt)
        task, loop = attempt.aio_task, self._loop
        if task is not None and loop is not None and not loop.is_closed():
            # Not the concurrent future's cancel: that would let the handler thread go on
            # before the coroutine has finished (a lock-mode transaction not yet rolled back).
            loop.call_soon_threadsafe(task.cancel)

    def use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run coroutine handlers on ``loop`` (an application's) instead of a loop of the
        runner's own; at shutdown only this worker's coroutines are cancelled on it."""
        self._loop, self._own_loop = loop, False

    # -- threads --------------------------------------------------------------------------

    def start(self, count: int) -> None:
        for n in range(count):
            thread = threading.Thread(
                target=self._thread_main, name=f"{self.prefix}-handler-{n}", daemon=True
            )
            self.threads.append(thread)
            thread.start()
        spiller = threading.Thread(
            target=self._spill_loop, name=f"{self.prefix}-spill", daemon=True
        )
        self.threads.append(spiller)
        spiller.start()
        limits = threading.Thread(
            target=self._limit_loop, name=f"{self.prefix}-time-limits", daemon=True
        )
        self.threads.append(limits)
        limits.start()
        if self._process_tasks:
            self._processes.start()

    def _limit_loop(self) -> None:
        # The time limits (State.time_out holds the rule): a lease-mode attempt past its
        # limit is failed at once, and its coroutine (if it is one) cancelled; a thread
        # handler is told (ctx.cancelled) and keeps its slot until it returns.
        while not self._closed:
            for attempt in self.state.time_out(time.monotonic()):
                logger.warning(
                    "job %d attempt %d ran past its time limit of %g seconds; stopping it",
                    attempt.job.id,
                    attempt.job.attempt,
                    attempt.time_limit,
                    extra=job_extra(attempt, "job_timed_out"),
                )
                self._cancel_coroutine(attempt)

    def submit(self, attempts: Sequence[Attempt]) -> None:
        """Queue attempts for the handler threads.

        One idle thread is woken, and runs the batch's jobs one after another: a thread
        wake-up costs more than a quick job. When ``SPILL`` seconds pass without any queued
        job being taken (the running ones are slow), one more idle thread is woken, then two,
        four, ... every ``SPILL`` that passes so, so a batch of slow jobs starts in parallel
        within a few milliseconds, and a moment's stall of quick ones does not wake every
        thread (each thread woken for a lock-mode job opens a transaction of its own).
        """
        with self._lock:
            self._queue.extend(attempts)
            if self._idle:
                self._ready.notify()
            if len(self._queue) > 1 and not self._spill_due:
                self._spill_due = time.monotonic() + SPILL
                self._spill_mark = self._taken
                self._spill.notify()

    def _spill_loop(self) -> None:
        woken, width = 0, 1  # threads woken at the last look; how many to wake next
        with self._lock:
            while not self._closed:
                if not self._spill_due:
                    self._spill.wait()
                    continue
                delay = self._spill_due - time.monotonic()
                if delay > 0:
                    self._spill.wait(delay)
                    continue
                if not (self._queue and self._idle):
                    self._spill_due, woken, width = 0.0, 0, 1
                    continue
                if self._taken - self._spill_mark > woken or self._working:
                    # Progress: quick jobs, or a lock group between two takes (its lock or
                    # commit statement), which takes the queued jobs next.
                    woken, width = 0, 1
                else:  # only the threads just woken took jobs: slow ones
                    woken = min(len(self._queue), self._idle, width)
                    width *= 2
                    self._ready.notify(woken)
                self._spill_due = time.monotonic() + SPILL  # look again later
                self._spill_mark = self._taken

    def waiting(self) -> int:
        """Attempts queued that no handler thread has taken yet."""
        with self._lock:
            return len(self._queue)

    def take_queued(self, accept: Callable[[Attempt], bool], limit: int) -> list[Settling]:
        """Up to ``limit`` attempts from the head of the queue, as long as ``accept`` takes
        them, each in the :class:`Settling` the taker must enter at once; never waits (a
        lock group grows with them, :mod:`sqla_jobs.worker.locked`). Empty when the queue
        is, its head is not accepted, or the runner is closed."""
        taken: list[Settling] = []
        with self._lock:
            queue = self._queue
            while len(taken) < limit and queue and not self._closed and accept(queue[0]):
                taken.append(Settling(self.state, queue.popleft()))
            self._taken += len(taken)
        return taken

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """A lock group runs a statement of its own (its lock, its commit): the spill does
        not take that for queued jobs stuck behind slow handlers (the group takes them
        next), so it does not wake idle threads into groups of their own for it."""
        with self._lock:
            self._working += 1
        try:
            yield
        finally:
            with self._lock:
                self._working -= 1

    def _next(self) -> Attempt | None:
        with self._lock:
            queue = self._queue
            if not queue or self._closed:  # else the common case: a job is waiting
                self._idle += 1
                try:
                    while not queue and not self._closed:
                        self._ready.wait()
                finally:
                    self._idle -= 1
                if self._closed:
                    return None
            self._taken += 1
            return queue.popleft()

    def _thread_main(self) -> None:
        # A handler thread lives as long as the runner: whatever one attempt does, the
        # thread goes on to the next. run() settles every attempt it is given (Settling);
        # should it raise all the same (a defect), the attempt is failed here, never left
        # held without an outcome, and the thread is not lost.
        while (attempt := self._next()) is not None:
            try:
                self.run(attempt)
            except BaseException as error:  # noqa: PERF203 (free in 3.11+; needed per attempt)
                logger.exception(
                    "job %d: the handler thread failed outside the handler",
                    attempt.job.id,
                    extra=job_extra(attempt, "handler_thread_error"),
                )
                self.state.settle(attempt, Outcome(Kind.FAIL, error=error))

    def close(self, timeout: float) -> None:
        """Stop the handler threads (queued attempts were settled by shutdown) and the
        event loop, cancelling coroutines still running."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._ready.notify_all()
            self._spill.notify_all()
        self.state.close()
        self._processes.close()
        loop = self._loop
        if loop is not None and self._own_loop and not loop.is_closed():
            loop.call_soon_threadsafe(_cancel_all_and_stop, loop)
        deadline = time.monotonic() + timeout
        for thread in [*self.threads, self._loop_thread]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop coroutine handlers run on, started by the first one."""
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=_run_loop, args=(loop,), name=f"{self.prefix}-event-loop", daemon=True
                )
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    # -- the path ---------------------------------------------------------------------------

    def run(self, attempt: Attempt) -> None:
        """Run one attempt to exactly one outcome (see the module docstring)."""
        with Settling(self.state, attempt) as settling:
            settling.outcome = self._execute(attempt)

    def _execute(self, attempt: Attempt) -> Outcome:
        task = attempt.task
        refused = self.admit(attempt)
        if refused is not None:
            return refused
        assert task is not None  # admit refuses an attempt without one
        if task.mode == "lock":
            return locked.run(self, attempt, task)
        ctx = JobContext(
            attempt.job, self.worker_name, _cancel=attempt, _loader=self.columns_loader
        )
        result = self.handle(attempt, task, ctx)
        return _COMPLETED if result is None else Outcome(Kind.COMPLETE, result)

    def admit(self, attempt: Attempt) -> Outcome | None:
        """Whether ``attempt``'s handler may start now: None when it may (it is marked
        started), else the outcome it gets instead. Every handler passes here first, a lock
        group's too (:mod:`sqla_jobs.worker.locked`)."""
        job, task = attempt.job, attempt.task
        if task is None:
            known = ", ".join(sorted(t.name for t in self.registry)) or "none"
            message = (
                f"unknown task {job.task!r}: no handler is registered for it in this worker's "
                f"registry (known tasks: {known}); the job is kept as dead, retry it once a "
                "worker knows the task"
            )
            logger.error(message, extra=job_extra(attempt, "unknown_task"))
            return Outcome(Kind.FAIL, error=message, retry=False, action="unknown_task")
        unreadable = _unreadable(job)
        if unreadable is not None:
            # A row no handler can be given (written by another program: see
            # UnreadableJson). It ends alone, dead: a retry would read the same row.
            message = (
                f"{unreadable}; it is kept as dead (fix or delete the row; retrying it as "
                "it is would fail the same way)"
            )
            self.unreadable += 1
            logger.error(message, extra=job_extra(attempt, "unreadable_row"))
            return Outcome(Kind.FAIL, error=message, retry=False, action="unreadable_row")
        if job.attempt > job.max_attempts:
            message = (
                f"attempt {job.attempt} exceeds max_attempts {job.max_attempts}: earlier "
                "attempts ended without an outcome; not run again"
            )
            logger.error(message, extra=job_extra(attempt, "attempts_exhausted"))
            return Outcome(Kind.FAIL, error=message, retry=False, action="attempts_exhausted")
        left = attempt.lease_deadline - time.monotonic()
        if left < LEASE_MARGIN:
            # The worker was stopped or starved past the lease: another worker may run this
            # attempt's job already. Give it back (fenced: a no-op if it was taken over).
            return Outcome(
                Kind.RELEASE,
                why=f"its lease may have run out ({-left:.1f}s past) before it started",
            )
        if not self.state.start(attempt):
            return Outcome(Kind.RELEASE, why="given back before it started")  # refused: settled
        self.observer.started(job)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("job started", extra=job_extra(attempt, "job_started"))
        return None

    def _load_columns(
        self,
        job: ClaimedJob,
        session: Session | None,
        read: Callable[[ClaimedJob, Session], _T] = job_columns,  # type: ignore[assignment]
    ) -> _T:
        # ctx.columns (and a step's reads and writes): through the claim's session in lock
        # mode, else a session of its own, committed.
        if session is not None:
            return read(job, session)
        with self.session_factory() as own, own.begin():
            return read(job, own)

    def handle(
        self,
        attempt: Attempt,
        task: Task[Any],
        ctx: JobContext,
        check: Callable[[], object] | None = None,
    ) -> Any:
        """Call ``task``'s handler with ``ctx``, and return what it returned as the result
        to complete the job with (:meth:`returned`), after ``check()`` (a lock group's flush
        of the handler's writes); with the task's hooks around all that
        (:mod:`sqla_jobs.hooks`): on this thread for a thread handler, in the handler's own
        asyncio task for a coroutine function. Raises what ends the attempt otherwise."""
        task_hooks = task.hooks
        if task_hooks is None:
            result = self.returned(attempt, self.call_handler(attempt, task, ctx))
            if check is not None:
                check()
            return result
        seen = hooks.hook_context(ctx, attempt, self.columns_loader)
        if inspect.iscoroutinefunction(task.function):

            async def handled() -> Any:
                result = self.returned(attempt, await task.function(ctx))
                if check is not None:
                    check()
                return result

            return self.await_handler(
                attempt, hooks.around_async(task_hooks, seen, attempt, handled)
            )

        def called() -> Any:
            result = self.returned(attempt, self.call_handler(attempt, task, ctx))
            if check is not None:
                check()
            return result

        return hooks.around(task_hooks, seen, attempt, called, self.run_on_loop)

    def run_on_loop(self, awaitable: Awaitable[_T]) -> _T:
        """Await ``awaitable`` (a coroutine hook) on the event loop, from this handler thread,
        in a copy of its context."""
        future = asyncio.run_coroutine_threadsafe(
            _in_context(awaitable, contextvars.copy_context()), self._event_loop()
        )
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise asyncio.CancelledError("the worker cancelled the coroutine") from None

    def call_handler(self, attempt: Attempt, task: Task[Any], ctx: JobContext) -> Any:
        if task.process:  # in a child process of the pool (sqla_jobs.worker.processes)
            return self._processes.call(attempt, task, self.worker_name)
        value = task.function(ctx)
        if value is not None and inspect.isawaitable(value):
            value = self.await_handler(attempt, value)
        return value

    def await_handler(self, attempt: Attempt, awaitable: Awaitable[_T]) -> _T:
        """Await on the event loop, from this handler thread."""
        future = asyncio.run_coroutine_threadsafe(
            _awaited(awaitable, attempt, contextvars.copy_context()), self._event_loop()
        )
        attempt.future = future
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise asyncio.CancelledError("the worker cancelled the coroutine") from None

    def returned(self, attempt: Attempt, result: Any) -> Any:
        """What ``attempt``'s handler returned, as the result to complete its job with: the
        one place a handler's return value becomes a result, in both modes. Raises instead
        (and the attempt ends as if its handler had raised it) when the attempt ran past its
        time limit (:class:`~sqla_jobs.errors.JobTimeoutError`: a lease-mode attempt is
        failed at the limit already, and this is refused; a lock-mode one fails now, its
        writes rolled back), when the handler returned a :class:`~sqla_jobs.Snooze`, and
        when the result is not storable."""
        if attempt.timed_out:
            raise JobTimeoutError(
                f"job {attempt.job.id} attempt {attempt.job.attempt} returned after its time "
                f"limit of {attempt.time_limit:g} seconds; its result is refused"
            )
        if isinstance(result, Snooze):
            raise result
        # A result jsonb cannot store fails its own job here, not the batch it is written in.
        if self._stores and result is not None:
            try:
                validation.check_json("result", result)
            except RecursionError as exc:
                raise ValueError("result: nested too deeply to store") from exc
        return result


def _unreadable(job: ClaimedJob) -> str | None:
    """Why no handler can be given ``job`` as the claim read it, or None when one can: its
    ``args`` Python's json cannot decode (:class:`~sqla_jobs.queue.UnreadableJson`), or its
    ``run_at`` outside what Python's datetime holds (the claim hands it back as None:
    :func:`sqla_jobs._queries._sql._readable_time`). Only a row another program wrote."""
    args: object = job.args  # typed as a dict; a row written by another program may not be
    if type(args) is UnreadableJson:
        return f"the job's args cannot be read: {args.reason}"
    run_at: object = job.run_at  # typed as a datetime; likewise
    if run_at is None:
        return (
            "the job's run_at cannot be read: it lies outside the times Python's datetime "
            "holds (years 1 to 9999), such as '-infinity'"
        )
    return None


#: The outcome of every handler that returned None (one object, not one per job).
_COMPLETED: Final = Outcome(Kind.COMPLETE)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


def _cancel_all_and_stop(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon(loop.stop)
