"""Hooks around a job's handler: ``before(ctx)``, ``after(ctx, result)`` and
``on_error(ctx, error)``, registered on the :class:`~sqla_jobs.Registry` (every task's) or on
one task (its ``hooks`` option)::

    @registry.before
    def bind_tenant(ctx: JobContext) -> None:
        tenant.set(ctx.args.get("tenant"))

    @registry.on_error
    async def page_someone(ctx: JobContext, error: BaseException) -> None:
        await pager.send(f"job {ctx.id} ({ctx.task}) failed: {error!r}")

    @registry.task(hooks=Hooks(after=count_receipt))
    def send_receipt(ctx: JobContext) -> None: ...

When they run, for each attempt whose handler starts:

* ``before(ctx)`` right before the handler is called;
* then exactly one of ``after(ctx, result)`` (the handler returned a result the worker
  accepts; or it asked for a :class:`~sqla_jobs.Snooze`, raised or returned, which is then the
  ``result``) and ``on_error(ctx, error)`` (the handler raised; or its return was refused:
  past its time limit, a result that cannot be stored, a lock-mode handler's writes refused
  at their flush). A coroutine handler the worker cancelled at its time limit gives
  ``on_error`` a :class:`~sqla_jobs.errors.JobTimeoutError` (the ``asyncio.CancelledError``
  is its ``__cause__``); one cancelled because its job's cancel was requested gives the
  ``asyncio.CancelledError`` itself.

Order: the ``before`` hooks run registry-wide ones first, then the task's, each in the order
they were added; ``after`` and ``on_error`` hooks run in the reverse order, so hooks nest
like ``with`` blocks: the first one added is the outermost (a registry-wide hook that opens
something in ``before`` closes it after the task's hooks have run).

Where: a thread handler's hooks run on its handler thread, in the same context (context
variables a ``before`` hook sets are the handler's); a coroutine hook around a thread handler
runs on the worker's event loop while the handler thread waits for it, in a copy of that
context (what it sets is not seen by the handler). A coroutine handler's hooks (a task whose
function is ``async def``) all run in the handler's own asyncio task on the event loop,
before and after it: coroutine hooks are awaited there, plain ones called there (keep them
quick: they hold up the loop).

A hook that raises an :class:`Exception` is logged (logger ``sqla_jobs.worker``, action
``hook_failed``, with the job's id) and ignored: the next hooks run, and the job's outcome is
what its handler did. Hooks observe; they cannot change an outcome (a cancel requested still
ends the job cancelled whatever they saw). Their time counts toward the attempt's time
limit; keep them quick.

In lock mode the hooks run while the job's transaction is open and holds its row lock, right
around the handler, but they do not take part in it: their context has no session
(``ctx.session`` raises :class:`~sqla_jobs.errors.ConfigurationError`), so a hook can neither
write into the job's transaction nor abort it. ``after`` runs before that transaction
commits: a commit that fails gives the job back, and it runs again.

Hooks belong to workers: :func:`sqla_jobs.testing.run_inline` and calling a task directly
run the handler alone.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar

from sqla_jobs.context import CancelFlag, ColumnLoader, JobContext, Snooze
from sqla_jobs.errors import ConfigurationError, JobTimeoutError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

__all__ = ["AfterHook", "BeforeHook", "ErrorHook", "Hooks"]

BeforeHook: TypeAlias = Callable[[JobContext], object]
"""``def before(ctx: JobContext) -> None`` or ``async def before(ctx) -> None``."""
AfterHook: TypeAlias = Callable[[JobContext, Any], object]
"""``def after(ctx: JobContext, result: Any) -> None``, or ``async def``."""
ErrorHook: TypeAlias = Callable[[JobContext, BaseException], object]
"""``def on_error(ctx: JobContext, error: BaseException) -> None``, or ``async def``."""

_T = TypeVar("_T")

logger = logging.getLogger("sqla_jobs.worker")


def _checked(kind: str, given: object) -> tuple[Any, ...]:
    if given is None:
        return ()
    if callable(given):
        return (given,)
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise ConfigurationError(
            f"{kind} must be a function, a coroutine function or a list of them, not {given!r}"
        )
    hooks = tuple(given)
    for hook in hooks:
        if not callable(hook):
            raise ConfigurationError(f"a {kind} hook must be callable, not {hook!r}")
    return hooks


class Hooks:
    """Hooks to run around handlers (see :mod:`sqla_jobs.hooks`): ``before``, ``after`` and
    ``on_error``, each a function, a coroutine function, or a list of them (run in order).

    ``Registry(..., hooks=Hooks(...))`` or :meth:`Registry.add_hooks
    <sqla_jobs.Registry.add_hooks>` apply them to every task of the registry, the ``hooks``
    task option to one task. Anything that is not callable raises
    :class:`~sqla_jobs.errors.ConfigurationError` here, before a job runs. ``a + b``: the
    hooks of both, ``a``'s outside ``b``'s. Immutable.
    """

    __slots__ = ("after", "before", "on_error")

    before: tuple[BeforeHook, ...]
    after: tuple[AfterHook, ...]
    on_error: tuple[ErrorHook, ...]

    def __init__(
        self,
        *,
        before: BeforeHook | Iterable[BeforeHook] | None = None,
        after: AfterHook | Iterable[AfterHook] | None = None,
        on_error: ErrorHook | Iterable[ErrorHook] | None = None,
    ) -> None:
        object.__setattr__(self, "before", _checked("before", before))
        object.__setattr__(self, "after", _checked("after", after))
        object.__setattr__(self, "on_error", _checked("on_error", on_error))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Hooks are immutable: cannot set {name!r}")

    def __add__(self, other: Hooks) -> Hooks:
        if not isinstance(other, Hooks):
            return NotImplemented
        return Hooks(
            before=self.before + other.before,
            after=self.after + other.after,
            on_error=self.on_error + other.on_error,
        )

    def __bool__(self) -> bool:
        return bool(self.before or self.after or self.on_error)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Hooks):
            return NotImplemented
        return (self.before, self.after, self.on_error) == (
            other.before,
            other.after,
            other.on_error,
        )

    def __hash__(self) -> int:
        return hash((self.before, self.after, self.on_error))

    def __repr__(self) -> str:
        def names(hooks: tuple[Callable[..., object], ...]) -> list[str]:
            return [getattr(hook, "__qualname__", repr(hook)) for hook in hooks]

        return (
            f"Hooks(before={names(self.before)}, after={names(self.after)}, "
            f"on_error={names(self.on_error)})"
        )


#: No hooks.
NO_HOOKS: Final = Hooks()


def checked_hooks(name: str, hooks: object) -> Hooks:
    """``hooks`` if it is a :class:`Hooks` (None: :data:`NO_HOOKS`), else a
    :class:`~sqla_jobs.errors.ConfigurationError` naming ``name``."""
    if hooks is None:
        return NO_HOOKS
    if not isinstance(hooks, Hooks):
        raise ConfigurationError(f"{name} must be a sqla_jobs.Hooks, not {hooks!r}")
    return hooks


# -- the worker's side ------------------------------------------------------------------------


class _HookContext(JobContext):
    """The context hooks get: the handler's, without a session (see the module docstring)."""

    __slots__ = ()

    @property
    def session(self) -> Session:
        raise ConfigurationError(_NO_SESSION)

    @property
    def async_session(self) -> AsyncSession:
        raise ConfigurationError(_NO_SESSION)


