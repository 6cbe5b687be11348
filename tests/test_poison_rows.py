"""Rows that another program wrote, which Python cannot read or trace as they are: each such
job ends alone, and nothing else stops (issue 29, findings 3 and 4)."""

from __future__ import annotations

import threading
from typing import Any

import opentelemetry.trace  # noqa: F401  (loaded: the worker traces attempts)
import pytest
import sqlalchemy as sa
from models import EmailJob
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import InvalidJobError, JobContext, Registry, Worker

# Deeper than Python's json decodes (its recursion limit is 1,000), well within jsonb's.
DEEP_ARGS = "('{\"a\": ' || repeat('[', 3000) || repeat(']', 3000) || '}')::jsonb"
HUGE_NUMBER = "('{\"n\": ' || repeat('9', 5000) || '}')::jsonb"


def _statuses(engine: sa.Engine) -> dict[int, tuple[str, str | None]]:
    with engine.connect() as connection:
        rows = connection.execute(sa.text("SELECT id, status, last_error FROM email_jobs"))
        return {row.id: (row.status, row.last_error) for row in rows}


def test_unreadable_args_and_a_malformed_trace_context_stop_nothing(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob)
    ran: list[int] = []
    lock = threading.Lock()

    @registry.task(queue="poison")
    def work(ctx: JobContext) -> None:
        with lock:
            ran.append(ctx.job.id)

    with Session(queue_engine) as session, session.begin():
        jobs = [work.job({"n": n}) for n in range(12)]
        session.add_all(jobs)
        session.flush()
        ids = [job.id for job in jobs]
    deep, huge, traced_list, traced_ints = ids[:4]
    with queue_engine.begin() as connection:
        # What psql, a trigger or another service may write: nothing sqla_jobs would.
        connection.execute(sa.text(f"UPDATE email_jobs SET args = {DEEP_ARGS} WHERE id = {deep}"))
        connection.execute(sa.text(f"UPDATE email_jobs SET args = {HUGE_NUMBER} WHERE id = {huge}"))
        connection.execute(
            sa.text("UPDATE email_jobs SET trace_context = '[\"x\"]' WHERE id = :id"),
            {"id": traced_list},
        )
        connection.execute(
            sa.text("UPDATE email_jobs SET trace_context = '{\"traceparent\": 7}' WHERE id = :id"),
            {"id": traced_ints},
        )

    worker = Worker(registry, queue_engine, concurrency=2, poll_interval=0.1, grace=5)
    with worker:
        wait_until(
            lambda: all(
                status != "running" and status != "pending"
                for status, _ in _statuses(queue_engine).values()
            ),
            timeout=20,
            message="every job ends",
        )
        health = worker.health()
    statuses = _statuses(queue_engine)
    for job_id in (deep, huge):
        status, error = statuses[job_id]
        assert status == "dead"
        assert error is not None
        assert "args cannot be read" in error
    # A malformed trace context is ignored: the job runs, untraced by its enqueuer.
    assert {job_id: statuses[job_id][0] for job_id in ids[2:]} == dict.fromkeys(
        ids[2:], "succeeded"
    )
    assert sorted(ran) == ids[2:]
    assert health.dead_threads == ()
    assert health.unreadable_jobs == 2


def test_a_claim_on_a_session_reads_an_unreadable_row_without_failing(
    queue_engine: sa.Engine,
) -> None:
    # The ORM path (not the worker's driver shortcut): the claim returns the job, marked.
    with Session(queue_engine) as session, session.begin():
        session.add_all([EmailJob(task="t"), EmailJob(task="t")])
    with queue_engine.begin() as connection:
        connection.execute(sa.text(f"UPDATE email_jobs SET args = {DEEP_ARGS} WHERE id = 1"))
    with Session(queue_engine) as session, session.begin():
        jobs = sqla_jobs.claim(session, EmailJob, limit=2)
    args: dict[int, Any] = {job.id: job.args for job in jobs}
    assert isinstance(args[1], sqla_jobs.queue.UnreadableJson)
    assert args[2] == {}


@pytest.mark.parametrize(
    "value", [["x"], {"traceparent": 7}, {1: "x"}, "traceparent", {"a": "\ud800"}]
)
def test_a_malformed_trace_context_is_refused_at_construction(value: Any) -> None:
    with pytest.raises(InvalidJobError, match="trace_context"):
        EmailJob(task="t", trace_context=value)


def test_the_dashboard_shows_a_job_whose_args_cannot_be_read(queue_engine: sa.Engine) -> None:
    from starlette.testclient import TestClient

    from sqla_jobs.dashboard import create_app

    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t"))
    with queue_engine.begin() as connection:
        connection.execute(sa.text(f"UPDATE email_jobs SET args = {DEEP_ARGS} WHERE id = 1"))
    with TestClient(create_app(queue_engine, EmailJob)) as client:
        page = client.get("/jobs/1")
        listing = client.get("/jobs")
    assert page.status_code == 200
    assert "UnreadableJson: nested deeper than Python" in page.text
    assert listing.status_code == 200
