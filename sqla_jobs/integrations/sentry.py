"""Sentry for failed attempts, on the official ``sentry-sdk`` (install the ``sentry`` extra).

Add its :class:`~sqla_jobs.Hooks` to a registry, and initialise Sentry in the worker's
process as you do in the rest of your application::

    import sentry_sdk
    from sqla_jobs.integrations.sentry import sentry_hooks

    sentry_sdk.init(dsn="https://...")
    registry = Registry(EmailJob, hooks=sentry_hooks())  # or registry.add_hooks(sentry_hooks())

Around each attempt whose handler starts (:mod:`sqla_jobs.hooks`):

``before``
    An isolation scope of the attempt's own, so that tags and breadcrumbs do not leak from
    one job to the next on a handler thread, with the tags ``sqla_jobs.job.id``,
    ``sqla_jobs.job.task``, ``sqla_jobs.job.queue`` and ``sqla_jobs.job.attempt`` and a
    ``sqla_jobs`` context (the worker's name, ``max_attempts``). The trace is continued:
    from the worker's current OpenTelemetry span when there is one (the attempt's span,
    :mod:`sqla_jobs.tracing`, itself a child of the context stored at the enqueue), else
    from the context the job stored (:attr:`JobMixin.trace_context <sqla_jobs.JobMixin>`);
    a W3C ``traceparent`` is read as Sentry's ``sentry-trace``, and a stored ``sentry-trace``
    and ``baggage`` as they are. In it a transaction ``process <task>`` (op
    ``queue.process``) starts, which Sentry sends if your ``traces_sample_rate`` samples it;
    whatever the handler reports to Sentry carries the tags and the trace.
``on_error``
    The error is captured, once per failed attempt, with those tags, in that trace; the
    transaction's status is ``internal_error``. Not captured: a cancel
    (:class:`~sqla_jobs.errors.JobCancelledError`, or ``asyncio.CancelledError`` for a
    coroutine cancelled because its job's cancel was requested); a coroutine cancelled at its
    time limit is captured as the :class:`~sqla_jobs.errors.JobTimeoutError` it is.
``after``
    The transaction's status is ``ok`` (a snooze included); it ends, and so does the scope.

The worker logs a dead job at ERROR (action ``job_dead``), which Sentry's logging
integration (on by default) would send as a second event for an attempt already captured:
:func:`sentry_hooks` adds an event processor to Sentry's global scope that drops that log
event for an attempt it captured, and only for one. A failure no handler reaches (an unknown
task, an unreadable row) is left to the logging integration; a thread handler still running
past its time limit is captured when it returns.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import re
import threading
from contextlib import AbstractContextManager
from typing import Any, Final

import sentry_sdk

from sqla_jobs import tracing
from sqla_jobs.context import JobContext
from sqla_jobs.errors import JobCancelledError
from sqla_jobs.hooks import Hooks

__all__ = ["sentry_hooks"]

#: ``traceparent`` as W3C trace context writes it: version, trace id, parent id, flags.
_TRACEPARENT: Final = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
#: How many captured attempts are remembered to drop the worker's log event of each.
_REMEMBERED: Final = 10_000


class _Open:
    """An attempt's open scope and transaction, between its before and after hooks."""

    __slots__ = ("key", "scope", "token", "transaction")

    def __init__(
        self, key: tuple[int, int], scope: AbstractContextManager[Any], transaction: Any
    ) -> None:
        self.key = key
        self.scope = scope
        self.transaction = transaction
        self.token: contextvars.Token[_Open | None] | None = None


_open: contextvars.ContextVar[_Open | None] = contextvars.ContextVar(
    "sqla_jobs_sentry_attempt", default=None
)
_captured: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
_captured_lock = threading.Lock()
_installed = False
_install_lock = threading.Lock()


def sentry_hooks() -> Hooks:
    """The hooks that report a registry's failed attempts to Sentry (see the module)."""
    global _installed
    with _install_lock:
        if not _installed:
            sentry_sdk.scope.add_global_event_processor(_drop_logged_duplicate)
            _installed = True
    return Hooks(before=_before, after=_after, on_error=_on_error)


def _tags(ctx: JobContext) -> dict[str, str]:
    return {
        "sqla_jobs.job.id": str(ctx.id),
        "sqla_jobs.job.task": ctx.task,
        "sqla_jobs.job.queue": ctx.queue,
        "sqla_jobs.job.attempt": str(ctx.attempt),
    }


