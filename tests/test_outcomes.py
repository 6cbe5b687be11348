"""Outcomes: complete, fail with backoff, dead, retry, cancel, release, prune; all fenced."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import advance_clock
from in_process import enqueue
from models import EmailJob, EmailJobResult, ReportJob, ReportJobResult
from sqlalchemy.orm import Session

import sqla_jobs
from sqla_jobs import (
    ClaimedJob,
    JobMixin,
    JobNotFoundError,
    JobStateError,
    JobStatus,
    LeaseLostError,
    RetryPolicy,
)


def claim(engine: sa.Engine, model: type[JobMixin] = EmailJob, **kwargs: Any) -> list[ClaimedJob]:
    with Session(engine) as session, session.begin():
        return sqla_jobs.claim(session, model, **kwargs)


def row(engine: sa.Engine, job_id: int, table: str = "email_jobs") -> Any:
    with engine.connect() as connection:
        return connection.execute(
            sa.text(f"SELECT *, statement_timestamp() AS db_now FROM {table} WHERE id = :id"),
            {"id": job_id},
        ).one_or_none()


def test_complete_marks_succeeded_and_stores_the_result(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job, result={"sent": True}, result_model=EmailJobResult)
    stored = row(queue_engine, job_id)
    assert stored.status == "succeeded"
    assert stored.finished_at is not None
    assert stored.lease_expires_at is None
    with Session(queue_engine) as session:
        result = session.get(EmailJobResult, job_id)
        assert result is not None
        assert (result.task, result.value) == ("t", {"sent": True})


def test_delete_on_success_keeps_only_the_result(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, ReportJob(task="report"))
    (job,) = claim(queue_engine, ReportJob)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job, result=[1, 2, 3], result_model=ReportJobResult)
    assert row(queue_engine, job_id, "report_jobs") is None
    with Session(queue_engine) as session:
        result = session.get(ReportJobResult, job_id)
        assert result is not None
        assert result.value == [1, 2, 3]


def test_complete_many_completes_a_batch_and_reports_the_stale(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *[EmailJob(task="t", args={"i": i}) for i in range(5)])
    stale = claim(queue_engine, limit=1, lease=30)
    advance_clock(queue_engine, EmailJob, 31)
    fresh = claim(queue_engine, limit=5)
    assert len(fresh) == 5  # includes a new attempt at the stale job
    with Session(queue_engine) as session, session.begin():
        lost = sqla_jobs.complete_many(
            session,
            [*stale, *fresh],
            results=[None] + [job.args["i"] for job in fresh],
            result_model=EmailJobResult,
        )
    assert lost == stale
    with Session(queue_engine) as session:
        assert (
            session.execute(
                sa.select(sa.func.count()).where(EmailJob.status == "succeeded")
            ).scalar()
            == 5
        )
        values = session.execute(sa.select(EmailJobResult.value)).scalars().all()
        assert sorted(values) == [0, 1, 2, 3, 4]  # the stale attempt stored nothing


def test_fail_retries_after_exponential_backoff_in_database_time(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t", max_attempts=5))
    policy = RetryPolicy(base=timedelta(seconds=10), cap=timedelta(seconds=25), jitter=0.1)
    waits: list[float] = []
    for _ in range(3):
        with Session(queue_engine) as session, session.begin():
            session.execute(sa.update(EmailJob).values(run_at=sa.func.now()))
        (job,) = claim(queue_engine)
        with Session(queue_engine) as session, session.begin():
            outcome = sqla_jobs.fail(session, job, ValueError("smtp down"), policy=policy)
        assert outcome.status is JobStatus.PENDING
        assert outcome.will_retry
        stored = row(queue_engine, job_id)
        waits.append((stored.run_at - stored.db_now).total_seconds())
        assert stored.status == "pending"
        assert "ValueError: smtp down" in stored.last_error
    # 10 s, 20 s, then capped at 25 s, each within ±10 % jitter (less the test's own runtime).
    for wait, expected in zip(waits, [10, 20, 25], strict=True):
        assert expected * 0.9 - 1 <= wait <= expected * 1.1


def test_jitter_spreads_retries(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *[EmailJob(task="t") for _ in range(20)])
    jobs = claim(queue_engine, limit=20)
    with Session(queue_engine) as session, session.begin():
        run_ats = {sqla_jobs.fail(session, job, "x").run_at for job in jobs}
    assert len(run_ats) > 10


def test_fail_on_the_last_attempt_makes_the_job_dead_with_its_error(
    queue_engine: sa.Engine,
) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t", max_attempts=2))
    for attempt in (1, 2):
        with Session(queue_engine) as session, session.begin():
            session.execute(sa.update(EmailJob).values(run_at=sa.func.now()))
        (job,) = claim(queue_engine)
        with Session(queue_engine) as session, session.begin():
            outcome = sqla_jobs.fail(session, job, f"failure {attempt}")
    assert outcome.status is JobStatus.DEAD
    assert not outcome.will_retry
    stored = row(queue_engine, job_id)
    assert (stored.status, stored.attempts, stored.last_error) == ("dead", 2, "failure 2")
    assert stored.finished_at is not None
    assert claim(queue_engine) == []


def test_fail_without_retry_and_with_an_explicit_delay(queue_engine: sa.Engine) -> None:
    first, second = enqueue(queue_engine, EmailJob(task="a"), EmailJob(task="b"))
    a, b = claim(queue_engine, limit=2)
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.fail(session, a, "bad input", retry=False).status is JobStatus.DEAD
        sqla_jobs.fail(session, b, "later", delay=timedelta(minutes=5))
    assert row(queue_engine, first).status == "dead"
    stored = row(queue_engine, second)
    assert 295 <= (stored.run_at - stored.db_now).total_seconds() <= 300


def test_error_text_is_made_storable(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.fail(session, job, "nul\x00inside " + "x" * 50_000)
    stored = row(queue_engine, job_id)
    assert "\x00" not in stored.last_error
    assert len(stored.last_error) <= 16_010


def test_every_transition_by_a_stale_attempt_changes_nothing(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    (zombie,) = claim(queue_engine, lease=30, worker="zombie")
    advance_clock(queue_engine, EmailJob, 31)
    (current,) = claim(queue_engine, lease=60, worker="current")
    before = row(queue_engine, job_id)

    with Session(queue_engine) as session, session.begin():
        with pytest.raises(LeaseLostError):
            sqla_jobs.complete(session, zombie, result=1, result_model=EmailJobResult)
        with pytest.raises(LeaseLostError):
            sqla_jobs.fail(session, zombie, "late failure")
        assert sqla_jobs.heartbeat(session, [zombie], lease=600) == [zombie]
        assert sqla_jobs.release(session, [zombie]) == [zombie]
        assert sqla_jobs.complete_many(session, [zombie]) == [zombie]

    after = row(queue_engine, job_id)
    assert after._asdict() | {"db_now": None} == before._asdict() | {"db_now": None}
    with Session(queue_engine) as session:
        assert session.get(EmailJobResult, job_id) is None
    # The current attempt still owns the job.
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, current)
    assert row(queue_engine, job_id).status == "succeeded"


def test_a_finished_job_cannot_be_finished_again(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="t"))
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job)
    with Session(queue_engine) as session, session.begin(), pytest.raises(LeaseLostError):
        sqla_jobs.fail(session, job, "after success")


def test_heartbeat_extends_the_lease_in_database_time(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    (job,) = claim(queue_engine, lease=30)
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.heartbeat(session, [job], lease=120) == []
    stored = row(queue_engine, job_id)
    assert 110 < (stored.lease_expires_at - stored.db_now).total_seconds() <= 120
    advance_clock(queue_engine, EmailJob, 31)  # past the original lease: nobody may take it over
    assert claim(queue_engine) == []


def test_release_gives_the_job_back_without_charging_the_attempt(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t", max_attempts=3))
    (job,) = claim(queue_engine, lease=600)
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.release(session, [job]) == []
    stored = row(queue_engine, job_id)
    assert (stored.status, stored.attempts, stored.max_attempts) == ("pending", 1, 4)
    assert stored.lease_expires_at is None
    assert stored.leased_by is None
    (again,) = claim(queue_engine)
    assert again.attempt == 2  # the fence never repeats


def test_retry_a_dead_job_and_cancel_a_pending_one(queue_engine: sa.Engine) -> None:
    dead_id, pending_id = enqueue(
        queue_engine,
        EmailJob(task="t", max_attempts=1),
        EmailJob(task="u", run_at=sa.func.now() + sa.text("interval '1 hour'")),
    )
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.fail(session, job, "boom")
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.retry(session, EmailJob, dead_id)
        sqla_jobs.cancel(session, EmailJob, pending_id)
    retried = row(queue_engine, dead_id)
    assert (retried.status, retried.attempts, retried.max_attempts) == ("pending", 1, 2)
    assert retried.finished_at is None
    assert retried.last_error == "boom"
    cancelled = row(queue_engine, pending_id)
    assert cancelled.status == "cancelled"
    assert cancelled.finished_at is not None
    (again,) = claim(queue_engine)
    assert (again.id, again.attempt) == (dead_id, 2)
    # A cancelled job can be retried too.
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.retry(session, EmailJob, pending_id)
    assert row(queue_engine, pending_id).status == "pending"


def test_admin_operations_on_wrong_states_and_missing_jobs(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    with Session(queue_engine) as session, session.begin():
        with pytest.raises(JobStateError, match="is pending"):
            sqla_jobs.retry(session, EmailJob, job_id)
        with pytest.raises(JobNotFoundError):
            sqla_jobs.cancel(session, EmailJob, 999_999)
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job)
    with Session(queue_engine) as session, session.begin(), pytest.raises(JobStateError):
        sqla_jobs.cancel(session, EmailJob, job_id)
    assert row(queue_engine, job_id).status == "succeeded"


def test_prune_deletes_old_finished_jobs_in_batches(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *[EmailJob(task="t") for _ in range(7)])
    jobs = claim(queue_engine, limit=5)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete_many(session, jobs[:4])
        sqla_jobs.fail(session, jobs[4], "x", retry=False)
        # Age four of the five finished jobs by an hour.
        session.execute(
            sa.update(EmailJob)
            .where(EmailJob.id.in_([job.id for job in jobs[:4]]))
            .values(finished_at=sa.func.now() - sa.text("interval '1 hour'"))
        )
    deleted: list[int] = []
    while True:
        with Session(queue_engine) as session, session.begin():
            n = sqla_jobs.prune(session, EmailJob, older_than=timedelta(minutes=30), limit=3)
        if n == 0:
            break
        deleted.append(n)
    assert deleted == [3, 1]
    with Session(queue_engine) as session:
        remaining = session.execute(sa.select(EmailJob.status)).scalars().all()
        assert sorted(remaining) == ["dead", "pending", "pending"]


def test_queue_stats_counts_by_queue_and_status(queue_engine: sa.Engine) -> None:
    enqueue(
        queue_engine,
        EmailJob(task="t", queue="a", run_at=sa.func.now() - sa.text("interval '2 minutes'")),
        EmailJob(task="t", queue="a"),
        EmailJob(task="t", queue="b"),
    )
    claim(queue_engine, queues="b")
    with Session(queue_engine) as session:
        stats = {(s.queue, s.status): s for s in sqla_jobs.queue_stats(session, EmailJob)}
    assert {key: s.count for key, s in stats.items()} == {
        ("a", JobStatus.PENDING): 2,
        ("b", JobStatus.RUNNING): 1,
    }
    oldest = stats["a", JobStatus.PENDING].oldest_pending_seconds
    assert oldest is not None
    assert 119 < oldest < 180