_NO_SESSION: Final = (
    "a hook has no session: hooks run around the handler, outside its transaction (only the "
    "handler of a lock-mode task writes through ctx.session)"
)


def hook_context(ctx: JobContext, flag: CancelFlag, loader: ColumnLoader) -> JobContext:
    """The context ``ctx``'s hooks get: its job and worker, its cancel flag, no session;
    ``ctx.columns`` read through ``loader`` (a session of its own)."""
    return _HookContext(ctx.job, ctx.worker, _cancel=flag, _loader=loader)


def _error_of(error: BaseException, flag: CancelFlag) -> BaseException:
    if isinstance(error, asyncio.CancelledError) and flag.timed_out and not flag.cancel_requested:
        timeout = JobTimeoutError("the coroutine handler was cancelled at its time limit")
        timeout.__cause__ = error
        return timeout
    return error


def _failed(ctx: JobContext, kind: str, hook: object) -> None:
    job = ctx.job
    name = getattr(hook, "__qualname__", None) or repr(hook)
    logger.error(
        "job %d: its %s hook %s raised; ignored (a hook does not change the job's outcome)",
        job.id,
        kind,
        name,
        exc_info=True,
        extra={
            "action": "hook_failed",
            "job_id": job.id,
            "task": job.task,
            "queue": job.queue,
            "attempt": job.attempt,
            "hook": kind,
            "hook_name": name,
        },
    )


def _call(
    kind: str,
    hook: Callable[..., object],
    ctx: JobContext,
    args: tuple[Any, ...],
    on_loop: Callable[[Awaitable[Any]], object],
) -> None:
    try:
        value = hook(*args)
        if value is not None and inspect.isawaitable(value):
            on_loop(value)
    except Exception:
        _failed(ctx, kind, hook)


def around(
    hooks: Hooks,
    ctx: JobContext,
    flag: CancelFlag,
    call: Callable[[], _T],
    on_loop: Callable[[Awaitable[Any]], object],
) -> _T:
    """``call()`` (a thread handler, and the worker's checks of what it returned) with
    ``hooks`` around it, on this thread; ``on_loop`` runs a coroutine hook to its end on the
    worker's event loop. Returns or raises what ``call`` did."""
    for hook in hooks.before:
        _call("before", hook, ctx, (ctx,), on_loop)
    try:
        result = call()
    except BaseException as exc:
        if isinstance(exc, Snooze):
            for after in reversed(hooks.after):
                _call("after", after, ctx, (ctx, exc), on_loop)
        else:
            error = _error_of(exc, flag)
            for on_error in reversed(hooks.on_error):
                _call("on_error", on_error, ctx, (ctx, error), on_loop)
        raise
    for after in reversed(hooks.after):
        _call("after", after, ctx, (ctx, result), on_loop)
    return result


async def _acall(
    kind: str, hook: Callable[..., object], ctx: JobContext, args: tuple[Any, ...]
) -> None:
    try:
        value = hook(*args)
        if value is not None and inspect.isawaitable(value):
            await value
    except Exception:
        _failed(ctx, kind, hook)


async def around_async(
    hooks: Hooks, ctx: JobContext, flag: CancelFlag, call: Callable[[], Awaitable[_T]]
) -> _T:
    """``await call()`` (a coroutine handler, and the worker's checks of what it returned)
    with ``hooks`` around it, all in the current asyncio task."""
    for hook in hooks.before:
        await _acall("before", hook, ctx, (ctx,))
    try:
        result = await call()
    except BaseException as exc:
        if isinstance(exc, Snooze):
            for after in reversed(hooks.after):
                await _acall("after", after, ctx, (ctx, exc))
        else:
            error = _error_of(exc, flag)
            for on_error in reversed(hooks.on_error):
                await _acall("on_error", on_error, ctx, (ctx, error))
        raise
    for after in reversed(hooks.after):
        await _acall("after", after, ctx, (ctx, result))
    return result
