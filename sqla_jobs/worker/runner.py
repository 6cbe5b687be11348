"""Running handlers: the one path every claimed attempt takes to its outcome.

:meth:`Runner.run` is that path. Whatever the handler is (a function, a coroutine function,
a sync wrapper around one, an object whose ``__call__`` is ``async def``), it is called on a
handler thread, and when what it returns is awaitable, that is awaited on the runner's event
loop (started on first use) while the thread waits for it. Whatever happens, a ``finally``
hands the attempt's outcome to :meth:`State.settle <sqla_jobs.worker.state.State.settle>`
exactly once:

* the handler returned: ``complete`` (with its result, once checked storable);
* it raised, or its result cannot be stored: ``fail``;
* no handler is registered for the task, or the attempt exceeds ``max_attempts``: ``fail``
  without retry (logged at once);
* its lease may have run out before the handler could start (the worker was stopped or
  starved): ``release``, and the handler never starts (the rule "a lease is checked before
  a handler starts" lives in :meth:`Runner._execute`);
* lock mode: the handler's transaction committed the completion itself (``committed``), or
  the row was no longer this attempt's (``lost``, the handler's writes rolled back), or
  the job's cancel was requested (``cancel``, the handler's writes rolled back), or the
  database failed under it (``release``);
* the job's cancel was requested while the handler ran: ``cancel``, whatever the handler
  did (:meth:`State.settle <sqla_jobs.worker.state.State.settle>` holds that rule;
  :meth:`Runner.request_cancel` tells the handler).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from sqlalchemy.orm import Session

from sqla_jobs import statements, tracing, validation
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.events import describe
from sqla_jobs.history.schema import has_history
from sqla_jobs.queue import ClaimedJob, complete_attempts, job_columns, lock_one
from sqla_jobs.registry import JobContext, Registry, Task
from sqla_jobs.worker.link import as_session
from sqla_jobs.worker.observer import NO_OBSERVER
from sqla_jobs.worker.state import Attempt, Kind, Outcome, State

__all__ = ["Runner", "job_extra"]

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

_T = TypeVar("_T")

logger = logging.getLogger("sqla_jobs.worker")

#: A handler does not start when less than this is left of its lease (seconds).
LEASE_MARGIN: Final = 0.05
#: How long queued jobs wait behind a running one before every idle thread is woken.
SPILL: Final = 0.002


def job_extra(attempt: Attempt, action: str, **more: Any) -> dict[str, Any]:
    job = attempt.job
    return {
        "action": action,
        "job_id": job.id,
        "task": job.task,
        "queue": job.queue,
        "attempt": job.attempt,
        **more,
    }


async def _awaited(awaitable: Awaitable[_T], attempt: Attempt, context: contextvars.Context) -> _T:
    # The handler thread's context variables (the attempt's trace span among them), in the
    # event loop task's own copy of its context: the coroutine runs as if called there.
    for variable, value in context.items():
        variable.set(value)
    task = asyncio.current_task()
    attempt.aio_task = task
    if attempt.cancel_requested and task is not None:
        # Asked before the coroutine started (see Runner.request_cancel): it is cancelled
        # at its first await.
        task.cancel()
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
    ) -> None:
        self.state = state
        self.registry = registry
        self.worker_name = worker_name
        self.prefix = prefix
        self.session_factory = session_factory
        self.async_session_factory = async_session_factory
        self.pooled = False  # behind a transaction pooler (set by the worker at start)
        self.observer = NO_OBSERVER  # set by the worker (its metrics)
        self._queue: collections.deque[Attempt] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._spill = threading.Condition(self._ready._lock)  # type: ignore[attr-defined]
        self._spill_due = 0.0  # when to look whether queued jobs wait behind slow ones
        self._spill_mark = 0  # self._taken then
        self._taken = 0  # jobs taken from the queue so far
        self._idle = 0
        self._closed = False
        self.threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._own_loop = True
        self._columns_loader = self._load_columns  # one bound method, not one per job
        # Whether results are stored (checked then): once, not per job.
        self._stores = registry.result_model is not None or has_history(registry.model)

    def request_cancel(self, key: tuple[int, int]) -> None:
        """The cancel of attempt ``key`` (job id, attempt) was requested (a notification,
        or the heartbeat's answer): a handler not started is settled as a cancel at once;
        a running thread handler sees ``ctx.cancelled``; a running coroutine handler is
        cancelled on its event loop. Nothing for an attempt this worker does not hold."""
        attempt = self.state.request_cancel(key)
        if attempt is None:
            return
        logger.info(
            "job %d: cancel requested while it runs; stopping it",
            attempt.job.id,
            extra=job_extra(attempt, "job_cancel_requested"),
        )
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

    def submit(self, attempts: Sequence[Attempt]) -> None:
        """Queue attempts for the handler threads.

        One idle thread is woken, and runs the batch's jobs one after another: a thread
        wake-up costs more than a quick job. When ``SPILL`` seconds pass without any queued
        job being taken (the running ones are slow), every idle thread is woken at once, so
        a batch of slow jobs starts in parallel within about a millisecond.
        """
        with self._ready:
            self._queue.extend(attempts)
            if self._idle:
                self._ready.notify()
            if len(self._queue) > 1 and not self._spill_due:
                self._spill_due = time.monotonic() + SPILL
                self._spill_mark = self._taken
                self._spill.notify()

    def _spill_loop(self) -> None:
        with self._ready:
            while not self._closed:
                if not self._spill_due:
                    self._spill.wait()
                    continue
                delay = self._spill_due - time.monotonic()
                if delay > 0:
                    self._spill.wait(delay)
                    continue
                if not (self._queue and self._idle):
                    self._spill_due = 0.0
                elif self._taken != self._spill_mark:  # progress: quick jobs; look again later
                    self._spill_due = time.monotonic() + SPILL
                    self._spill_mark = self._taken
                else:
                    self._spill_due = 0.0
                    self._ready.notify(min(len(self._queue), self._idle))

    def waiting(self) -> int:
        """Attempts queued that no handler thread has taken yet."""
        with self._ready:
            return len(self._queue)

    def _next(self) -> Attempt | None:
        with self._ready:
            self._idle += 1
            try:
                while not self._queue and not self._closed:
                    self._ready.wait()
            finally:
                self._idle -= 1
            if self._closed:
                return None
            self._taken += 1
            return self._queue.popleft()

    def _thread_main(self) -> None:
        while (attempt := self._next()) is not None:
            self.run(attempt)

    def close(self, timeout: float) -> None:
        """Stop the handler threads (queued attempts were settled by shutdown) and the
        event loop, cancelling coroutines still running."""
        with self._ready:
            self._closed = True
            self._queue.clear()
            self._ready.notify_all()
            self._spill.notify_all()
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
        outcome = Outcome(Kind.RELEASE, why="its handler thread ended unexpectedly")
        try:
            # The attempt's trace span (a no-op unless OpenTelemetry is loaded): it records
            # an error that escapes, and is told the outcome of one that does not.
            with tracing.attempt_span(attempt.job) as span:
                outcome = self._execute(attempt)
                span.settled(outcome.kind.value, outcome.error)
        except BaseException as exc:  # the handler's error, whatever it is, fails the job
            outcome = Outcome(Kind.FAIL, error=exc)
        finally:
            self.state.settle(attempt, outcome)

    def _execute(self, attempt: Attempt) -> Outcome:
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
        if task.mode == "lock":
            return self._run_locked(attempt, task)
        ctx = JobContext(job, self.worker_name, _cancel=attempt, _loader=self._columns_loader)
        result = self._call(attempt, task, ctx)
        return _COMPLETED if result is None else Outcome(Kind.COMPLETE, self._storable(result))

    def _load_columns(self, job: ClaimedJob, session: Session | None) -> dict[str, Any]:
        # ctx.columns: through the claim's session in lock mode, else a session of its own.
        if session is not None:
            return job_columns(job, session)
        with self.session_factory() as own, own.begin():
            return job_columns(job, own)

    def _call(self, attempt: Attempt, task: Task[Any], ctx: JobContext) -> Any:
        value = task.function(ctx)
        if value is not None and inspect.isawaitable(value):
            value = self._await(attempt, value)
        return value

    def _await(self, attempt: Attempt, awaitable: Awaitable[_T]) -> _T:
        """Await on the event loop, from this handler thread."""
        future = asyncio.run_coroutine_threadsafe(
            _awaited(awaitable, attempt, contextvars.copy_context()), self._event_loop()
        )
        attempt.future = future
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise asyncio.CancelledError("the worker cancelled the coroutine") from None

    def _storable(self, result: Any) -> Any:
        # A result jsonb cannot store fails its own job here, not the batch it is written in.
        if self._stores and result is not None:
            try:
                validation.check_json("result", result)
            except RecursionError as exc:
                raise ValueError("result: nested too deeply to store") from exc
        return result

    def _run_locked(self, attempt: Attempt, task: Task[Any]) -> Outcome:
        """Lock the row, run the handler in that transaction, complete the job in it and
        commit: the handler's writes and the completion commit together, or not at all."""
        if self.async_session_factory is not None and inspect.iscoroutinefunction(task.function):
            return self._await(attempt, self._run_locked_async(attempt, task))
        job = attempt.job
        committing = False
        try:
            with self.session_factory() as session:
                transaction = session.begin()
                # The worker's own statements run on the session's connection (the same
                # transaction), which takes the driver's fast path (queue._rows).
                connection = session.connection()
                started = lock_one(as_session(connection), job)
                if started is None:
                    session.rollback()
                    return Outcome(Kind.LOST, why="it was taken over before it could be locked")
                pid = _backend_pid(session, ask=self.pooled)
                attempt.backend = None if pid is None else (pid, started)
                try:
                    ctx = JobContext(
                        job,
                        self.worker_name,
                        session,
                        _cancel=attempt,
                        _loader=self._columns_loader,
                    )
                    result = self._storable(self._call(attempt, task, ctx))
                    if session.get_transaction() is not transaction or not transaction.is_active:
                        raise ConfigurationError(_ENDED_TRANSACTION)
                    # The handler's pending writes: refused ones fail the job like an error
                    # raised by the handler itself.
                    session.flush()
                except BaseException as exc:
                    _rollback_quietly(session)
                    return Outcome(Kind.FAIL, error=exc)
                ended = self._complete(as_session(connection), attempt, result)
                if ended is not None:  # nothing of the handler's may commit then
                    _rollback_quietly(session)
                    return ended
                committing = True
                session.commit()
            return Outcome(Kind.COMMITTED)
        except Exception as exc:
            return _database_failed(attempt, exc, committing=committing)
        finally:
            attempt.backend = None

    async def _run_locked_async(self, attempt: Attempt, task: Task[Any]) -> Outcome:
        """:meth:`_run_locked` for a coroutine handler, with an AsyncSession: the same steps,
        awaited on the event loop (the queue functions run through ``run_sync``)."""
        assert self.async_session_factory is not None
        job = attempt.job
        committing = False
        try:
            async with self.async_session_factory() as session:
                transaction = await session.begin()
                started = await session.run_sync(lock_one, job)
                if started is None:
                    await transaction.rollback()
                    return Outcome(Kind.LOST, why="it was taken over before it could be locked")
                pid = await session.run_sync(_backend_pid, ask=self.pooled)
                attempt.backend = None if pid is None else (pid, started)
                try:
                    ctx = JobContext(
                        job,
                        self.worker_name,
                        _async_session=session,
                        _cancel=attempt,
                        _loader=self._columns_loader,
                    )
                    result = self._storable(await task.function(ctx))
                    if not transaction.is_active or session.get_transaction() is not transaction:
                        raise ConfigurationError(_ENDED_TRANSACTION)
                    await session.flush()  # as in _run_locked
                except BaseException as exc:
                    try:
                        await session.rollback()
                    except Exception as rollback_error:  # the server rolls back for us
                        logger.debug("rollback failed: %s", describe(rollback_error))
                    return Outcome(Kind.FAIL, error=exc)
                ended = await session.run_sync(lambda s: self._complete(s, attempt, result))
                if ended is not None:  # as in _run_locked
                    await transaction.rollback()
                    return ended
                committing = True
                await transaction.commit()
            return Outcome(Kind.COMMITTED)
        except Exception as exc:
            return _database_failed(attempt, exc, committing=committing)
        finally:
            attempt.backend = None

    def _complete(self, session: Session, attempt: Attempt, result: Any) -> Outcome | None:
        """Complete ``attempt`` in ``session``'s transaction. None when it completed; else
        the outcome instead, and the caller rolls the transaction back: ``lost`` when it was
        fenced out, ``cancel`` when its cancel was requested (the completion made it
        cancelled: rolled back with the handler's writes, the outcome writer cancels it)."""
        result_model = self.registry.result_model
        if has_history(attempt.job.model) and result is not None:
            # The result goes into the history row, with the job.
            lost, cancelled = complete_attempts(session, [attempt.job], results=[result])
        elif result_model is None or result is None:
            lost, cancelled = complete_attempts(session, [attempt.job])
        else:
            lost, cancelled = complete_attempts(
                session, [attempt.job], results=[result], result_model=result_model
            )
        if cancelled:
            return Outcome(Kind.CANCEL, why="its cancel was requested")
        if lost:
            return Outcome(Kind.LOST, why="its completion was fenced out")
        return None


#: The outcome of every handler that returned None (one object, not one per job).
_COMPLETED: Final = Outcome(Kind.COMPLETE)

_ENDED_TRANSACTION: Final = (
    "the handler ended the claim's transaction (commit, rollback or close); a lock-mode "
    "handler must leave it to the worker"
)


def _database_failed(attempt: Attempt, exc: Exception, *, committing: bool) -> Outcome:
    # The database failed under a lock-mode attempt, not its handler. Give the job back: the
    # release is fenced, so if the commit did go through it changes nothing.
    what = "its commit failed" if committing else "a database error"
    logger.warning(
        "lock-mode job %d: %s (%s); if nothing was committed the job is given back",
        attempt.job.id,
        what,
        describe(exc),
        extra=job_extra(
            attempt, "outcome_unknown" if committing else "database_error", error=describe(exc)
        ),
    )
    return Outcome(Kind.RELEASE, why=what)


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


def _backend_pid(session: Session, *, ask: bool = False) -> int | None:
    # psycopg knows its backend's pid: no query needed (another driver: not known). Behind a
    # pooler it knows the pooler's stand-in instead: ask the server (the transaction stays
    # on one backend).
    if ask:
        return int(session.execute(statements.backend_transaction()).one()[0])
    driver: Any = session.connection().connection.driver_connection
    pid = getattr(getattr(driver, "info", None), "backend_pid", None)
    return pid if isinstance(pid, int) else None


def _rollback_quietly(session: Session) -> None:
    try:
        session.rollback()
    except Exception as exc:  # a broken connection: the server rolls back for us
        logger.debug("rollback failed: %s", describe(exc), extra={"action": "database_error"})
