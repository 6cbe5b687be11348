"""Rows that another program wrote, which Python cannot read or trace as they are: each such
job ends alone, and nothing else stops (issue 29, findings 3 and 4)."""

from __future__ import annotations

import threading
from typing import Any

import opentelemetry.trace  # noqa: F401  (loaded: the worker traces attempts)
import pytest
import sqlalchemy as sa
from models import EmailJob
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
import sqla_jobs.aio
from sqla_jobs import InvalidJobError, JobContext, Registry, Worker

# Deeper than Python's json decodes on any supported Python (3.10-3.12 stop near 1,500 levels,
# 3.13 near 9,000), and within what PostgreSQL's jsonb parser takes (16,000 is too deep for it).
DEEP_ARGS = "('{\"a\": ' || repeat('[', 12000) || repeat(']', 12000) || '}')::jsonb"
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


# Times PostgreSQL holds and Python's datetime cannot (years 1 to 9999): each due now.
UNREADABLE_TIMES = ["'-infinity'", "'0044-03-15 12:00:00+00 BC'", "'0001-01-01 00:00:00+00'"]


def test_a_run_at_python_cannot_read_stops_nothing(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)
    ran: list[int] = []
    lock = threading.Lock()

    @registry.task(queue="ancient")
    def work(ctx: JobContext) -> None:
        with lock:
            ran.append(ctx.job.id)

    with Session(queue_engine) as session, session.begin():
        jobs = [work.job({"n": n}) for n in range(8)]
        session.add_all(jobs)
        session.flush()
        ids = [job.id for job in jobs]
    bad = ids[: len(UNREADABLE_TIMES)]
    with queue_engine.begin() as connection:
        for job_id, value in zip(bad, UNREADABLE_TIMES, strict=True):
            connection.execute(
                sa.text(f"UPDATE email_jobs SET run_at = {value} WHERE id = {job_id}")
            )

    worker = Worker(registry, queue_engine, concurrency=2, poll_interval=0.1, grace=5)
    with worker:
        wait_until(
            lambda: all(
                s not in ("running", "pending") for s, _ in _statuses(queue_engine).values()
            ),
            timeout=20,
            message="every job ends",
        )
        health = worker.health()
    statuses = _statuses(queue_engine)
    for job_id in bad:
        status, error = statuses[job_id]
        assert status == "dead"
        assert error is not None
        assert "run_at cannot be read" in error
    good = ids[len(bad) :]
    assert {job_id: statuses[job_id][0] for job_id in good} == dict.fromkeys(good, "succeeded")
    assert sorted(ran) == good
    assert health.unreadable_jobs == len(bad)
    assert health.dead_threads == ()
    # The rows keep what the other program wrote: nothing rewrote their time.
    with queue_engine.connect() as connection:
        kept = connection.execute(
            sa.text(
                "SELECT count(*) FROM email_jobs WHERE id = ANY(:ids) AND run_at < '0001-01-02'"
            ),
            {"ids": bad},
        ).scalar_one()
    assert kept == len(bad)


def test_a_claim_and_a_fail_on_a_session_read_an_unreadable_run_at(queue_engine: sa.Engine) -> None:
    # The ORM path: the claim returns the job with run_at None (first in the claim's order,
    # as its time is), and the fail that makes it dead reads the kept time back as None.
    with Session(queue_engine) as session, session.begin():
        session.add_all([EmailJob(task="t", priority=5) for _ in range(3)])
    with queue_engine.begin() as connection:
        connection.execute(sa.text("UPDATE email_jobs SET run_at = '-infinity' WHERE id = 2"))
    with Session(queue_engine) as session, session.begin():
        jobs = sqla_jobs.claim(session, EmailJob, limit=3)
        assert [(job.id, job.run_at is not None) for job in jobs] == [
            (2, False),
            (1, True),
            (3, True),
        ]
        outcome = sqla_jobs.fail(session, jobs[0], "no", retry=False)
    assert outcome.status is sqla_jobs.JobStatus.DEAD
    assert outcome.run_at is None


@pytest.mark.asyncio
async def test_an_async_claim_reads_unreadable_rows_on_either_driver(
    queue_engine: sa.Engine, queue_async_engine: AsyncEngine
) -> None:
    # asyncpg decodes jsonb through SQLAlchemy, not through psycopg's loader.
    with Session(queue_engine) as session, session.begin():
        session.add_all([EmailJob(task="t") for _ in range(3)])
    with queue_engine.begin() as connection:
        connection.execute(sa.text(f"UPDATE email_jobs SET args = {DEEP_ARGS} WHERE id = 1"))
        connection.execute(sa.text("UPDATE email_jobs SET run_at = '-infinity' WHERE id = 2"))
    async with AsyncSession(queue_async_engine) as claiming, claiming.begin():
        jobs = await sqla_jobs.aio.claim(claiming, EmailJob, limit=3)
    by_id = {job.id: job for job in jobs}
    assert sorted(by_id) == [1, 2, 3]
    unreadable: object = by_id[1].args  # typed as a dict: a row another program wrote
    assert isinstance(unreadable, sqla_jobs.queue.UnreadableJson)
    run_at: object = by_id[2].run_at  # typed as a datetime: a row another program wrote
    assert run_at is None
    assert by_id[3].args == {}


def test_the_dashboard_shows_a_job_whose_times_cannot_be_read(queue_engine: sa.Engine) -> None:
    from starlette.testclient import TestClient

    from sqla_jobs.dashboard import create_app

    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t"))
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text(
                "UPDATE email_jobs SET run_at = '-infinity', status = 'dead', "
                "finished_at = 'infinity' WHERE id = 1"
            )
        )
    with TestClient(create_app(queue_engine, EmailJob)) as client:
        page = client.get("/jobs/1")
        listing = client.get("/jobs")
        dead = client.get("/jobs?status=dead")
    assert page.status_code == 200
    assert "-infinity" in page.text
    assert listing.status_code == 200
    assert dead.status_code == 200
    assert "-infinity" in dead.text
