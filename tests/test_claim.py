"""The claim: order, database time, SKIP LOCKED, leases, and the lock-held mode."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import advance_clock
from in_process import enqueue
from models import EmailJob, Order
from sqlalchemy.orm import Session

import sqla_jobs
from sqla_jobs import JobStatus


def row(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as connection:
        return connection.execute(
            sa.text("SELECT * FROM email_jobs WHERE id = :id"), {"id": job_id}
        ).one()


def test_claims_in_priority_run_at_id_order(queue_engine: sa.Engine) -> None:
    ids = enqueue(
        queue_engine,
        EmailJob(task="low", priority=5),
        EmailJob(task="urgent", priority=-5),
        EmailJob(task="older", priority=5, run_at=sa.func.now() - sa.text("interval '1 hour'")),
        EmailJob(task="normal-a"),
        EmailJob(task="normal-b"),
    )
    claimed: list[str] = []
    for _ in range(5):
        with Session(queue_engine) as session, session.begin():
            (job,) = sqla_jobs.claim(session, EmailJob)
            claimed.append(job.task)
    assert claimed == ["urgent", "normal-a", "normal-b", "older", "low"]
    assert len(ids) == 5


def test_future_jobs_wait_for_the_database_clock(queue_engine: sa.Engine) -> None:
    enqueue(
        queue_engine, EmailJob(task="later", run_at=sa.func.now() + sa.text("interval '1 hour'"))
    )
    (soon,) = enqueue(
        queue_engine, EmailJob(task="soon", run_at=sa.func.now() + sa.text("interval '300 ms'"))
    )
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, EmailJob, limit=10) == []
    advance_clock(queue_engine, EmailJob, 0.4)
    with Session(queue_engine) as session, session.begin():
        assert [job.id for job in sqla_jobs.claim(session, EmailJob, limit=10)] == [soon]


def test_claim_only_takes_the_named_queues(queue_engine: sa.Engine) -> None:
    enqueue(
        queue_engine,
        EmailJob(task="a", queue="alpha"),
        EmailJob(task="b", queue="beta"),
        EmailJob(task="c", queue="gamma"),
    )
    with Session(queue_engine) as session, session.begin():
        jobs = sqla_jobs.claim(session, EmailJob, queues=["alpha", "gamma"], limit=10)
    assert sorted(job.task for job in jobs) == ["a", "c"]


def test_lease_claim_starts_an_attempt_in_database_time(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t", args={"k": "v"}))
    with Session(queue_engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, EmailJob, lease=30, worker="host-1:42")
        db_now = session.execute(sa.select(sa.func.statement_timestamp())).scalar_one()
    assert (job.id, job.attempt, job.task, job.args) == (job_id, 1, "t", {"k": "v"})
    stored = row(queue_engine, job_id)
    assert stored.status == "running"
    assert stored.attempts == 1
    assert stored.leased_by == "host-1:42"
    assert stored.lease_expires_at == job.lease_expires_at
    # 30 s after the claim statement, by the server's clock.
    assert abs((stored.lease_expires_at - db_now).total_seconds() - 30) < 1


def test_a_lease_claim_is_undone_with_the_callers_transaction(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    with Session(queue_engine) as session:
        session.begin()
        assert len(sqla_jobs.claim(session, EmailJob)) == 1
        session.rollback()
    assert (row(queue_engine, job_id).status, row(queue_engine, job_id).attempts) == ("pending", 0)


def test_concurrent_claimers_skip_locked_rows_without_waiting(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *[EmailJob(task="t", args={"i": i}) for i in range(6)])
    with Session(queue_engine) as first, Session(queue_engine) as second:
        first.begin()
        second.begin()
        # Any wait on a lock would fail the second claim at once.
        second.execute(sa.text("SET LOCAL lock_timeout = '1ms'"))
        a = sqla_jobs.claim(first, EmailJob, limit=4)
        b = sqla_jobs.claim(second, EmailJob, limit=4)
        assert len(a) == 4
        assert len(b) == 2
        assert not {job.id for job in a} & {job.id for job in b}
        first.commit()
        second.commit()


def test_a_claim_over_several_queues_skips_held_rows_and_still_fills_its_batch(
    queue_engine: sa.Engine,
) -> None:
    enqueue(
        queue_engine,
        *[EmailJob(task=f"a{i}", queue="alpha", priority=-1) for i in range(6)],
        *[EmailJob(task=f"b{i}", queue="beta") for i in range(6)],
    )
    queues = ["alpha", "beta"]
    with Session(queue_engine) as first, Session(queue_engine) as second:
        first.begin()
        second.begin()
        second.execute(sa.text("SET LOCAL lock_timeout = '1ms'"))
        a = sqla_jobs.claim(first, EmailJob, queues=queues, limit=3)
        # The best three, in claim order, across the queues.
        assert [job.task for job in a] == ["a0", "a1", "a2"]
        # Each queue's read locks at most `limit` rows as it goes (a0-a2 claimed, b0-b2
        # held as candidates until the first transaction ends); a concurrent claim skips
        # them all, and its batch is full all the same.
        b = sqla_jobs.claim(second, EmailJob, queues=queues, limit=6)
        assert sorted(job.task for job in b) == ["a3", "a4", "a5", "b3", "b4", "b5"]
        first.commit()
        second.commit()


def test_expired_leases_of_several_queues_are_taken_over(queue_engine: sa.Engine) -> None:
    alpha, beta, last = enqueue(
        queue_engine,
        EmailJob(task="a", queue="alpha"),
        EmailJob(task="b", queue="beta"),
        EmailJob(task="c", queue="beta", max_attempts=1),
    )
    with Session(queue_engine) as session, session.begin():
        assert (
            len(sqla_jobs.claim(session, EmailJob, queues=["alpha", "beta"], lease=30, limit=5))
            == 3
        )
    advance_clock(queue_engine, EmailJob, 31)  # the leases run out
    enqueue(queue_engine, EmailJob(task="new", queue="alpha", priority=1))
    with Session(queue_engine) as session, session.begin():
        jobs = sqla_jobs.claim(session, EmailJob, queues=["beta", "alpha"], limit=5)
    assert [(job.id, job.attempt) for job in jobs][:2] == [(alpha, 2), (beta, 2)]
    assert [job.task for job in jobs] == ["a", "b", "new"]
    assert (row(queue_engine, last).status, row(queue_engine, last).attempts) == ("dead", 1)


def test_expired_lease_is_reclaimed_by_the_same_claim_as_a_new_attempt(
    queue_engine: sa.Engine,
) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    with Session(queue_engine) as session, session.begin():
        (first,) = sqla_jobs.claim(session, EmailJob, lease=30, worker="a")
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, EmailJob) == []  # the lease still holds
    advance_clock(queue_engine, EmailJob, 31)
    with Session(queue_engine) as session, session.begin():
        (second,) = sqla_jobs.claim(session, EmailJob, lease=30, worker="b")
    assert (second.id, second.attempt, first.attempt) == (job_id, 2, 1)
    stored = row(queue_engine, job_id)
    assert (stored.attempts, stored.leased_by) == (2, "b")
    assert "attempt 1 lost its lease" in stored.last_error


def test_a_job_whose_worker_dies_every_time_ends_dead(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="poison", max_attempts=3))
    for attempt in (1, 2, 3):
        with Session(queue_engine) as session, session.begin():
            (job,) = sqla_jobs.claim(session, EmailJob, lease=30)
        assert job.attempt == attempt
        advance_clock(queue_engine, EmailJob, 31)  # the worker "died": its lease runs out
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, EmailJob) == []
    stored = row(queue_engine, job_id)
    assert (stored.status, stored.attempts) == ("dead", 3)
    assert stored.finished_at is not None
    assert "attempt 3 lost its lease" in stored.last_error


def test_lock_held_rows_stay_locked_until_the_transaction_ends(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    with Session(queue_engine) as holder:
        holder.begin()
        (job,) = sqla_jobs.claim(holder, EmailJob, hold=True, lease=0.1)
        # The attempt was counted and committed before the handler ran.
        assert row(queue_engine, job_id).attempts == 1
        time.sleep(0.2)  # the lease ran out, but the row lock still holds the job
        with Session(queue_engine) as other, other.begin():
            other.execute(sa.text("SET LOCAL lock_timeout = '1ms'"))
            assert sqla_jobs.claim(other, EmailJob) == []
        sqla_jobs.complete(holder, job)
        holder.commit()
    assert row(queue_engine, job_id).status == "succeeded"


def test_lock_held_handler_writes_commit_together_with_the_completion(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, EmailJob(task="create_order", args={"id": 1}))
    enqueue(queue_engine, EmailJob(task="create_order", args={"id": 2}))

    # The first handler's transaction commits: its write and its completion are both there.
    with Session(queue_engine) as session:
        session.begin()
        (job,) = sqla_jobs.claim(session, EmailJob, hold=True)
        session.add(Order(id=job.args["id"], customer="written by the handler"))
        sqla_jobs.complete(session, job)
        session.commit()

    # The second one's rolls back (the worker died): neither its write nor its completion is.
    with Session(queue_engine) as session:
        session.begin()
        (job2,) = sqla_jobs.claim(session, EmailJob, hold=True, lease=30)
        session.add(Order(id=job2.args["id"], customer="written by the handler"))
        sqla_jobs.complete(session, job2)
        session.rollback()

    with Session(queue_engine) as session:
        assert session.execute(sa.select(Order.id)).scalars().all() == [1]
        statuses = session.execute(sa.select(EmailJob.status)).scalars().all()
        assert sorted(statuses) == ["running", "succeeded"]
    # The rolled-back attempt still counted; after its lease the job is claimed again.
    advance_clock(queue_engine, EmailJob, 31)
    with Session(queue_engine) as session, session.begin():
        (again,) = sqla_jobs.claim(session, EmailJob)
    assert (again.id, again.attempt) == (job2.id, 2)


def test_lock_skips_attempts_that_were_taken_over(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="t"))
    with Session(queue_engine) as session, session.begin():
        (stale,) = sqla_jobs.claim(session, EmailJob, lease=30)
    advance_clock(queue_engine, EmailJob, 31)
    with Session(queue_engine) as session, session.begin():
        (current,) = sqla_jobs.claim(session, EmailJob)
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.lock(session, [stale]) == []
        assert sqla_jobs.lock(session, [current]) == [current]


def test_claimed_jobs_are_plain_data(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="t", max_attempts=1))
    with Session(queue_engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, EmailJob)
    assert job.model is EmailJob
    assert job.is_last_attempt
    with pytest.raises(AttributeError):
        job.attempt = 5  # type: ignore[misc]
    assert JobStatus("running") is JobStatus.RUNNING
