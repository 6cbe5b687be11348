"""What a handler receives: :class:`JobContext`, one per attempt, built by the worker.

Its own module because it is the handler's side of the worker (the attempt, the claim's
session in lock mode, the job's own columns, its cancel flag), while :mod:`sqla_jobs.registry`
is the application's side (tasks and their options); the registry re-exports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from sqla_jobs.errors import ConfigurationError, JobCancelledError, JobTimeoutError, SqlaJobsError
from sqla_jobs.queue import ClaimedJob, job_columns
from sqla_jobs.queue.outcomes import store_progress
from sqla_jobs.validation import check_progress, check_snooze_delay
from sqla_jobs.workflows import Workflow, add_steps, dependency_results

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

__all__ = ["PROGRESS_EVERY", "CancelFlag", "ColumnLoader", "JobContext", "Snooze"]

#: How often (seconds) a lock-mode handler's progress is written through its session.
PROGRESS_EVERY: Final = 1.0


class Snooze(SqlaJobsError):
    """Raise it from a handler (or return it) to run the job again after ``delay`` without
    spending an attempt: ``raise Snooze(30)`` or ``return Snooze(timedelta(minutes=5))``.

    The attempt ends with the job pending again at the database's ``now() + delay``; its
    ``max_attempts`` grows by one instead of its attempt count shrinking (every attempt
    keeps a fence of its own), and its ``snoozes`` count by one. A job that snoozed
    :data:`~sqla_jobs.validation.MAX_SNOOZES` times fails the attempt instead, with an error
    that says so. ``delay``: a ``timedelta`` or seconds, positive, at most
    :data:`~sqla_jobs.validation.MAX_SNOOZE_SECONDS`; a bad one raises
    :class:`~sqla_jobs.errors.InvalidJobError` here, in the handler, which fails the
    attempt. In lock mode the handler's writes roll back, as for an error; a cancel
    requested wins over a snooze.
    """

    def __init__(self, delay: timedelta | float) -> None:
        self.delay: timedelta = check_snooze_delay("delay", delay)
        super().__init__(f"snooze for {self.delay.total_seconds():g} seconds")


class CancelFlag(Protocol):
    """The worker's side of a :class:`JobContext` (its attempt): where the context reads
    whether its handler should stop (``cancel_requested`` once the worker heard of a cancel
    request, ``timed_out`` once the attempt ran past its time limit), and leaves the
    progress its handler reports (``progress``, ``progress_at``)."""

    cancel_requested: bool
    timed_out: bool
    progress: dict[str, Any] | None
    progress_at: float


_T = TypeVar("_T")


class ColumnLoader(Protocol):
    """How a :class:`JobContext` reads (or writes) its job's rows: ``read(job, session)``
    in the claim's session in lock mode (``session``, or the worker's own savepoint of it),
    else in a transaction of its own that commits when ``read`` returns. By default
    ``read`` is :func:`~sqla_jobs.queue.job_columns` (``ctx.columns``, read once)."""

    def __call__(
        self,
        job: ClaimedJob,
        session: Session | None,
        read: Callable[[ClaimedJob, Session], _T] = ...,
    ) -> _T: ...


@dataclass(frozen=True, slots=True, init=False)
class JobContext:
    """What a handler receives: the claimed attempt, and in lock mode the claim's session.

    ``job`` is the attempt (a :class:`~sqla_jobs.queue.ClaimedJob`); ``id``, ``args``,
    ``attempt``, ``task`` and ``queue`` are shortcuts to its fields. ``ctx.job.id`` (or
    ``ctx.id``) is the job's id, the same on every attempt: the key to make a side effect
    outside the database idempotent. ``worker`` is the name of the worker running it.

    ``session`` is the :class:`~sqlalchemy.orm.Session` whose transaction holds the job's
    row lock and will commit its completion. Write through it; never commit, roll back or
    close it (the worker does). Asking for it in lease mode raises
    :class:`~sqla_jobs.errors.ConfigurationError`. A coroutine handler in lock mode, run by
    a worker given an ``async_session_factory``, gets ``async_session`` instead: an
    :class:`~sqlalchemy.ext.asyncio.AsyncSession` holding the lock, with the same rules.

    ``columns`` holds the values of the job model's own columns (those you added to your
    :class:`~sqla_jobs.JobMixin` subclass, such as ``order_id``), by column name, read
    with one query the first time it is asked for (through ``session`` in lock mode, so
    under the job's row lock), never when it is not: a handler that does not ask pays
    nothing.

    ``cancelled`` turns true once :func:`sqla_jobs.cancel` asked for this running job to
    stop and the worker heard of it (within about a second, by a notification; at the next
    heartbeat otherwise); :meth:`raise_if_cancelled` raises
    :class:`~sqla_jobs.errors.JobCancelledError` then. A coroutine handler is cancelled
    instead (``asyncio.CancelledError`` at its current ``await``). Either way the job ends
    ``cancelled``, and a handler that ignores the request and returns ends cancelled too
    (its result is not stored): check it between steps of a long thread handler.
    """

    job: ClaimedJob
    worker: str
    _session: Session | None = field(default=None, repr=False)
    _async_session: AsyncSession | None = field(default=None, repr=False)
    _cancel: CancelFlag | None = field(default=None, repr=False)
    _loader: ColumnLoader | None = field(default=None, repr=False)
    _columns: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def __init__(
        self,
        job: ClaimedJob,
        worker: str,
        _session: Session | None = None,
        _async_session: AsyncSession | None = None,
        _cancel: CancelFlag | None = None,
        _loader: ColumnLoader | None = None,
        _columns: dict[str, Any] | None = None,
    ) -> None:
        # The dataclass's own __init__ for a frozen class, but through the slots' setters
        # bound once (_SET_*) instead of object.__setattr__ by name: a worker builds one
        # context per job, and this costs it half as much.
        _SET_JOB(self, job)
        _SET_WORKER(self, worker)
        _SET_SESSION(self, _session)
        _SET_ASYNC_SESSION(self, _async_session)
        _SET_CANCEL(self, _cancel)
        _SET_LOADER(self, _loader)
        _SET_COLUMNS(self, _columns)

    @property
    def cancelled(self) -> bool:
        """Whether the handler should stop: this job's cancel was requested, or the attempt
        ran past its time limit (see the class docstring)."""
        flag = self._cancel
        return flag is not None and (flag.cancel_requested or flag.timed_out)

    def raise_if_cancelled(self) -> None:
        """Raise :class:`~sqla_jobs.errors.JobCancelledError` if this job's cancel was
        requested, :class:`~sqla_jobs.errors.JobTimeoutError` if the attempt ran past its
        time limit; call it between the steps of a long handler and let it propagate."""
        flag = self._cancel
        if flag is None:
            return
        if flag.cancel_requested:
            raise JobCancelledError(f"job {self.job.id} was cancelled while it ran")
        if flag.timed_out:
            raise JobTimeoutError(
                f"job {self.job.id} attempt {self.job.attempt} ran past its time limit"
            )

    def report_progress(self, value: float, message: str = "") -> None:
        """Report this attempt's progress: ``value`` a number (a fraction done, a count: yours
        to choose), ``message`` a short text (at most
        :data:`~sqla_jobs.validation.MAX_PROGRESS_MESSAGE` characters). Cheap to call often:
        nothing is written per call. In lease mode the latest report is stored in the job's
        ``progress`` column with the worker's next heartbeat (every third of the lease) and
        with the attempt's outcome; in lock mode it is written through :attr:`session`, at
        most once a second, and seen by others when the job's transaction commits (a
        coroutine handler with an AsyncSession: kept in the worker only). The column keeps
        the last report once the job ends (``{"value", "message", "at"}``, ``at`` in
        database time). A bad value or message raises
        :class:`~sqla_jobs.errors.InvalidJobError`.
        """
        report = check_progress(value, message)
        flag = self._cancel
        if flag is None:
            return  # a context built by hand (a test): no worker to report to
        flag.progress = report
        session = self._session
        if session is not None:
            now = time.monotonic()
            if now - flag.progress_at >= PROGRESS_EVERY:
                flag.progress_at = now
                store_progress(session, [(self.job, report)])

    @property
    def columns(self) -> dict[str, Any]:
        """The job row's own columns (not the mixin's), by name; read once, when first
        asked for. Empty for a model without columns of its own."""
        columns = self._columns
        if columns is None:
            loader = self._loader or job_columns
            columns = loader(self.job, self._session)
            object.__setattr__(self, "_columns", columns)
        return columns

    def dependency_results(self) -> dict[str, Any]:
        """The results of this workflow step's dependencies, by step name (see
        :func:`sqla_jobs.dependency_results`): read through :attr:`session` in lock mode,
        else in a transaction of its own."""
        return self._in_session(lambda job, session: dependency_results(session, job))

    def add_steps(
        self, flow: Workflow, *, then: Iterable[str] = (), exist_ok: bool = False
    ) -> dict[str, int]:
        """Add ``flow``'s steps to this step's workflow (see :func:`sqla_jobs.add_steps`):
        they run after this step succeeded, and the steps named in ``then`` wait for them
        too. In lock mode through :attr:`session` (they exist if this job's transaction
        commits); in lease mode in a transaction of its own, fenced by this attempt
        (:class:`~sqla_jobs.errors.LeaseLostError` once it lost the job). Returns each new
        step's job id by name. ``exist_ok=True`` makes a retried attempt find the steps an
        earlier attempt added instead of refusing them (see :func:`sqla_jobs.add_steps`)."""
        names = tuple(then)

        def write(job: ClaimedJob, session: Session) -> dict[str, int]:
            return add_steps(session, job, flow, then=names, exist_ok=exist_ok)

        return self._in_session(write)

    def _in_session(self, read: Callable[[ClaimedJob, Session], _T]) -> _T:
        loader = self._loader
        if loader is not None:
            return loader(self.job, self._session, read)
        if self._session is None:
            raise ConfigurationError("this context has no session to read or write through")
        return read(self.job, self._session)

    @property
    def id(self) -> int:
        return self.job.id

    @property
    def args(self) -> dict[str, Any]:
        return self.job.args

    @property
    def attempt(self) -> int:
        return self.job.attempt

    @property
    def task(self) -> str:
        return self.job.task

    @property
    def queue(self) -> str:
        return self.job.queue

    @property
    def session(self) -> Session:
        if self._session is None:
            raise ConfigurationError(self._no_session("session", "async_session"))
        return self._session

    @property
    def async_session(self) -> AsyncSession:
        if self._async_session is None:
            raise ConfigurationError(self._no_session("async_session", "session"))
        return self._async_session

    def _no_session(self, asked: str, other: str) -> str:
        if self._session is None and self._async_session is None:
            return (
                f"task {self.job.task!r} runs in lease mode and has no claim session; "
                "register it with mode='lock' to write through the claim's transaction"
            )
        return (
            f"task {self.job.task!r} has ctx.{other}, not ctx.{asked}: a coroutine handler in "
            "lock mode gets an AsyncSession when the worker has an async_session_factory"
        )


_SET_JOB: Final = JobContext.__dict__["job"].__set__
_SET_WORKER: Final = JobContext.__dict__["worker"].__set__
_SET_SESSION: Final = JobContext.__dict__["_session"].__set__
_SET_ASYNC_SESSION: Final = JobContext.__dict__["_async_session"].__set__
_SET_CANCEL: Final = JobContext.__dict__["_cancel"].__set__
_SET_LOADER: Final = JobContext.__dict__["_loader"].__set__
_SET_COLUMNS: Final = JobContext.__dict__["_columns"].__set__
