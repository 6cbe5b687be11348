"""Traces: every enqueue path stores the current trace context, and a real worker process
runs each attempt in a CONSUMER span that continues it (sqla_jobs.tracing).

The enqueue side uses a tracer provider of the test's own (not the global one): the context
of the current span is what is stored, whoever records it. The worker side is a real
``sqla-jobs worker`` process that configures the SDK (tests/trace_worker.py) and writes its
finished spans to a file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import models
import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanContext
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.pool import NullPool
from worker_harness import Workers, wait_until

import sqla_jobs
from sqla_jobs import InvalidJobError, JobMixin, Registry, aio

tracer = TracerProvider().get_tracer("tests")


def traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def stored(session: Session | sa.Connection, model: type[JobMixin]) -> list[tuple[str, Any]]:
    """(task, trace_context) of every job, with SQL NULL as None (JSON null would be 'null')."""
    table = model.__table__  # type: ignore[attr-defined]
    rows = session.execute(
        sa.select(table.c.task, sa.cast(table.c.trace_context, sa.Text)).order_by(table.c.id)
    )
    return [(task, None if text is None else json.loads(text)) for task, text in rows]


# -- the enqueue paths -------------------------------------------------------------------


def test_orm_add_and_task_enqueue_store_the_current_span(db_session: Session) -> None:
    # The context is the one current when the row is inserted: at the flush.
    registry = Registry(models.EmailJob)
    send = registry.task(name="send")(lambda ctx: None)
    with tracer.start_as_current_span("request") as span:
        db_session.add(models.EmailJob(task="added"))
        send.enqueue(db_session, {"n": 1})
        db_session.flush()
    db_session.add(models.EmailJob(task="outside"))
    db_session.flush()
    with tracer.start_as_current_span("later"):
        db_session.add(models.EmailJob(task="flushed_outside"))
    db_session.flush()

    expected = {"traceparent": traceparent(span.get_span_context())}
    assert stored(db_session, models.EmailJob) == [
        ("added", expected),
        ("send", expected),
        ("outside", None),
        ("flushed_outside", None),
    ]


def test_enqueue_many_stores_it_for_every_chunk(db_session: Session) -> None:
    jobs = [{"task": "bulk", "args": {"n": n}} for n in range(5)]
    with tracer.start_as_current_span("import") as span:
        assert sqla_jobs.enqueue_many(db_session, models.EmailJob, jobs, chunk_size=2) == 5
    sqla_jobs.enqueue_many(db_session, models.EmailJob, [{"task": "untraced"}])

    expected = {"traceparent": traceparent(span.get_span_context())}
    assert stored(db_session, models.EmailJob) == [("bulk", expected)] * 5 + [("untraced", None)]


def test_the_trace_state_goes_with_it(db_session: Session) -> None:
    parent = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=trace.TraceFlags(1),
        trace_state=trace.TraceState([("vendor", "value")]),
    )
    with trace.use_span(trace.NonRecordingSpan(parent)):
        sqla_jobs.enqueue_many(db_session, models.EmailJob, [{"task": "remote"}])

    assert stored(db_session, models.EmailJob) == [
        (
            "remote",
            {
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "tracestate": "vendor=value",
            },
        )
    ]


def test_an_enqueuer_cannot_set_the_trace_context_of_enqueue_many(
    queue_engine: sa.Engine,
) -> None:
    statements: list[str] = []
    with Session(queue_engine) as session:
        sa.event.listen(
            session.connection(), "before_cursor_execute", lambda *a: statements.append(a[2])
        )
        with pytest.raises(InvalidJobError, match="trace_context: is set by the queue"):
            sqla_jobs.enqueue_many(
                session, models.EmailJob, [{"task": "t", "trace_context": {"traceparent": "x"}}]
            )
    assert statements == []


def test_the_claim_returns_the_stored_context(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(models.EmailJob(task="plain", priority=1))
        session.flush()
        with tracer.start_as_current_span("request") as span:
            session.add(models.EmailJob(task="traced", priority=0))
            session.flush()  # the context is the one current when the row is inserted
    with queue_engine.begin() as connection:  # a Connection: the driver's fast path
        traced, plain = sqla_jobs.claim(connection, models.EmailJob, limit=2)
    with Session(queue_engine) as session, session.begin():  # and through execute()
        assert sqla_jobs.claim(session, models.EmailJob) == []

    assert traced.trace_context == {"traceparent": traceparent(span.get_span_context())}
    assert plain.trace_context is None


async def test_async_enqueues_store_the_current_span(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        with tracer.start_as_current_span("async request") as span:
            session.add(models.EmailJob(task="added"))
            await session.flush()
            await aio.enqueue_many(session, models.EmailJob, [{"task": "bulk"}])

    expected = {"traceparent": traceparent(span.get_span_context())}
    async with queue_async_engine.connect() as connection:
        rows = await connection.run_sync(stored, models.EmailJob)
    assert rows == [("added", expected), ("bulk", expected)]


def test_without_opentelemetry_loaded_the_hooks_do_nothing(tmp_path: Path) -> None:
    # Neither OpenTelemetry nor sqla_jobs' implementation on it (tracing.otel) is imported;
    # tracing.protocols, the types alone, is.
    code = (
        "import sys\n"
        "from sqla_jobs import tracing\n"
        "assert tracing.enqueue_context() is None\n"
        "assert tracing.attempt_span(None) is tracing.attempt_span(None)\n"
        "with tracing.attempt_span(None) as span:\n"
        "    span.settled('fail', ValueError('x'))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', "
        "'sqla_jobs.tracing.otel'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_cursor_execute_listeners_see_the_hot_path_sql(queue_engine: sa.Engine) -> None:
    # OpenTelemetry's SQLAlchemy instrumentation listens to these events: with a listener
    # on the engine, claim, heartbeat and complete on a Core connection (the worker's kept
    # connections) go through execute() instead of the driver's fast path.
    engine = sa.create_engine(queue_engine.url, poolclass=NullPool)
    seen: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *args: seen.append(args[2]))
    with Session(engine) as session, session.begin():
        session.add(models.EmailJob(task="t"))
    with engine.begin() as connection:
        (job,) = sqla_jobs.claim(connection, models.EmailJob)
    with engine.begin() as connection:
        assert sqla_jobs.heartbeat(connection, [job]) == []  # none lost
        sqla_jobs.complete(connection, job)
    engine.dispose()

    first_words = [" ".join(statement.split()[:2]) for statement in seen]
    assert first_words == ["INSERT INTO", "WITH claimable", "WITH held", "UPDATE email_jobs"]
    assert "SET status=CASE" in seen[-1]  # the completion (cancelled on request)
    assert "'succeeded'" in seen[-1]


# -- a real worker process -----------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class TracedJob(JobMixin, Base):
    """tests/trace_worker.py's model (not imported here: it configures the SDK globally)."""

    __tablename__ = "traced_jobs"


