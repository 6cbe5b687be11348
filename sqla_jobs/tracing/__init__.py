"""Trace context from the enqueue to the attempt, when OpenTelemetry is in use.

The core never imports OpenTelemetry. Both hooks first look whether the process has loaded
``opentelemetry.trace`` (one dictionary lookup): an application that traces has, since it
imports the API to configure it or to start a span, and one that does not has no span to
record or export. Only then is :mod:`sqla_jobs.tracing.otel` imported, which builds on the
official ``opentelemetry-api`` package (the ``otel`` extra).

* :func:`enqueue_context` decides what every enqueue path stores in
  :attr:`JobMixin.trace_context <sqla_jobs.JobMixin>`: the mapper's ``before_insert`` hook
  calls it for ``session.add(job)`` and ``Task.enqueue`` (at the flush, once per row), and
  :func:`sqla_jobs.enqueue_many` once per statement; :mod:`sqla_jobs.aio` runs the same
  code. It returns the current span's context as the configured propagator writes it
  (``{"traceparent": ..., "tracestate": ...}``), or None when no span is recording one.
* :func:`attempt_span` is the context manager the worker runs each attempt in: a CONSUMER
  span that continues the job's trace (:mod:`sqla_jobs.tracing.otel` says how).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Final

from sqla_jobs.tracing.protocols import AttemptSpan, TracedJob

__all__ = ["AttemptSpan", "TracedJob", "attempt_span", "enqueue_context"]

#: Loaded by every process that uses OpenTelemetry's tracing API (the SDK imports it too).
_API_MODULE: Final = "opentelemetry.trace"


class _NoSpan:
    """The attempt span when OpenTelemetry is not loaded: does nothing, allocates nothing."""

    __slots__ = ()

    def settled(self, outcome: str, error: str | BaseException | None = None) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


_NO_SPAN: Final = _NoSpan()


def enqueue_context() -> dict[str, str] | None:
    """The trace context to store with a job enqueued now, or None."""
    if _API_MODULE not in sys.modules:
        return None
    from sqla_jobs.tracing import otel

    return otel.enqueue_context()


def attempt_span(job: TracedJob | None) -> AttemptSpan:
    """The span to run ``job``'s attempt in (a no-op unless OpenTelemetry is loaded, and
    for None)."""
    if job is None or _API_MODULE not in sys.modules:
        return _NO_SPAN
    from sqla_jobs.tracing import otel

    return otel.AttemptSpanImpl(job)
