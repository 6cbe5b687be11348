"""Tasks: the names that jobs carry, bound to the functions that run them.

A :class:`Registry` belongs to one job model (the table its jobs live in) and maps task
names to handlers, plain functions or coroutines, each with its options::

    registry = Registry(EmailJob)

    @registry.task(queue="email", max_attempts=5, lease=60)
    def send_receipt(ctx: JobContext) -> None:
        mailer.send(order=ctx.args["order"])

    @registry.task(queue="billing", mode="lock")
    def charge(ctx: JobContext) -> None:
        # lock mode: these writes commit together with the job's completion, or not at all
        ctx.session.add(Payment(order_id=ctx.args["order"]))

    with Session(engine) as session, session.begin():
        session.add(Order(id=7))
        session.add(send_receipt.job({"order": 7}))    # an EmailJob stamped with the options

A worker (:class:`sqla_jobs.worker.Worker`, or ``sqla-jobs worker module:registry``) then
runs them. Every handler takes one argument, a :class:`JobContext`, and may return a
JSON-serialisable value, stored when the registry has a ``result_model``.

The two modes:

``"lease"`` (the default)
    The claim commits the job as running with a lease that the worker heartbeats every
    third of ``lease``. At-least-once: if the worker dies, the job runs again once the
    lease has run out. Handler writes are the handler's own business.
``"lock"``
    The worker counts the attempt in a committed claim, then holds the job's row lock in a
    transaction that the handler writes through (``ctx.session``) and that commits the
    completion: the handler's database writes happen exactly once, together with the
    completion. The transaction stays open while the handler runs; keep lock-mode handlers
    short.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    TypeAlias,
    TypedDict,
    TypeVar,
    overload,
)

from sqla_jobs import validation
from sqla_jobs.context import CancelFlag, ColumnLoader, JobContext
from sqla_jobs.errors import ConfigurationError, InvalidJobError, ScheduleError
from sqla_jobs.hooks import AfterHook, BeforeHook, ErrorHook, Hooks, checked_hooks
from sqla_jobs.periodic import Schedule
from sqla_jobs.policy import RetryPolicy
from sqla_jobs.queue import DEFAULT_LEASE, Enqueued, enqueue_debounced, enqueue_unique
from sqla_jobs.queue.claiming import check_fair_columns
from sqla_jobs.schema import (
    DEFAULT_QUEUE,
    DEFAULT_UNIQUE_STATUSES,
    JobMixin,
    JobResultMixin,
    JobStatus,
    ScheduleMixin,
    job_table_of,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_LEASE",
    "CancelFlag",
    "ColumnLoader",
    "Handler",
    "JobContext",
    "Mode",
    "Registry",
    "Task",
    "TaskOptions",
]

Mode: TypeAlias = Literal["lease", "lock"]

_R = TypeVar("_R")
_B = TypeVar("_B", bound=BeforeHook)
_A = TypeVar("_A", bound=AfterHook)
_E = TypeVar("_E", bound=ErrorHook)
Handler: TypeAlias = Callable[["JobContext"], Any]
"""A task's function: ``def f(ctx: JobContext) -> Any`` or ``async def f(ctx) -> Any``."""