@pytest.fixture
def traced_db(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(fresh_database("sqla_jobs_traces"), poolclass=NullPool)
    Base.metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def workers(traced_db: sa.Engine, tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(traced_db.url.render_as_string(hide_password=False), tmp_path)
    try:
        yield pool
    finally:
        pool.close()


def hex_id(value: int, digits: int) -> str:
    return f"0x{value:0{digits}x}"


def test_a_worker_process_continues_the_trace_of_each_enqueue(
    traced_db: sa.Engine, workers: Workers, tmp_path: Path
) -> None:
    with Session(traced_db) as session, session.begin():
        with tracer.start_as_current_span("request") as request:
            session.add_all(
                TracedJob(task=task, queue="traced", max_attempts=attempts)
                for task, attempts in (("succeeds", 20), ("succeeds_async", 20), ("fails", 2))
            )
            sqla_jobs.enqueue_many(
                session, TracedJob, [{"task": "fails_locked", "queue": "traced", "max_attempts": 1}]
            )
        session.add(TracedJob(task="succeeds", queue="traced", args={"untraced": True}))
    with Session(traced_db) as session:
        by_task = {
            (task if not args else "untraced"): job_id
            for job_id, task, args in session.execute(
                sa.select(TracedJob.id, TracedJob.task, TracedJob.args)
            )
        }
    parent = request.get_span_context()
    trace_id, parent_id = hex_id(parent.trace_id, 32), hex_id(parent.span_id, 16)
    spans_file = tmp_path / "spans.json"

    def attempt_spans() -> list[dict[str, Any]]:
        if not spans_file.exists():
            return []
        spans = json.loads(spans_file.read_text())
        return [s for s in spans if s["kind"] == "SpanKind.CONSUMER"]

    worker = workers.start(target="trace_worker:registry", queues="traced")
    # 1 + 1 + 2 (a retry) + 1 + 1 (the job enqueued without a span) attempts.
    try:
        wait_until(lambda: len(attempt_spans()) >= 6, timeout=60, message="six attempts ended")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the worker's log:\n{worker.log_text()[-3000:]}") from None

    def statuses() -> dict[str, str]:
        with Session(traced_db) as session:
            rows = session.execute(sa.select(TracedJob.task, TracedJob.status)).all()
            return {row[0]: row[1] for row in rows}

    final = {
        "succeeds": "succeeded",
        "succeeds_async": "succeeded",
        "fails": "dead",
        "fails_locked": "dead",
    }
    wait_until(lambda: statuses() == final, timeout=30, message="every job is finished")
    spans = json.loads(spans_file.read_text())
    attempts = [s for s in spans if s["kind"] == "SpanKind.CONSUMER"]
    assert len(attempts) == 6, worker.log_text()[-3000:]

    def of(key: str) -> list[dict[str, Any]]:
        job_id = by_task[key]
        found = [s for s in attempts if s["attributes"]["sqla_jobs.job.id"] == job_id]
        return sorted(found, key=lambda s: s["attributes"]["sqla_jobs.job.attempt"])

    # Every attempt of a traced enqueue is a child of the enqueuing span, linked to it too.
    for key in ("succeeds", "succeeds_async", "fails", "fails_locked"):
        for span in of(key):
            assert span["context"]["trace_id"] == trace_id
            assert span["parent_id"] == parent_id
            assert [link["context"]["span_id"] for link in span["links"]] == [parent_id]
            assert span["name"] == f"process {key}"

    (ok,) = of("succeeds")
    assert ok["attributes"] == {
        "messaging.system": "sqla_jobs",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "traced",
        "messaging.message.id": str(by_task["succeeds"]),
        "sqla_jobs.job.id": by_task["succeeds"],
        "sqla_jobs.job.task": "succeeds",
        "sqla_jobs.job.queue": "traced",
        "sqla_jobs.job.attempt": 1,
        "sqla_jobs.job.max_attempts": 20,
        "sqla_jobs.job.outcome": "complete",
    }
    assert ok["status"]["status_code"] == "UNSET"
    assert ok["events"] == []

    # The handler's own spans are children of the attempt's span, sync and async alike.
    (async_ok,) = of("succeeds_async")
    (untraced,) = of("untraced")
    assert sorted(
        (s["name"], s["parent_id"]) for s in spans if s["kind"] == "SpanKind.INTERNAL"
    ) == sorted(
        [
            ("handler work", ok["context"]["span_id"]),
            ("handler work", untraced["context"]["span_id"]),
            ("async handler work", async_ok["context"]["span_id"]),
        ]
    )

    # A failing attempt records its exception and sets error status; each retry is its own
    # span in the same trace.
    first, second = of("fails")
    for number, span in enumerate((first, second), start=1):
        assert span["attributes"]["sqla_jobs.job.attempt"] == number
        assert span["attributes"]["sqla_jobs.job.outcome"] == "fail"
        assert span["attributes"]["error.type"] == "builtins.ValueError"
        assert span["status"] == {
            "status_code": "ERROR",
            "description": f"failed on attempt {number}",
        }
        (event,) = span["events"]
        assert event["name"] == "exception"
        assert event["attributes"]["exception.type"] == "ValueError"
        assert event["attributes"]["exception.message"] == f"failed on attempt {number}"
        assert "raise ValueError" in event["attributes"]["exception.stacktrace"]

    # Lock mode: the handler's error is caught inside the attempt; the span is told.
    (locked,) = of("fails_locked")
    assert locked["status"]["status_code"] == "ERROR"
    assert locked["attributes"]["error.type"] == "builtins.KeyError"
    assert [e["attributes"]["exception.type"] for e in locked["events"]] == ["KeyError"]

    # A job enqueued without a span starts a trace of its own.
    assert untraced["parent_id"] is None
    assert untraced["links"] == []
    assert untraced["context"]["trace_id"] != trace_id


def test_enqueue_unique_stores_it_for_the_jobs_it_inserts(db_session: Session) -> None:
    with tracer.start_as_current_span("signup") as span:
        first = sqla_jobs.enqueue_unique(db_session, models.EmailJob(task="welcome"))
        again = sqla_jobs.enqueue_unique(db_session, models.EmailJob(task="welcome"))
    sqla_jobs.enqueue_unique_many(db_session, models.EmailJob, [{"task": "untraced"}])

    assert first.inserted
    assert not again.inserted
    assert again.id == first.id
    expected = {"traceparent": traceparent(span.get_span_context())}
    assert stored(db_session, models.EmailJob) == [("welcome", expected), ("untraced", None)]