def _describe(scope: sentry_sdk.Scope, ctx: JobContext) -> None:
    for key, value in _tags(ctx).items():
        scope.set_tag(key, value)
    scope.set_context("sqla_jobs", {"worker": ctx.worker, "max_attempts": ctx.job.max_attempts})


def _incoming_headers(carrier: object) -> dict[str, str]:
    """What Sentry continues a trace from (``sentry-trace``, ``baggage``), read from a trace
    context carrier (``traceparent``, ``tracestate``, ``baggage``, or Sentry's own); empty
    when it holds none."""
    if not isinstance(carrier, dict):
        return {}
    headers: dict[str, str] = {}
    sentry_trace = carrier.get("sentry-trace")
    traceparent = carrier.get("traceparent")
    if isinstance(sentry_trace, str) and sentry_trace:
        headers["sentry-trace"] = sentry_trace
    elif isinstance(traceparent, str):
        match = _TRACEPARENT.match(traceparent.strip().lower())
        if match is not None:
            trace_id, span_id, flags = match.groups()
            # Sampled: say so; not sampled (an application that does not record spans): let
            # Sentry decide, rather than never sampling the attempt's transaction.
            sampled = "-1" if int(flags, 16) & 1 else ""
            headers["sentry-trace"] = f"{trace_id}-{span_id}{sampled}"
    baggage = carrier.get("baggage")
    if headers and isinstance(baggage, str) and baggage:
        headers["baggage"] = baggage
    return headers


def _before(ctx: JobContext) -> None:
    scope_manager = sentry_sdk.isolation_scope()
    scope = scope_manager.__enter__()
    try:
        _describe(scope, ctx)
        # The worker's trace: its current span (the attempt's), else the job's stored one.
        carrier = tracing.enqueue_context() or ctx.job.trace_context
        transaction = sentry_sdk.continue_trace(
            _incoming_headers(carrier),
            op="queue.process",
            name=f"process {ctx.task}",
            source="task",
        )
        started = sentry_sdk.start_transaction(transaction)
        started.__enter__()
    except BaseException:
        scope_manager.__exit__(None, None, None)
        raise
    state = _Open((ctx.id, ctx.attempt), scope_manager, started)
    state.token = _open.set(state)


def _opened(ctx: JobContext) -> _Open | None:
    """The attempt's open scope and transaction (opened by its before hook), or None."""
    state = _open.get()
    return state if state is not None and state.key == (ctx.id, ctx.attempt) else None


def _end(state: _Open, status: str) -> None:
    try:
        state.transaction.set_status(status)
        state.transaction.__exit__(None, None, None)
    finally:
        if state.token is not None:
            _open.reset(state.token)
        state.scope.__exit__(None, None, None)


def _after(ctx: JobContext, result: Any) -> None:
    state = _opened(ctx)
    if state is not None:
        _end(state, "ok")


def _on_error(ctx: JobContext, error: BaseException) -> None:
    state = _opened(ctx)
    try:
        if isinstance(error, (JobCancelledError, asyncio.CancelledError)):
            return  # a cancel, not a failure
        if state is None:  # its before hook did not run: a scope for the event alone
            with sentry_sdk.isolation_scope() as scope:
                _describe(scope, ctx)
                _capture(ctx, error)
        else:  # in the attempt's scope and transaction
            _capture(ctx, error)
    finally:
        if state is not None:
            _end(state, "internal_error")


def _capture(ctx: JobContext, error: BaseException) -> None:
    sentry_sdk.capture_exception(error)
    with _captured_lock:
        _captured[(ctx.id, ctx.attempt)] = None
        while len(_captured) > _REMEMBERED:
            _captured.popitem(last=False)


def _drop_logged_duplicate(event: Any, hint: dict[str, Any]) -> Any:
    # The worker's log line of a failure whose error a hook captured already: not twice.
    record = hint.get("log_record")
    if (
        record is not None
        and record.name == "sqla_jobs.worker"
        and getattr(record, "action", None) in ("job_dead", "job_failed")
    ):
        key = (getattr(record, "job_id", None), getattr(record, "attempt", None))
        with _captured_lock:
            if key in _captured:
                del _captured[key]  # type: ignore[arg-type]
                return None
    return event