class TaskOptions(TypedDict, total=False):
    """A task's options, declared once: :meth:`Registry.task`, :meth:`Registry.add` and
    :class:`Task` take them as keywords. Each left out, or None, takes the registry's
    default (``Registry(default_queue=..., default_max_attempts=..., default_lease=...,
    default_retry=..., default_mode=...)``); each is checked when the task is registered,
    a bad one raising :class:`~sqla_jobs.errors.ConfigurationError`.

    ``name``
        The name its jobs carry (default: the function's ``__name__``).
    ``queue``
        The queue its jobs go to, unless :meth:`Task.job` says otherwise.
    ``max_attempts``
        How many attempts a job gets, in [1, :data:`~sqla_jobs.validation.MAX_ATTEMPTS_LIMIT`].
    ``mode``
        ``"lease"`` or ``"lock"`` (see :mod:`sqla_jobs.registry`).
    ``lease``
        How long an attempt holds its job between heartbeats (a ``timedelta`` or seconds).
    ``retry``
        The :class:`~sqla_jobs.RetryPolicy` of failed attempts.
    ``priority``
        Its jobs' priority (default 0; lower runs first), unless :meth:`Task.job` says
        otherwise.
    ``schedule``
        A :class:`~sqla_jobs.Schedule` (``cron=`` or ``every=``) makes it a periodic task,
        which every worker of the registry enqueues when a slot is due
        (:mod:`sqla_jobs.periodic`); one that is not a Schedule, or a registry without a
        ``schedule_model`` (unless it uses the default tables), raises
        :class:`~sqla_jobs.errors.ScheduleError` (a ConfigurationError).
    ``key_limit``
        How many of its jobs with one ordering key may be in progress at once (stamped on
        each job that has a key; without it, 1).
    ``time_limit``
        How long one attempt may run (a ``timedelta`` or seconds, at most a week): at the
        limit the attempt fails with a :class:`~sqla_jobs.errors.JobTimeoutError` (retried
        or dead by ``retry`` and ``max_attempts``), a coroutine handler is cancelled, and a
        thread handler is told (``ctx.cancelled``, ``ctx.raise_if_cancelled()``). A job's
        own ``time_limit`` column, when set, takes its place. Default: none.
    ``process``
        True runs the handler in a child process of the worker's pool
        (:mod:`sqla_jobs.worker.processes`): for CPU-bound work, and for a time limit that
        kills (the child is killed at the limit or on a cancel and replaced; a child that
        dies fails only its attempt). Lease mode only, and a plain function the child finds
        by its module and name (defined at the top level of an importable module);
        otherwise :class:`~sqla_jobs.errors.ConfigurationError`. Default: False.
    ``hooks``
        :class:`~sqla_jobs.Hooks` run around this task's handler, inside the registry's
        (:mod:`sqla_jobs.hooks`); anything else raises
        :class:`~sqla_jobs.errors.ConfigurationError`. Default: none of its own.
    """

    name: str | None
    queue: str | None
    max_attempts: int | None
    mode: Mode | None
    lease: timedelta | float | None
    retry: RetryPolicy | None
    priority: int | None
    schedule: Schedule | None
    key_limit: int | None
    time_limit: timedelta | float | None
    hooks: Hooks | None
    process: bool | None


