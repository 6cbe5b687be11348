"""The traced worker's entry point: ``sqla-jobs worker trace_worker:registry``.

Importing it configures the OpenTelemetry SDK in the worker process, as an application
would: a tracer provider whose spans end in the SDK's ``InMemorySpanExporter``. After each
span ends, every finished span so far is written to ``spans.json`` in the working directory
(replaced atomically), which the test reads. Tasks make spans of their own, so that the test
sees whether the attempt's span is current while the handler runs.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin, RetryPolicy
from sqla_jobs.registry import JobContext, Registry

SPANS_FILE = "spans.json"
QUEUE = "traced"
FAST_RETRY = RetryPolicy(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=100))


class Base(DeclarativeBase):
    pass


class TracedJob(JobMixin, Base):
    __tablename__ = "traced_jobs"


class _WritingProcessor(SimpleSpanProcessor):
    """Exports each span to the in-memory exporter, then writes them all to a file."""

    def __init__(self, exporter: InMemorySpanExporter, path: Path) -> None:
        super().__init__(exporter)
        self._exporter = exporter
        self._path = path
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        super().on_end(span)
        with self._lock:
            spans = [json.loads(s.to_json()) for s in self._exporter.get_finished_spans()]
            partial = self._path.with_suffix(".part")
            partial.write_text(json.dumps(spans))
            os.replace(partial, self._path)


_provider = TracerProvider()
_provider.add_span_processor(_WritingProcessor(InMemorySpanExporter(), Path.cwd() / SPANS_FILE))
trace.set_tracer_provider(_provider)
_tracer = trace.get_tracer("trace_worker")

registry = Registry(TracedJob, default_queue=QUEUE, default_lease=5.0)


@registry.task
def succeeds(ctx: JobContext) -> None:
    with _tracer.start_as_current_span("handler work"):
        pass


@registry.task(max_attempts=2, retry=FAST_RETRY)
def fails(ctx: JobContext) -> None:
    raise ValueError(f"failed on attempt {ctx.attempt}")


@registry.task(mode="lock", max_attempts=1)
def fails_locked(ctx: JobContext) -> None:
    raise KeyError("missing in lock mode")


@registry.task
async def succeeds_async(ctx: JobContext) -> None:
    with _tracer.start_as_current_span("async handler work"):
        pass
