"""The OpenTelemetry side of :mod:`sqla_jobs.tracing`, imported only once the application has
loaded OpenTelemetry's API (install it with the ``otel`` extra).

The enqueue. The job stores the context of the span current when it is enqueued, as the
globally configured propagator writes it (W3C ``traceparent`` and ``tracestate`` by default,
and ``baggage``). No span of its own is started for it: the enqueue is an INSERT in the
caller's transaction, which database instrumentation already shows as a span; a PRODUCER
span per job would cost a span per row of a bulk enqueue, and could not cover the INSERT
(the context is taken while the flush builds it).

The attempt. Each attempt runs in a span of kind CONSUMER named ``process <task>``, current
while the handler runs (spans the handler starts are its children). Following the
messaging conventions for a message processed on its own, it is the *child* of the stored
context, so the trace of the request that enqueued the job goes on into the job (and into
its retries: each attempt is another child), and it also *links* to that context, as the
conventions require of every process span. A job enqueued without a span is processed in
a new trace. Attributes: ``messaging.system`` (``sqla_jobs``),
``messaging.operation.type`` and ``messaging.operation.name`` (``process``),
``messaging.destination.name`` (the queue), ``messaging.message.id`` (the job id), and
``sqla_jobs.job.id``, ``.task``, ``.queue``, ``.attempt``, ``.max_attempts``; at the end
``sqla_jobs.job.outcome``. A failed attempt records its exception as an event, sets
``error.type`` and the span's status to error.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import context, propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from sqla_jobs.events import describe

if TYPE_CHECKING:
    from sqla_jobs.tracing.protocols import TracedJob

__all__ = ["SYSTEM", "AttemptSpanImpl", "enqueue_context"]

#: ``messaging.system`` of every span sqla_jobs starts.
SYSTEM: Final = "sqla_jobs"

# A ProxyTracer until the application sets its tracer provider, then that provider's.
_tracer = trace.get_tracer("sqla_jobs", "0.1.0")


def enqueue_context() -> dict[str, str] | None:
    """The current span's context as the propagator's carrier, or None without a span."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


def _carrier(stored: dict[Any, Any]) -> bool:
    return all(type(key) is str and type(value) is str for key, value in stored.items())


class AttemptSpanImpl:
    """The CONSUMER span of one attempt (see the module docstring), current inside ``with``."""

    __slots__ = ("_job", "_span", "_token")

    def __init__(self, job: TracedJob) -> None:
        self._job = job
        self._span: trace.Span = trace.INVALID_SPAN
        self._token: object = None

    def __enter__(self) -> AttemptSpanImpl:
        job = self._job
        stored: object = job.trace_context  # whatever the row holds
        parent = None
        links: list[Link] = []
        # Only a mapping of strings is a carrier: the column may hold anything another
        # program wrote, and a malformed carrier is ignored (a new trace), as propagators
        # ignore malformed headers.
        if stored and isinstance(stored, dict) and _carrier(stored):
            parent = propagate.extract(stored)
            enqueued = trace.get_current_span(parent).get_span_context()
            if enqueued.is_valid:
                links.append(Link(enqueued))
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": job.queue,
            "messaging.message.id": str(job.id),
            "sqla_jobs.job.id": job.id,
            "sqla_jobs.job.task": job.task,
            "sqla_jobs.job.queue": job.queue,
            "sqla_jobs.job.attempt": job.attempt,
            "sqla_jobs.job.max_attempts": job.max_attempts,
        }
        # The exception is recorded here (in __exit__), once, with the job's context.
        self._span = _tracer.start_span(
            f"process {job.task}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
            record_exception=False,
            set_status_on_exception=False,
        )
        # The stored context (its baggage too) with the attempt's span, for the handler.
        self._token = context.attach(trace.set_span_in_context(self._span, parent))
        return self

    def settled(self, outcome: str, error: str | BaseException | None = None) -> None:
        self._span.set_attribute("sqla_jobs.job.outcome", outcome)
        if outcome == "fail" and error is not None:
            self._failed(error)

    def _failed(self, error: str | BaseException) -> None:
        span = self._span
        if isinstance(error, BaseException):
            span.record_exception(error)
            kind = type(error)
            span.set_attribute("error.type", f"{kind.__module__}.{kind.__qualname__}")
        else:
            span.set_attribute("error.type", "_OTHER")
        text = error if isinstance(error, str) else describe(error)
        span.set_status(Status(StatusCode.ERROR, text or None))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if exc is not None:
                self._span.set_attribute("sqla_jobs.job.outcome", "fail")
                self._failed(exc)
        finally:
            context.detach(self._token)  # type: ignore[arg-type]
            self._span.end()