def _check_option_names(options: Mapping[str, object]) -> None:
    for option in options:
        if option not in TaskOptions.__annotations__:
            close = difflib.get_close_matches(option, TaskOptions.__annotations__, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigurationError(f"a task has no option {option!r}{hint}")


#: A task option or a registry default, checked by the rule its job field follows, as
#: configuration (:class:`~sqla_jobs.errors.ConfigurationError`).
_option = validation.as_configuration


class Task(Generic[_R]):
    """A registered task: its name, its options and its function.

    Calling the task calls the function (handy in tests); :meth:`job` builds a job row for
    it and :meth:`enqueue` adds one to a session. Made by :meth:`Registry.task` and
    :meth:`Registry.add`, which register it; its constructor takes the
    :class:`TaskOptions`, and holds their checks and defaults (the registry's).
    """

    def __init__(
        self,
        registry: Registry,
        function: Callable[[JobContext], _R],
        /,
        **options: Unpack[TaskOptions],
    ) -> None:
        # Each option's check, and its default (the registry's), here and only here.
        _check_option_names(options)
        if not callable(function):
            raise ConfigurationError(f"a task must be a function, not {function!r}")
        schedule = options.get("schedule")
        if schedule is not None:
            if not isinstance(schedule, Schedule):
                raise ScheduleError(f"schedule must be a sqla_jobs.Schedule, not {schedule!r}")
            registry.schedule_model  # noqa: B018 (raises now, not in the worker, if there is none)
        lease = options.get("lease")
        max_attempts = options.get("max_attempts")
        priority = options.get("priority")
        self.registry = registry
        self.function = function
        self.name: str = _option(
            validation.check_name, "name", options.get("name") or getattr(function, "__name__", "")
        )
        self.queue: str = _option(
            validation.check_name, "queue", options.get("queue") or registry.default_queue
        )
        self.max_attempts: int = _option(
            validation.check_max_attempts,
            "max_attempts",
            registry.default_max_attempts if max_attempts is None else max_attempts,
        )
        self.mode: Mode = _check_mode(options.get("mode") or registry.default_mode)
        self.lease = (
            registry.default_lease
            if lease is None
            else _option(validation.check_duration, "lease", lease)
        )
        self.retry = options.get("retry") or registry.default_retry
        self.priority: int = _option(
            validation.check_priority, "priority", 0 if priority is None else priority
        )
        #: When the task runs by itself (a periodic task), or None.
        self.schedule = schedule
        key_limit = options.get("key_limit")
        self.key_limit = (
            None
            if key_limit is None
            else _option(validation.check_key_limit, "key_limit", key_limit)
        )
        time_limit = options.get("time_limit")
        #: How long one attempt may run, unless its job has a limit of its own; or None.
        self.time_limit: timedelta | None = (
            None
            if time_limit is None
            else _option(validation.check_time_limit, "time_limit", time_limit)
        )
        self._own_hooks = checked_hooks("hooks", options.get("hooks"))
        #: Whether the handler runs in a child process (see :class:`TaskOptions`).
        self.process: bool = _check_process(function, self.mode, options.get("process"))
        self._hooks_of: Hooks | None = None  # the registry's hooks self._hooks was made with
        self._hooks: Hooks | None = None

    @property
    def hooks(self) -> Hooks | None:
        """The hooks around this task's handler: the registry's, then the task's own
        (:mod:`sqla_jobs.hooks` says in which order they run); None when there are none."""
        registry_hooks = self.registry.hooks
        if self._hooks_of is not registry_hooks:  # the registry's changed (or first use)
            combined = registry_hooks + self._own_hooks
            self._hooks, self._hooks_of = (combined or None), registry_hooks
        return self._hooks

    def __call__(self, ctx: JobContext) -> _R:
        return self.function(ctx)

    def __repr__(self) -> str:
        return (
            f"<Task {self.name!r} queue={self.queue!r} mode={self.mode} "
            f"max_attempts={self.max_attempts} lease={self.lease.total_seconds():g}s>"
        )

    def job(
        self,
        args: Mapping[str, Any] | None = None,
        *,
        run_at: datetime | None = None,
        priority: int | None = None,
        queue: str | None = None,
        ordering_key: str | None = None,
        **columns: Any,
    ) -> JobMixin:
        """A new job row of the registry's model for this task, not yet added to a session.

        ``ordering_key`` (``"customer:42"``) puts the job in line behind the key's other
        jobs: they run one at a time (or up to the task's ``key_limit`` at once), in
        ``(priority, run_at, id)`` order, across all workers. It needs a registry whose
        workers claim keyed jobs (``Registry(..., ordering_keys=True)``, or a task with a
        ``key_limit``), else :class:`~sqla_jobs.errors.ConfigurationError`: such a job would
        never run.

        Carries the task's queue, priority and maximum attempts unless overridden;
        ``columns`` sets the model's own attributes, columns and relationships alike, as
        the model's constructor does: ``send_receipt.job({"order": 7}, order=order)`` ties
        the job to an ``Order`` object (its foreign key is set at flush, and adding the
        job to a session adds the order with it).
        """
        values: dict[str, Any] = {
            "task": self.name,
            "queue": queue or self.queue,
            "args": dict(args or {}),
            "priority": self.priority if priority is None else priority,
            "max_attempts": self.max_attempts,
            **columns,
        }
        if run_at is not None:
            values["run_at"] = run_at
        if ordering_key is not None:
            if not self.registry.ordering_keys:
                raise ConfigurationError(
                    f"task {self.name!r} got an ordering key, but the workers of its registry "
                    "do not claim keyed jobs: create it with Registry(..., ordering_keys=True)"
                )
            values["ordering_key"] = ordering_key
            if self.key_limit is not None:
                values.setdefault("key_limit", self.key_limit)
        return self.registry.model(**values)

    def enqueue(
        self,
        session: Session | AsyncSession,
        args: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> JobMixin:
        """Add a job for this task to ``session``; it exists once the caller commits.

        Same options as :meth:`job`. Never commits: enqueue it in your business
        transaction and it is written if, and only if, that transaction commits. An
        :class:`~sqlalchemy.ext.asyncio.AsyncSession` takes it the same way (``add`` does
        no I/O); its flush reads every column of the job back, so reading them afterwards
        needs no ``await``.
        """
        row = self.job(args, **options)
        session.add(row)
        return row

    def enqueue_unique(
        self,
        session: Session,
        args: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        period: timedelta | float | None = None,
        statuses: Iterable[JobStatus | str] = DEFAULT_UNIQUE_STATUSES,
        **options: Any,
    ) -> Enqueued:
        """Enqueue a job for this task unless one with its unique key exists; see
        :func:`sqla_jobs.enqueue_unique` (the key defaults to the task and ``args``).

        Same options as :meth:`job`. Never aborts the caller's transaction on a duplicate;
        for an :class:`~sqlalchemy.ext.asyncio.AsyncSession`, use
        ``await async_session.run_sync(task.enqueue_unique, args)``.
        """
        row = self.job(args, **options)
        return enqueue_unique(session, row, key=key, period=period, statuses=statuses)

    def enqueue_debounced(
        self,
        session: Session,
        args: Mapping[str, Any] | None = None,
        *,
        window: timedelta | float,
        key: str | None = None,
        max_wait: timedelta | float | None = None,
        **options: Any,
    ) -> Enqueued:
        """Enqueue a job for this task debounced under ``key`` (default: the task's name):
        a burst of enqueues leaves one pending job, run ``window`` after the last one with
        its arguments; see :func:`sqla_jobs.enqueue_debounced`.

        Same options as :meth:`job` (but ``run_at``, which the window sets); for an
        :class:`~sqlalchemy.ext.asyncio.AsyncSession`, use ``await
        async_session.run_sync(task.enqueue_debounced, args, window=5)``.
        """
        row = self.job(args, **options)
        return enqueue_debounced(session, row, window=window, key=key, max_wait=max_wait)


class Registry:
    """Task names bound to handlers, for one job model.

    ``model`` defaults to :class:`sqla_jobs.models.Job` (imported on first use);
    ``result_model`` stores handler return values (``None`` return values are not stored);
    ``schedule_model`` (a :class:`~sqla_jobs.schema.ScheduleMixin` model) records the slots
    of periodic tasks, and is needed only for them (it defaults to
    :class:`sqla_jobs.models.JobSchedule` with the default ``model``).
    it defaults to the model's own ``result_model`` class attribute (declare it once there,
    see :class:`~sqla_jobs.JobMixin`).
    The defaults apply to tasks that do not set the option.
    ``queue_limits`` (``{"emails": 3}``) caps how many jobs of a queue run at once across
    all the registry's workers (:attr:`queue_limits`); ``rate_limits`` (``{"api":
    RateLimit(50)}``) how many start per window (:attr:`rate_limits`; the job table needs
    its rate table, :func:`~sqla_jobs.migrations.create_rate_table`); ``fair_shares``
    (``{"emails": FairShare("tenant_id")}``) shares a queue's claims over its tenants
    (:attr:`fair_shares`; the model needs the column's fair index,
    :func:`~sqla_jobs.schema.fair.fair_index`).
    ``hooks`` (a :class:`~sqla_jobs.Hooks`) run around every task's handler
    (:mod:`sqla_jobs.hooks`; more with :meth:`add_hooks` and the decorators :meth:`before`,
    :meth:`after`, :meth:`on_error`).
    """

    def __init__(
        self,
        model: type[JobMixin] | None = None,
        *,
        result_model: type[JobResultMixin] | None = None,
        default_queue: str = DEFAULT_QUEUE,
        default_max_attempts: int = validation.DEFAULT_MAX_ATTEMPTS,
        default_lease: timedelta | float = DEFAULT_LEASE,
        default_retry: RetryPolicy | None = None,
        default_mode: Mode = "lease",
        schedule_model: type[ScheduleMixin] | None = None,
        ordering_keys: bool = False,
        queue_limits: Mapping[str, int] | None = None,
        rate_limits: Mapping[str, validation.RateLimit] | None = None,
        fair_shares: Mapping[str, validation.FairShare] | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        if model is not None and not _is_job_model(model):
            raise ConfigurationError(f"{model!r} is not a model class that mixes in JobMixin")
        if schedule_model is not None and not _is_schedule_model(schedule_model):
            raise ConfigurationError(
                f"{schedule_model!r} is not a model class that mixes in ScheduleMixin"
            )
        self._model = model
        self._default_model = model is None
        self._schedule_model = schedule_model
        self._result_model = result_model
        self.default_queue: str = _option(validation.check_name, "default_queue", default_queue)
        self.default_max_attempts: int = _option(
            validation.check_max_attempts, "default_max_attempts", default_max_attempts
        )
        self.default_lease: timedelta = _option(
            validation.check_duration, "default_lease", default_lease
        )
        self.default_retry = default_retry or RetryPolicy()
        self.default_mode: Mode = _check_mode(default_mode)
        if not isinstance(ordering_keys, bool):
            raise ConfigurationError(f"ordering_keys must be True or False, not {ordering_keys!r}")
        self._ordering_keys = ordering_keys
        try:
            limits = validation.check_queue_limits("queue_limits", queue_limits)
        except InvalidJobError as exc:
            raise ConfigurationError(f"queue_limits: {exc.reason}") from None
        self._queue_limits: Mapping[str, int] = MappingProxyType(limits)
        try:
            rates = validation.check_rate_limits("rate_limits", rate_limits)
        except InvalidJobError as exc:
            raise ConfigurationError(f"rate_limits: {exc.reason}") from None
        self._rate_limits: Mapping[str, validation.RateLimit] = MappingProxyType(rates)
        try:
            # (The default model's columns are checked by its worker.)
            shares = (
                check_fair_columns(job_table_of(model), fair_shares)
                if model is not None
                else validation.check_fair_shares("fair_shares", fair_shares)
            )
        except InvalidJobError as exc:
            raise ConfigurationError(f"fair_shares: {exc.reason}") from None
        self._fair_shares: Mapping[str, validation.FairShare] = MappingProxyType(shares)
        self._hooks = checked_hooks("hooks", hooks)
        self._tasks: dict[str, Task[Any]] = {}

    @property
    def hooks(self) -> Hooks:
        """The hooks run around every task's handler (``Registry(..., hooks=...)``,
        :meth:`add_hooks`, :meth:`before`, :meth:`after`, :meth:`on_error`), outside each
        task's own; see :mod:`sqla_jobs.hooks`."""
        return self._hooks

    def add_hooks(self, hooks: Hooks) -> None:
        """Add ``hooks`` to every task's, inside those added before (they run after them in
        ``before``, and before them in ``after`` and ``on_error``). Anything but a
        :class:`~sqla_jobs.Hooks` raises :class:`~sqla_jobs.errors.ConfigurationError`.
        Applies to tasks registered before and after; add hooks before a worker starts."""
        self._hooks = self._hooks + checked_hooks("hooks", hooks)

    def before(self, hook: _B) -> _B:
        """Decorator: run ``hook(ctx)`` before every task's handler (``def`` or ``async
        def``); see :mod:`sqla_jobs.hooks`. ``add_hooks(Hooks(before=hook))``."""
        if not callable(hook):
            raise ConfigurationError(f"a before hook must be callable, not {hook!r}")
        self.add_hooks(Hooks(before=hook))
        return hook

    def after(self, hook: _A) -> _A:
        """Decorator: run ``hook(ctx, result)`` after every task's handler returned (or
        snoozed); see :mod:`sqla_jobs.hooks`. ``add_hooks(Hooks(after=hook))``."""
        if not callable(hook):
            raise ConfigurationError(f"a after hook must be callable, not {hook!r}")
        self.add_hooks(Hooks(after=hook))
        return hook

    def on_error(self, hook: _E) -> _E:
        """Decorator: run ``hook(ctx, error)`` after every task's handler raised; see
        :mod:`sqla_jobs.hooks`. ``add_hooks(Hooks(on_error=hook))``."""
        if not callable(hook):
            raise ConfigurationError(f"a on_error hook must be callable, not {hook!r}")
        self.add_hooks(Hooks(on_error=hook))
        return hook

    @property
    def result_model(self) -> type[JobResultMixin] | None:
        """Where handler return values are stored; the ``result_model`` given to the
        registry, else the job model's own ``result_model``, else None (not stored)."""
        if self._result_model is not None:
            return self._result_model
        return self.model.result_model

    @result_model.setter
    def result_model(self, value: type[JobResultMixin] | None) -> None:
        self._result_model = value

    @property
    def ordering_keys(self) -> bool:
        """Whether this registry's workers claim jobs that have an ordering key
        (:func:`sqla_jobs.claim` with ``keys=True``): asked for with ``ordering_keys=True``,
        or implied by a task with a ``key_limit``. Off by default, because a keyed claim
        costs one statement more per claim."""
        return self._ordering_keys or any(t.key_limit is not None for t in self._tasks.values())

    @property
    def queue_limits(self) -> Mapping[str, int]:
        """The most jobs of each limited queue that may run at once across all of this
        registry's workers (``Registry(..., queue_limits={"emails": 3})``), passed by the
        workers to every claim (:func:`sqla_jobs.claim` ``queue_limits``). Read-only; empty
        when no queue is limited."""
        return self._queue_limits

    @property
    def rate_limits(self) -> Mapping[str, validation.RateLimit]:
        """How many jobs of each rate-limited queue may start per window across all of this
        registry's workers (``Registry(..., rate_limits={"api": RateLimit(50)})``), passed by
        the workers to every claim (:func:`sqla_jobs.claim` ``rate_limits``). Read-only;
        empty when no queue is rate-limited."""
        return self._rate_limits

    @property
    def fair_shares(self) -> Mapping[str, validation.FairShare]:
        """How each fairly shared queue's claims are spread over its tenants
        (``Registry(..., fair_shares={"emails": FairShare("tenant_id")})``), passed by the
        workers to every claim (:func:`sqla_jobs.claim` ``fair_shares``). Read-only; empty
        when no queue is shared."""
        return self._fair_shares

    @property
    def time_limits(self) -> dict[str, timedelta]:
        """Each task's time limit by task name, for the tasks that have one: what the
        dashboard needs to show a running job's time left
        (``create_app(..., time_limits=registry.time_limits)``)."""
        return {task.name: task.time_limit for task in self if task.time_limit is not None}

    @property
    def model(self) -> type[JobMixin]:
        """The job model whose table this registry's jobs live in."""
        if self._model is None:
            from sqla_jobs.models import Job  # the default tables, only when asked for

            self._model = Job
        return self._model

    @property
    def schedule_model(self) -> type[ScheduleMixin]:
        """The model whose table records the slots of the periodic tasks; raises
        :class:`~sqla_jobs.errors.ScheduleError` when the registry has none."""
        if self._schedule_model is None:
            if not self._default_model:
                raise ScheduleError(
                    "periodic tasks need a table for their slots: pass "
                    "schedule_model=<a ScheduleMixin model> to the Registry"
                )
            from sqla_jobs.models import JobSchedule

            self._schedule_model = JobSchedule
        return self._schedule_model

    @property
    def periodic_tasks(self) -> list[Task[Any]]:
        """The tasks that have a schedule, in registration order."""
        return [task for task in self._tasks.values() if task.schedule is not None]

    @overload
    def task(self, function: Callable[[JobContext], _R], /) -> Task[_R]: ...

    @overload
    def task(
        self, function: None = None, /, **options: Unpack[TaskOptions]
    ) -> Callable[[Callable[[JobContext], _R]], Task[_R]]: ...

    def task(
        self,
        function: Callable[[JobContext], Any] | None = None,
        /,
        **options: Unpack[TaskOptions],
    ) -> Task[Any] | Callable[[Callable[[JobContext], Any]], Task[Any]]:
        """Register a function or coroutine function as a task (a decorator).

        ``@registry.task`` or ``@registry.task(queue=..., max_attempts=..., mode="lock",
        lease=30, retry=RetryPolicy(...), name=..., key_limit=3)``: the options are
        :class:`TaskOptions`, each defaulting to the registry's. A name registered twice
        raises :class:`~sqla_jobs.errors.ConfigurationError`, and so does a bad option, or an
        option no task has, before the function is registered.
        """
        _check_option_names(options)

        def register(fn: Callable[[JobContext], Any]) -> Task[Any]:
            return self.add(fn, **options)

        if function is not None:
            return register(function)
        return register

    def add(
        self,
        function: Callable[[JobContext], Any] | Callable[[JobContext], Awaitable[Any]],
        **options: Unpack[TaskOptions],
    ) -> Task[Any]:
        """Register ``function`` as a task without the decorator syntax; see :meth:`task`."""
        task: Task[Any] = Task(self, function, **options)
        if task.name in self._tasks:
            raise ConfigurationError(f"task {task.name!r} is already registered")
        self._tasks[task.name] = task
        return task

    def get(self, name: str) -> Task[Any] | None:
        """The task registered under ``name``, or None."""
        return self._tasks.get(name)

    def __getitem__(self, name: str) -> Task[Any]:
        return self._tasks[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tasks

    def __iter__(self) -> Iterator[Task[Any]]:
        return iter(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def queues(self) -> list[str]:
        """The queues the registered tasks use, in registration order (or the default)."""
        names = list(dict.fromkeys(task.queue for task in self._tasks.values()))
        return names or [self.default_queue]

    def tasks_in(self, queues: Iterable[str]) -> list[Task[Any]]:
        """The tasks whose queue is one of ``queues``."""
        wanted = set(queues)
        return [task for task in self._tasks.values() if task.queue in wanted]

    def __repr__(self) -> str:
        model = self._model.__name__ if self._model is not None else "sqla_jobs.models.Job"
        return f"<Registry model={model} tasks={sorted(self._tasks)}>"


def _is_schedule_model(model: object) -> bool:
    return isinstance(model, type) and issubclass(model, ScheduleMixin)


def _is_job_model(model: object) -> bool:
    return isinstance(model, type) and issubclass(model, JobMixin)


def _check_process(function: Callable[..., Any], mode: Mode, process: object) -> bool:
    """The ``process`` option: False unless True, and then a function a child process can
    find and a lease-mode task (lock mode writes through the claim's transaction, which
    stays in the worker)."""
    if process is None or process is False:
        return False
    if process is not True:
        raise ConfigurationError(f"process must be True or False, not {process!r}")
    name = getattr(function, "__qualname__", None)
    module = getattr(function, "__module__", None)
    if mode == "lock":
        raise ConfigurationError(
            f"task {name!r}: process=True needs lease mode; a lock-mode handler writes "
            "through the claim's transaction, which a child process cannot share"
        )
    if inspect.iscoroutinefunction(function):
        raise ConfigurationError(
            f"task {name!r}: process=True needs a plain function, not a coroutine function"
        )
    if not isinstance(name, str) or not isinstance(module, str) or "<" in name:
        raise ConfigurationError(
            f"task {name or function!r}: process=True needs a function defined at the top "
            "level of a module, which the child process imports to find it by its module "
            "and name (not a lambda, a nested function or another callable)"
        )
    return True


def _check_mode(mode: object) -> Mode:
    if mode == "lease":
        return "lease"
    if mode == "lock":
        return "lock"
    raise ConfigurationError(f"mode must be 'lease' or 'lock', not {mode!r}")
