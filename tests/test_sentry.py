"""The Sentry integration (sqla_jobs.integrations.sentry) with real workers on real
PostgreSQL, reporting through the SDK's own transport interface to a list (no network): each
failed attempt captured once, tagged, in the job's trace; nothing for a success or a cancel."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import pytest
import sentry_sdk
import sqlalchemy as sa
from in_process import PATIENCE, enqueue, running
from models import EmailJob
from packaging.requirements import Requirement
from packaging.version import Version
from sentry_sdk.envelope import Envelope
from sentry_sdk.integrations.logging import LoggingIntegration
from sentry_sdk.transport import Transport
from sqlalchemy.orm import Session
from worker_harness import wait_until

from sqla_jobs import JobContext, Registry, cancel
from sqla_jobs.context import Snooze
from sqla_jobs.integrations import sentry
from sqla_jobs.integrations.sentry import sentry_hooks

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Captured(Transport):
    """A Sentry transport that keeps what it is given."""

    def __init__(self) -> None:
        # sentry-sdk 2.0's own annotation of Transport.__init__ confuses mypy.
        super().__init__()  # type: ignore[misc, unused-ignore]
        self.envelopes: list[Envelope] = []

    def capture_envelope(self, envelope: Envelope) -> None:
        self.envelopes.append(envelope)

    def events(self) -> list[Any]:
        return [e for e in map(Envelope.get_event, self.envelopes) if e is not None]

    def transactions(self) -> list[Any]:
        found = map(Envelope.get_transaction_event, self.envelopes)
        return [e for e in found if e is not None]


@pytest.fixture
def captured() -> Iterator[Captured]:
    """Sentry initialised in this process (its logging integration on, every transaction
    sampled), sending to a :class:`Captured`; closed and unset at the end."""
    transport = Captured()
    sentry_sdk.init(
        dsn="https://public@sentry.invalid/1",
        transport=transport,
        default_integrations=False,
        auto_enabling_integrations=False,
        integrations=[LoggingIntegration(level=logging.INFO, event_level=logging.ERROR)],
        traces_sample_rate=1.0,
    )
    try:
        yield transport
    finally:
        sentry_sdk.get_client().close()
        sentry_sdk.Scope.get_global_scope().set_client(None)


def row(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as connection:
        return connection.execute(
            sa.text("SELECT status, attempts FROM email_jobs WHERE id = :id"), {"id": job_id}
        ).one()


def until(condition: Any) -> None:
    wait_until(condition, timeout=PATIENCE, message="the Sentry test's condition")


def test_each_failed_attempt_is_captured_once_tagged_in_the_jobs_trace(
    queue_engine: sa.Engine, captured: Captured
) -> None:
    registry = Registry(EmailJob, hooks=sentry_hooks())

    @registry.task(queue="mail", max_attempts=2)
    def flaky(ctx: JobContext) -> None:
        raise ValueError(f"attempt {ctx.attempt} failed")

    @registry.task(queue="mail")
    def fine(ctx: JobContext) -> str:
        return "ok"

    @registry.task(queue="mail")
    def later(ctx: JobContext) -> None:
        raise Snooze(3600)

    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    failing, ok, snoozed = enqueue(
        queue_engine,
        flaky.job(trace_context={"traceparent": traceparent}),
        fine.job(),
        later.job(),
    )
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, ok).status == "succeeded")
        until(lambda: row(queue_engine, failing).status == "pending")  # attempt 1 failed
        with queue_engine.begin() as connection:  # its backoff, without the wait
            connection.execute(
                sa.text("UPDATE email_jobs SET run_at = now() WHERE id = :id"), {"id": failing}
            )
        until(lambda: row(queue_engine, failing).status == "dead")
        until(lambda: row(queue_engine, snoozed).status == "pending")
    sentry_sdk.flush()
    events = captured.events()
    # Two attempts failed: two events, no more (the worker's ERROR log of the dead job, which
    # the logging integration sends, is dropped for the attempt already captured).
    assert [e["exception"]["values"][-1]["value"] for e in events] == [
        "attempt 1 failed",
        "attempt 2 failed",
    ]
    for attempt, event in enumerate(events, 1):
        assert event["exception"]["values"][-1]["type"] == "ValueError"
        assert event["tags"] == {
            "sqla_jobs.job.id": str(failing),
            "sqla_jobs.job.task": "flaky",
            "sqla_jobs.job.queue": "mail",
            "sqla_jobs.job.attempt": str(attempt),
        }
        assert event["contexts"]["trace"]["trace_id"] == TRACE_ID  # the job's trace goes on
        assert event["contexts"]["sqla_jobs"]["max_attempts"] == 2
    # One transaction per attempt whose handler ran, in the trace of its job.
    by_name: dict[str, list[dict[str, Any]]] = {}
    for transaction in captured.transactions():
        by_name.setdefault(transaction["transaction"], []).append(transaction)
    assert sorted(by_name) == ["process fine", "process flaky", "process later"]
    statuses = [t["contexts"]["trace"]["status"] for t in by_name["process flaky"]]
    assert statuses == ["internal_error", "internal_error"]
    assert {t["contexts"]["trace"]["trace_id"] for t in by_name["process flaky"]} == {TRACE_ID}
    assert [t["contexts"]["trace"]["status"] for t in by_name["process fine"]] == ["ok"]
    assert by_name["process fine"][0]["tags"]["sqla_jobs.job.id"] == str(ok)
    # Each event belongs to its attempt's transaction.
    spans = {t["contexts"]["trace"]["span_id"] for t in by_name["process flaky"]}
    assert {e["contexts"]["trace"]["span_id"] for e in events} == spans


def test_a_cancel_is_not_captured_and_scopes_do_not_leak(
    queue_engine: sa.Engine, captured: Captured
) -> None:
    registry = Registry(EmailJob, hooks=sentry_hooks())
    started = threading.Event()

    @registry.task
    def stoppable(ctx: JobContext) -> None:
        started.set()
        while not ctx.cancelled:
            threading.Event().wait(0.01)
        ctx.raise_if_cancelled()

    @registry.task(max_attempts=1)
    def broken(ctx: JobContext) -> None:
        raise KeyError(ctx.id)

    (stopped,) = enqueue(queue_engine, stoppable.job())
    with running(registry, queue_engine):
        assert started.wait(PATIENCE)
        with Session(queue_engine) as session, session.begin():
            cancel(session, EmailJob, stopped)
        until(lambda: row(queue_engine, stopped).status == "cancelled")
        (dead,) = enqueue(queue_engine, broken.job())
        until(lambda: row(queue_engine, dead).status == "dead")
    sentry_sdk.flush()
    (event,) = captured.events()
    assert event["exception"]["values"][-1]["type"] == "KeyError"
    # Only the failed job's tags: the cancelled job's scope ended with its attempt.
    assert event["tags"] == {
        "sqla_jobs.job.id": str(dead),
        "sqla_jobs.job.task": "broken",
        "sqla_jobs.job.queue": "default",
        "sqla_jobs.job.attempt": "1",
    }


@pytest.mark.parametrize(
    ("carrier", "headers"),
    [
        (
            {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "baggage": "k=v"},
            {"sentry-trace": f"{TRACE_ID}-{PARENT_ID}-1", "baggage": "k=v"},
        ),
        (
            {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"},
            {"sentry-trace": f"{TRACE_ID}-{PARENT_ID}"},
        ),
        (
            {"sentry-trace": f"{TRACE_ID}-{PARENT_ID}-0"},
            {"sentry-trace": f"{TRACE_ID}-{PARENT_ID}-0"},
        ),
        ({"traceparent": "not a traceparent"}, {}),
        ({"baggage": "k=v"}, {}),
        (None, {}),
        (["traceparent"], {}),
    ],
)
def test_a_stored_trace_context_is_read_as_sentry_headers(carrier: object, headers: Any) -> None:
    assert sentry._incoming_headers(carrier) == headers


@pytest.mark.skipif(
    os.environ.get("SQLA_JOBS_EXPECT_LOWEST") != "1",
    reason="SQLA_JOBS_EXPECT_LOWEST=1 (nox -s tests_lowest)",
)
def test_the_lowest_session_runs_the_sentry_extras_floor() -> None:
    (floor,) = (
        spec.version
        for line in metadata.requires("sqla-jobs") or []
        for requirement in [Requirement(line)]
        if requirement.name == "sentry-sdk"
        and requirement.marker is not None
        and requirement.marker.evaluate({"extra": "sentry"})
        for spec in requirement.specifier
        if spec.operator == ">="
    )
    assert Version(metadata.version("sentry-sdk")) == Version(floor)
