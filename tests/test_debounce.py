"""Debounced enqueues (``sqla_jobs.enqueue_debounced``): a burst under one key leaves one
pending job that runs once, a window after the last enqueue, with the last arguments; proven
from SQL, with concurrent processes and rolled-back transactions, and bad input refused
before any SQL."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import advance_clock, pooled_connect_args
from debounce_enqueuer import DOOMED, KEYS, WINDOW, enqueue_randomly
from in_process import PATIENCE, running
from models import EmailJob, EmailJobResult
from no_sql import no_sql
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
import sqla_jobs.aio
from sqla_jobs import InvalidJobError, JobContext, Registry


def debounce(engine: sa.Engine, args: dict[str, Any], **options: Any) -> sqla_jobs.Enqueued:
    """One committed debounced enqueue of a ``digest`` job."""
    options.setdefault("window", 30)
    with Session(engine) as session, session.begin():
        return sqla_jobs.enqueue_debounced(session, EmailJob(task="digest", args=args), **options)


def jobs(engine: sa.Engine) -> list[Any]:
    with engine.connect() as connection:
        return list(
            connection.execute(
                sa.text(
                    "SELECT id, status, args, unique_key, unique_statuses, attempts, "
                    "extract(epoch FROM run_at - now()) AS wait FROM email_jobs ORDER BY id"
                )
            )
        )


def test_a_burst_leaves_one_pending_job_run_after_the_window_with_the_last_arguments(
    queue_engine: sa.Engine,
) -> None:
    first = debounce(queue_engine, {"n": 1}, key="user:7")
    assert first.inserted
    assert first.unique_key == "user:7"
    for n in (2, 3):
        later = debounce(queue_engine, {"n": n}, key="user:7")
        assert (later.id, later.inserted) == (first.id, False)
    (job,) = jobs(queue_engine)
    assert (job.status, job.args, job.unique_statuses) == ("pending", {"n": 3}, ["pending"])
    assert 29 < job.wait <= 30  # a window after the last enqueue, by the database's clock
    # Another key is a burst of its own.
    other = debounce(queue_engine, {"n": 1}, key="user:8")
    assert other.inserted
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, EmailJob, limit=5) == []  # not due yet
    advance_clock(queue_engine, EmailJob, 31)
    with Session(queue_engine) as session, session.begin():
        claimed = sqla_jobs.claim(session, EmailJob, limit=5)
    assert {job.id: job.args["n"] for job in claimed} == {first.id: 3, other.id: 1}
    # Started: the next enqueue of the key starts the next burst, with a job of its own.
    again = debounce(queue_engine, {"n": 4}, key="user:7")
    assert again.inserted
    assert again.id not in {job.id for job in claimed}


def test_the_key_defaults_to_the_task(queue_engine: sa.Engine) -> None:
    one, two = debounce(queue_engine, {"n": 1}), debounce(queue_engine, {"n": 2})
    assert (one.unique_key, two.id, two.inserted) == ("digest", one.id, False)


def test_max_wait_caps_the_wait_after_the_first_enqueue(queue_engine: sa.Engine) -> None:
    first = debounce(queue_engine, {"n": 1}, window=30, max_wait=40)
    with queue_engine.begin() as connection:  # the burst began 35 s ago
        connection.execute(
            sa.text("UPDATE email_jobs SET created_at = created_at - interval '35 seconds'")
        )
    assert not debounce(queue_engine, {"n": 2}, window=30, max_wait=40).inserted
    (job,) = jobs(queue_engine)
    assert job.id == first.id
    assert 4 < job.wait <= 5  # 40 s after the first enqueue, not 30 s after this one
    # Without max_wait, the later of its run_at and a window from now.
    debounce(queue_engine, {"n": 3}, window=1)
    assert 4 < jobs(queue_engine)[0].wait <= 30  # never moved earlier


def test_a_rolled_back_enqueue_changes_nothing(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin() as transaction:
        sqla_jobs.enqueue_debounced(session, EmailJob(task="digest"), window=30)
        transaction.rollback()
    assert jobs(queue_engine) == []
    debounce(queue_engine, {"n": 1})
    with Session(queue_engine) as session, session.begin() as transaction:
        sqla_jobs.enqueue_debounced(session, EmailJob(task="digest", args={"n": 2}), window=1)
        transaction.rollback()
    (job,) = jobs(queue_engine)
    assert job.args == {"n": 1}
    assert job.wait > 25


async def test_a_task_and_an_async_session_debounce_the_same_way(
    queue_engine: sa.Engine, queue_async_engine: AsyncEngine
) -> None:
    registry = Registry(EmailJob)

    @registry.task
    def digest(ctx: JobContext) -> None: ...

    with Session(queue_engine) as session, session.begin():
        first = digest.enqueue_debounced(session, {"n": 1}, window=30, priority=5)
    async with AsyncSession(queue_async_engine) as async_session, async_session.begin():
        later = await sqla_jobs.aio.enqueue_debounced(
            async_session, EmailJob(task="digest", args={"n": 2}), window=30
        )
    assert (later.id, later.inserted) == (first.id, False)
    with queue_engine.connect() as connection:
        priority = connection.execute(sa.text("SELECT priority FROM email_jobs")).scalar_one()
    assert priority == 0  # every column is the last enqueue's


@pytest.mark.parametrize(
    ("options", "field", "says"),
    [
        ({"window": 0}, "window", "must be positive"),
        ({"window": -1}, "window", "must be positive"),
        ({"window": float("nan")}, "window", "must be positive"),
        ({"window": 86_401}, "window", r"at most 86,400 seconds \(a day\)"),
        ({"window": "5"}, "window", "a timedelta or a number of seconds"),
        ({"window": True}, "window", "a timedelta or a number of seconds"),
        ({"window": 10, "max_wait": 5}, "max_wait", "at least the window"),
        (
            {"window": 10, "max_wait": timedelta(days=2)},
            "max_wait",
            r"at most 86,400 seconds \(a day\)",
        ),
        ({"window": 10, "key": ""}, "unique_key", "1 to"),
        ({"window": 10, "key": 7}, "unique_key", "a string"),
    ],
)
def test_bad_debounce_options_are_refused_before_any_sql(
    queue_engine: sa.Engine, options: dict[str, Any], field: str, says: str
) -> None:
    with Session(queue_engine) as session, no_sql(queue_engine):
        with pytest.raises(InvalidJobError, match=says) as refused:
            sqla_jobs.enqueue_debounced(session, EmailJob(task="digest"), **options)
        assert refused.value.field == field
        at = datetime.now(timezone.utc)
        with pytest.raises(InvalidJobError, match="leave run_at unset"):
            sqla_jobs.enqueue_debounced(session, EmailJob(task="digest", run_at=at), window=5)
    assert jobs(queue_engine) == []


PROCESSES = 6
TRANSACTIONS = 60


@pytest.mark.slow
def test_concurrent_bursts_with_rollbacks_run_once_each(queue_engine: sa.Engine) -> None:
    """Six processes enqueue 60 debounced jobs each under 20 keys, rolling back about 30%;
    then a worker runs what is due. Twice (two bursts per key). Each burst leaves exactly
    one job per key that a committed transaction enqueued (none for keys only rolled-back
    ones did), carrying the arguments of one of those, and that job runs exactly once."""
    url = queue_engine.url.render_as_string(hide_password=False)
    registry = Registry(EmailJob, result_model=EmailJobResult)

    @registry.task(max_attempts=1)
    def debounced(ctx: JobContext) -> dict[str, Any]:
        return dict(ctx.args)

    seen: set[int] = set()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(PROCESSES, mp_context=context) as pool:
        for burst in (1, 2):
            futures = [
                pool.submit(enqueue_randomly, url, seed, burst, TRANSACTIONS, pooled_connect_args())
                for seed in range(PROCESSES)
            ]
            committed = [entry for future in futures for entry in future.result(timeout=600)]
            with queue_engine.connect() as connection:
                pending = connection.execute(
                    sa.select(EmailJob.unique_key, EmailJob.id, EmailJob.args).where(
                        EmailJob.status == "pending"
                    )
                ).all()
            by_key = {row.unique_key: row for row in pending}
            assert len(by_key) == len(pending)  # one pending job per key
            keys = {key for key, _, _ in committed}
            assert set(by_key) == keys  # none lost, none from a rolled-back transaction
            assert len(keys) == KEYS - len(DOOMED)
            assert not keys & {f"key-{k}" for k in DOOMED}
            for key, told, _ in committed:  # every committed enqueue was told its job
                assert by_key[key].id == told
            for key, row in by_key.items():  # the arguments of a committed enqueue of it
                assert (key, row.id, row.args) in committed
                assert row.args["burst"] == burst
            assert not seen & {row.id for row in pending}  # new jobs for a new burst
            seen |= {row.id for row in pending}
            advance_clock(queue_engine, EmailJob, WINDOW + 1)
            total = len(seen)
            with running(registry, queue_engine, concurrency=4):
                wait_until(
                    lambda total=total: done(queue_engine) == total,  # type: ignore[misc]
                    timeout=PATIENCE,
                    message="every debounced job ran",
                )
    with Session(queue_engine) as session:
        ran = session.execute(sa.select(EmailJob.id, EmailJob.status, EmailJob.attempts)).all()
        results = {r.job_id: r.value for r in session.scalars(sa.select(EmailJobResult))}
    assert {row.id for row in ran} == seen  # nothing but the bursts' jobs
    assert all((row.status, row.attempts) == ("succeeded", 1) for row in ran)  # once each
    assert set(results) == seen


def done(engine: sa.Engine) -> int:
    with engine.connect() as connection:
        count: int = connection.execute(
            sa.text("SELECT count(*) FROM email_jobs WHERE status = 'succeeded'")
        ).scalar_one()
    return count
