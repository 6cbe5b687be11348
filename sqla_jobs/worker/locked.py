"""Lock-held mode: handlers that write in the transaction holding their job's row lock, run
in groups that commit once.

A handler thread that takes a lock-mode attempt (:meth:`Runner.run
<sqla_jobs.worker.runner.Runner.run>`) opens one transaction and runs a *group* in it, in
*chunks* of attempts:

1. take a chunk: the first is that attempt, with as many queued lock-mode attempts as fit in
   :data:`WINDOW` at their tasks' *pace* (none when its task is not known yet or slow);
   each later chunk is at most twice the last, within what is left of the window (its head
   is taken whatever its pace). Attempts are taken from the head of the runner's queue
   without waiting (:meth:`Runner.take_queued
   <sqla_jobs.worker.runner.Runner.take_queued>`), and each is checked as every attempt is
   checked before its handler starts (:meth:`Runner.admit
   <sqla_jobs.worker.runner.Runner.admit>`);
2. lock the chunk's rows in one statement (:func:`~sqla_jobs.queue.lock_started`, fenced by
   attempt: an attempt that was taken over is ``lost``, and its handler never starts);
3. run the chunk's handlers one after another (one whose cancel was requested while it
   waited for its turn is ``cancel``, its handler never started). The first time a handler
   asks for ``ctx.session`` or ``ctx.columns``, a SAVEPOINT is set, so that whatever it does
   in the transaction can be undone alone;
4. if it raised, roll back to its savepoint: ``fail``. If it wrote, complete its attempt
   inside its savepoint, then release the savepoint; or roll back to it when that
   completion leaves it out, its cancel requested: ``cancel`` (see 6);
5. while the group's handlers have taken less than :data:`WINDOW` in all, the group is
   younger than :data:`AGE` and holds fewer than :data:`CAP` attempts, go back to 1;
6. complete every attempt whose handler returned without touching the session in one
   statement, and commit once. Every attempt completed in the group is then
   ``committed``; if the commit fails, each is given back (``release``, fenced: a no-op for
   a commit that did go through), and runs again.

The group's completions (:func:`~sqla_jobs.queue.complete_held`) find their rows through
the primary key, and leave out a job whose cancel was requested: it stays running, its
outcome is ``cancel``, and the outcome writer cancels it once the group's transaction has
ended (fenced, like every write of the writer's: were the job no longer this attempt's, the
cancel changes nothing and the attempt is logged as lost). So nothing of the group's has to
be undone for it, and the one statement needs no savepoint.

So a handler's writes commit with its own job's completion or not at all, a failure or a
cancel rolls back only its own job's writes, and the WAL is flushed once per group instead
of once per job; a group of quick handlers costs three statements (lock, complete, commit).

**The pace.** A task's pace (``Runner.lock_pace``) is its slowest recent handler: a handler
slower than the pace sets it at once (groups running meanwhile see it), and each group
brings it down to the slowest of its own, at most by half. So a task whose handlers are
quick fills a chunk at once, and one not seen yet, or slow, goes alone and the chunks double
from there as its handlers prove quick. A task whose handlers turn slow from one job to the
next can hold back the rest of a chunk taken at the old pace (at most :data:`CAP`).

**Why the savepoint can wait for the session.** A handler reaches the group's transaction
only through its context: ``ctx.session`` sets the savepoint before handing the session
out, and ``ctx.columns`` before its read. A handler that uses neither ran no SQL in the
transaction: it has nothing to roll back, and cannot have aborted the transaction. Such
handlers (and the common no-op-on-the-database ones) pay no savepoint round trip; their
completions wait for the group's one statement. (A handler that keeps a session from an
earlier job and uses it later breaks this, as it breaks the rule that the session is its
own job's only while it runs.)

**Why only while young.** An attempt the group takes waits for the group's earlier handlers
and for its commit. The group stops taking once its handlers have taken :data:`WINDOW`, so a
slow handler holds back at most the attempts of its chunk after it; the queued ones are
taken by other handler threads, which the runner wakes when queued jobs wait (its
``SPILL``), and which run groups of their own, in parallel. A group's own statements (its
locks, its commit) do not count as queued jobs waiting (:meth:`Runner.working
<sqla_jobs.worker.runner.Runner.working>`): the group takes them next, and waking idle
threads for them would make many small groups.

**The lease.** Each attempt passes :meth:`Runner.admit
<sqla_jobs.worker.runner.Runner.admit>` when its chunk is taken, before its row is locked:
its handler does not start with less than ``LEASE_MARGIN`` of its lease left. Once its row
is locked no claim can take the job (claims and heartbeats skip locked rows), however long
the rest of the group takes, so an attempt waiting for its group's commit needs no second
check.

**One outcome each.** The first attempt is :meth:`Runner.run
<sqla_jobs.worker.runner.Runner.run>`'s, which settles it with what :func:`run` returns;
every attempt the group takes comes in a :class:`~sqla_jobs.worker.runner.Settling`, entered
at once into the group's ``ExitStack``, whose unwinding settles each exactly once whatever
happens. A group's attempts are settled after its transaction ended.

A coroutine handler given an :class:`~sqlalchemy.ext.asyncio.AsyncSession` (the worker's
``async_session_factory``) keeps a transaction of its own per attempt (:func:`_run_async`):
the same steps, awaited on the event loop, with one commit per job.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from sqlalchemy.orm import Session, SessionTransaction

from sqla_jobs._queries.admin import BACKEND_TRANSACTION
from sqla_jobs._queries.variant import tables_of
from sqla_jobs.context import ColumnLoader, JobContext
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.events import describe
from sqla_jobs.hooks import around_async, hook_context
from sqla_jobs.queue import ClaimedJob, complete_held, job_columns, lock_one, lock_started
from sqla_jobs.registry import Registry, Task
from sqla_jobs.worker.link import as_session
from sqla_jobs.worker.settling import Settling, ended_by
from sqla_jobs.worker.state import Attempt, Kind, Outcome

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["AGE", "CAP", "WINDOW", "LockHost", "run"]

_T = TypeVar("_T")


class LockHost(Protocol):
    """What a lock group needs of the runner whose handler thread runs it
    (:class:`~sqla_jobs.worker.runner.Runner` is the one): a protocol, so that this module,
    which the runner imports, does not import the runner back."""

    registry: Registry
    worker_name: str
    session_factory: Callable[[], Session]
    async_session_factory: Callable[[], AsyncSession] | None
    pooled: bool
    lock_pace: dict[str, float]
    columns_loader: ColumnLoader

    def take_queued(self, accept: Callable[[Attempt], bool], limit: int) -> list[Settling]: ...
    def working(self) -> AbstractContextManager[None]: ...
    def admit(self, attempt: Attempt) -> Outcome | None: ...
    def handle(
        self,
        attempt: Attempt,
        task: Task[Any],
        ctx: JobContext,
        check: Callable[[], object] | None = None,
    ) -> Any: ...
    def await_handler(self, attempt: Attempt, awaitable: Awaitable[_T]) -> _T: ...
    def returned(self, attempt: Attempt, result: Any) -> Any: ...


logger = logging.getLogger("sqla_jobs.worker")

#: A group takes no more attempts once its handlers have taken this long in all (seconds).
WINDOW: Final = 0.015
#: ... or once it is this old (seconds since it began: its handlers and its statements).
AGE: Final = 0.05
#: Attempts in one group at most.
CAP: Final = 200

_ENDED_TRANSACTION: Final = (
    "the handler ended the claim's transaction (commit, rollback or close); a lock-mode "
    "handler must leave it to the worker"
)
_COMMITTED: Final = Outcome(Kind.COMMITTED)


def run(runner: LockHost, first: Attempt, task: Task[Any]) -> Outcome:
    """Run ``first`` (admitted already) and the group that grows from it; returns the
    outcome of ``first`` (the group's other attempts are settled here)."""
    if runner.async_session_factory is not None and inspect.iscoroutinefunction(task.function):
        return runner.await_handler(first, _run_async(runner, first, task))
    return _Group(runner, first).run()


class _Member:
    """One attempt of a group; ``outcome`` stays None while it waits for the commit."""

    __slots__ = ("attempt", "group", "outcome", "result", "savepoint", "settling")

    def __init__(self, group: _Group, attempt: Attempt, settling: Settling | None) -> None:
        self.group = group
        self.attempt = attempt
        self.settling = settling  # None for the group's first attempt (Runner.run's)
        self.outcome: Outcome | None = None
        self.savepoint: SessionTransaction | None = None
        self.result: Any = None

    def enter(self) -> Session:
        """The session, once this attempt's savepoint is set."""
        session = self.group.session
        if self.savepoint is None:
            self.savepoint = session.begin_nested()
        return session

    def load_columns(
        self,
        job: ClaimedJob,
        session: Session | None,
        read: Callable[[ClaimedJob, Session], _T] = job_columns,  # type: ignore[assignment]
    ) -> _T:
        return read(job, self.enter())


@dataclass(frozen=True, slots=True)
class _MemberContext(JobContext):
    """A group member's context: ``session`` sets the member's savepoint on first use."""

    _member: _Member | None = field(default=None, repr=False)

    @property
    def session(self) -> Session:
        assert self._member is not None
        return self._member.enter()


class _Group:
    def __init__(self, runner: LockHost, first: Attempt) -> None:
        self.runner = runner
        self.model = first.job.model
        self.members = [_Member(self, first, None)]
        self.unsaved: list[_Member] = []  # returned without touching the session
        self.backend: tuple[int, float] | None = None
        self.committing = False
        self.session: Session  # set once the group's transaction begins

    def accepts(self, attempt: Attempt) -> bool:
        """Whether a queued attempt may join (called under the runner's lock)."""
        task = attempt.task
        return (
            task is not None
            and task.mode == "lock"
            and attempt.job.model is self.model
            and not (
                self.runner.async_session_factory is not None
                and inspect.iscoroutinefunction(task.function)
            )
        )

    def run(self) -> Outcome:
        with contextlib.ExitStack() as stack:
            try:
                self._transaction(stack)
            except Exception as exc:
                self._failed(exc)
            finally:
                for member in self.members:
                    member.attempt.backend = None
                    if member.outcome is None:  # only if something unforeseen escaped
                        member.outcome = Outcome(Kind.RELEASE, why="its group ended early")
                    if member.settling is not None:
                        member.settling.outcome = member.outcome
        outcome = self.members[0].outcome
        assert outcome is not None
        return outcome

    def _transaction(self, stack: contextlib.ExitStack) -> None:
        runner = self.runner
        with runner.session_factory() as session:
            self.session = session
            self.transaction = session.begin()
            # The worker's own statements run on the session's connection (the same
            # transaction), which takes the driver's fast path (_queries.run.fetch).
            self.executor = as_session(session.connection())
            began = time.monotonic()
            pace = runner.lock_pace
            slowest: dict[str, float] = {}  # by task: its slowest handler in this group
            handlers = 0.0  # the time the group's handlers took in all
            # The first chunk: as many as the window holds at each task's pace (the first
            # attempt alone when its task is slow or not known yet); then twice the last.
            first = self.members[0]
            budget = WINDOW - pace.get(first.attempt.job.task, WINDOW)
            chunk = [first, *self._take(stack, CAP - 1, budget, strict=True)]
            while chunk:
                for member in self._lock(chunk):
                    if member.attempt.cancel_requested:
                        # Requested while it waited for the handlers before it in its chunk.
                        member.outcome = _CANCELLED
                        continue
                    start = time.monotonic()
                    usable = self._run(member)
                    took = time.monotonic() - start
                    handlers += took
                    name = member.attempt.job.task
                    if took > slowest.get(name, 0.0):
                        slowest[name] = took
                        if took > pace.get(name, 0.0):
                            pace[name] = took  # at once: other groups see it too
                    if not usable:
                        # Its transaction is unusable: nothing of the group's commits.
                        _rollback_quietly(session)
                        self._give_back("its transaction ended before its commit")
                        return
                room = CAP - len(self.members)
                if handlers >= WINDOW or time.monotonic() - began >= AGE or room <= 0:
                    break
                chunk = self._take(stack, min(2 * len(chunk), room), WINDOW - handlers)
            for name, took in slowest.items():
                # Quick handlers bring their task's pace down by halves.
                pace[name] = max(took, pace.get(name, took) / 2)
            with runner.working():
                self._commit()

    def _take(
        self, stack: contextlib.ExitStack, limit: int, budget: float, *, strict: bool = False
    ) -> list[_Member]:
        """Up to ``limit`` queued attempts, as members, whose handlers fit in ``budget``
        seconds at their tasks' pace (a task not known yet: :data:`WINDOW`), the first one
        whatever its pace unless ``strict``; those that may not start are settled as
        :meth:`Runner.admit` says and left out of the list (not of the group)."""
        pace = self.runner.lock_pace
        left, free = budget, not strict

        def fits(attempt: Attempt) -> bool:  # called under the runner's lock, in order
            nonlocal left, free
            if not self.accepts(attempt):
                return False
            left -= pace.get(attempt.job.task, WINDOW)
            if free:
                free = False
                return True
            return left >= 0

        taken = []
        for settling in self.runner.take_queued(fits, limit):
            stack.enter_context(settling)
            member = _Member(self, settling.attempt, settling)
            self.members.append(member)
            refused = self.runner.admit(member.attempt)
            if refused is None:
                taken.append(member)
            else:
                member.outcome = refused
        return taken

    def _lock(self, chunk: list[_Member]) -> list[_Member]:
        """Lock the rows of these members' attempts in one statement (fenced by attempt);
        returns the members locked. One taken over is ``lost``: its handler never starts."""
        with self.runner.working():
            # A database error fails the group.
            kept, started = lock_started(self.executor, [m.attempt.job for m in chunk])
            if self.backend is None and started is not None:
                pid = _backend_pid(self.session, ask=self.runner.pooled)
                self.backend = None if pid is None else (pid, started)
        if len(kept) == len(chunk):
            locked = chunk
        else:
            ids = {id(job) for job in kept}
            locked = []
            for member in chunk:
                if id(member.attempt.job) in ids:
                    locked.append(member)
                else:
                    member.outcome = _TAKEN_OVER
        for member in locked:
            member.attempt.backend = self.backend
        return locked

    def _run(self, member: _Member) -> bool:
        """Run and (if it wrote) complete one locked member; False when the group's
        transaction can no longer be used."""
        runner, attempt = self.runner, member.attempt
        job, task = attempt.job, attempt.task
        assert task is not None
        ctx = _MemberContext(
            job,
            runner.worker_name,
            self.session,
            _cancel=attempt,
            _loader=member.load_columns,
            _member=member,
        )
        try:
            # Its hooks (if any) run around this, without the session (sqla_jobs.hooks).
            member.result = runner.handle(attempt, task, ctx, lambda: self._flush(member))
        except BaseException as exc:
            member.outcome = ended_by(exc)
            return self._undo(member)
        if member.savepoint is None:
            self.unsaved.append(member)  # completed with the others, at the end
            return True
        # It wrote: complete it inside its savepoint, so that a cancel or a takeover found
        # now rolls back its writes and nothing else.
        if not self._complete([member]):
            return self._undo(member)
        member.savepoint.commit()
        return True

    def _flush(self, member: _Member) -> None:
        if member.savepoint is not None:
            # Only a handler that asked for the session can have ended the transaction
            # (see "Why the savepoint can wait for the session").
            if not self._open():
                raise ConfigurationError(_ENDED_TRANSACTION)
            # The handler's pending writes: refused ones fail the job like an error raised
            # by the handler itself.
            self.session.flush()

    def _undo(self, member: _Member) -> bool:
        """Roll back what ``member`` did in the transaction; False if that failed or the
        transaction is gone."""
        if not self._open():
            return False
        if member.savepoint is not None:
            try:
                member.savepoint.rollback()
            except Exception as exc:  # a broken connection: the group is given back
                logger.debug("rollback failed: %s", describe(exc))
                return False
        return True

    def _open(self) -> bool:
        return self.session.get_transaction() is self.transaction and self.transaction.is_active

    def _complete(self, members: list[_Member]) -> bool:
        """Complete these members' attempts in the transaction; False if one was not
        completed (its outcome is then set: ``cancel``)."""
        if not members:
            return True
        left = complete(
            self.executor, self.runner.registry, [(m.attempt.job, m.result) for m in members]
        )
        if not left:
            return True
        for member in members:
            if member.attempt.key in left:
                member.outcome = _NOT_COMPLETED
        return False

    def _commit(self) -> None:
        # Those it does not complete (their cancel requested) it leaves untouched: nothing
        # of theirs to undo, no savepoint needed.
        self._complete(self.unsaved)
        self.committing = True
        self.session.commit()
        for member in self.members:
            if member.outcome is None:
                member.outcome = _COMMITTED

    def _give_back(self, why: str) -> None:
        for member in self.members:
            if member.outcome is None:
                member.outcome = Outcome(Kind.RELEASE, why=why)

    def _failed(self, exc: Exception) -> None:
        # The database failed under the group, not a handler: give back every attempt
        # still waiting for the commit (fenced: changes nothing if the commit went through).
        waiting = [m.attempt.job.id for m in self.members if m.outcome is None]
        what = _log_failure(waiting, exc, committing=self.committing)
        self._give_back(what)


def complete(
    executor: Session, registry: Registry, done: list[tuple[ClaimedJob, Any]]
) -> set[tuple[int, int]]:
    """Complete these attempts (with their handlers' results) in ``executor``'s
    transaction, which holds their rows locked (:func:`~sqla_jobs.queue.complete_held`).
    Returns the ``(id, attempt)`` of each it did not complete: its cancel was requested
    (or, fenced out, the job is no longer this attempt's). The caller rolls back that
    attempt's writes, and its outcome is ``cancel``: the outcome writer cancels the job
    once the transaction has ended (fenced: it changes nothing for a job no longer the
    attempt's, and is logged as lost)."""
    result_model = registry.result_model
    stores = result_model is not None or (bool(done) and tables_of(done[0][0].model).keeps_results)
    plain = [job for job, result in done if not (stores and result is not None)]
    valued = [(job, result) for job, result in done if stores and result is not None]
    left = complete_held(executor, plain)
    if valued:
        # The results go into the history rows with the jobs, or into the result model.
        left += complete_held(
            executor,
            [job for job, _ in valued],
            results=[result for _, result in valued],
            result_model=result_model,
        )
    return {(job.id, job.attempt) for job in left}


#: Not completed by the group: cancel requested (or fenced out), for the writer to cancel.
_NOT_COMPLETED: Final = Outcome(
    Kind.CANCEL, why="its completion found its cancel requested or its job taken over"
)
_CANCELLED: Final = Outcome(Kind.CANCEL, why="its cancel was requested")
_TAKEN_OVER: Final = Outcome(Kind.LOST, why="it was taken over before it could be locked")


async def _run_async(runner: LockHost, attempt: Attempt, task: Task[Any]) -> Outcome:
    """One attempt in a transaction of its own, for a coroutine handler with an
    AsyncSession: lock the row, run the handler, complete the job in that transaction and
    commit (the queue functions run through ``run_sync``)."""
    assert runner.async_session_factory is not None
    job = attempt.job
    committing = False
    try:
        async with runner.async_session_factory() as session:
            transaction = await session.begin()
            started = await session.run_sync(lock_one, job)
            if started is None:
                await transaction.rollback()
                return Outcome(Kind.LOST, why="it was taken over before it could be locked")
            pid = await session.run_sync(_backend_pid, ask=runner.pooled)
            attempt.backend = None if pid is None else (pid, started)
            ctx = JobContext(
                job,
                runner.worker_name,
                _async_session=session,
                _cancel=attempt,
                _loader=runner.columns_loader,
            )

            async def handled() -> Any:
                result = runner.returned(attempt, await task.function(ctx))
                if not transaction.is_active or session.get_transaction() is not transaction:
                    raise ConfigurationError(_ENDED_TRANSACTION)
                # The handler's pending writes: refused ones fail the job like an error
                # raised by the handler itself.
                await session.flush()
                return result

            task_hooks = task.hooks
            try:
                if task_hooks is None:
                    result = await handled()
                else:  # in this task, without the session (sqla_jobs.hooks)
                    seen = hook_context(ctx, attempt, runner.columns_loader)
                    result = await around_async(task_hooks, seen, attempt, handled)
            except BaseException as exc:
                try:
                    await session.rollback()
                except Exception as rollback_error:  # the server rolls back for us
                    logger.debug("rollback failed: %s", describe(rollback_error))
                return ended_by(exc)
            left = await session.run_sync(lambda s: complete(s, runner.registry, [(job, result)]))
            if left:  # nothing of the handler's may commit then
                await transaction.rollback()
                return _NOT_COMPLETED
            committing = True
            await transaction.commit()
        return _COMMITTED
    except Exception as exc:
        return _given_back(_log_failure([job.id], exc, committing=committing))
    finally:
        attempt.backend = None


def _given_back(why: str) -> Outcome:
    return Outcome(Kind.RELEASE, why=why)


def _log_failure(job_ids: list[int], exc: Exception, *, committing: bool) -> str:
    what = "its commit failed" if committing else "a database error"
    logger.warning(
        "lock-mode jobs %s: %s (%s); if nothing was committed they are given back",
        job_ids,
        what,
        describe(exc),
        extra={
            "action": "outcome_unknown" if committing else "database_error",
            "job_ids": job_ids,
            "error": describe(exc),
        },
    )
    return what


def _backend_pid(session: Session, *, ask: bool = False) -> int | None:
    # psycopg knows its backend's pid: no query needed (another driver: not known). Behind a
    # pooler it knows the pooler's stand-in instead: ask the server (the transaction stays
    # on one backend).
    if ask:
        (row,) = BACKEND_TRANSACTION.rows(session, None, {})
        return row.pid
    driver: Any = session.connection().connection.driver_connection
    pid = getattr(getattr(driver, "info", None), "backend_pid", None)
    return pid if isinstance(pid, int) else None


def _rollback_quietly(session: Session) -> None:
    try:
        session.rollback()
    except Exception as exc:  # a broken connection: the server rolls back for us
        logger.debug("rollback failed: %s", describe(exc), extra={"action": "database_error"})
