"""Unique jobs: at most one job per key in the key's statuses, enforced by the unique index;
a duplicate is skipped (never an error), and the caller learns the id of the job that holds
the key."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from models import EmailJob, Order
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

import sqla_jobs
import sqla_jobs.aio
from sqla_jobs import Enqueued, JobStatus, UniqueJobError
from sqla_jobs.schema import names


def _keys(engine: sa.Engine) -> list[tuple[int, str | None, str]]:
    with engine.connect() as connection:
        rows = connection.execute(
            sa.select(EmailJob.id, EmailJob.unique_key, EmailJob.status).order_by(EmailJob.id)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc, unused-ignore]


class _NoSql:
    """Fails the test if any statement is sent on the engine inside the block."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.sent: list[str] = []

    def __enter__(self) -> _NoSql:
        event.listen(self.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)
        assert self.sent == []

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.sent.append(statement)


def _wait_for_a_lock_wait(engine: sa.Engine, timeout: float = 30.0) -> None:
    """Wait until some backend waits for a lock (the enqueuer, on the holder's transaction)."""
    deadline = time.monotonic() + timeout
    with engine.connect() as connection:
        while True:
            waiting = connection.execute(
                sa.text("SELECT count(*) FROM pg_locks WHERE NOT granted")
            ).scalar_one()
            connection.rollback()
            if waiting:
                return
            assert time.monotonic() < deadline, "no enqueuer waited on the holder"
            time.sleep(0.02)


@pytest.fixture
def session(queue_engine: sa.Engine) -> Iterator[Session]:
    with Session(queue_engine) as session:
        yield session


def test_a_duplicate_is_skipped_and_the_transaction_goes_on(
    queue_engine: sa.Engine, session: Session
) -> None:
    with session.begin():
        first = sqla_jobs.enqueue_unique(session, EmailJob(task="digest", args={"user": 7}))
        again = sqla_jobs.enqueue_unique(session, EmailJob(task="digest", args={"user": 7}))
        # The business transaction is intact: more writes, and a commit.
        session.add(Order(id=1, customer="ada"))
    assert first.inserted
    assert not again.inserted
    assert again.id == first.id
    assert again.unique_key == first.unique_key
    with session.begin():
        later = sqla_jobs.enqueue_unique(session, EmailJob(task="digest", args={"user": 7}))
    assert later == Enqueued(first.id, False, first.unique_key)
    assert [row[0] for row in _keys(queue_engine)] == [first.id]
    with Session(queue_engine) as check:
        assert check.get(Order, 1) is not None


def test_the_derived_key_is_the_task_and_its_canonical_args(session: Session) -> None:
    key = sqla_jobs.unique_key_of("digest", {"a": 1, "b": [1, 2]})
    assert key == sqla_jobs.unique_key_of("digest", {"b": [1, 2], "a": 1})
    assert key.startswith("sha256:")
    assert len(key) == 7 + 64
    assert key != sqla_jobs.unique_key_of("digest", {"a": 1.0, "b": [1, 2]})
    assert key != sqla_jobs.unique_key_of("other", {"a": 1, "b": [1, 2]})
    assert sqla_jobs.unique_key_of("t") == sqla_jobs.unique_key_of("t", {})
    with session.begin():
        result = sqla_jobs.enqueue_unique(
            session, EmailJob(task="digest", args={"b": [1, 2], "a": 1})
        )
        assert result.unique_key == key
        other = sqla_jobs.enqueue_unique(session, EmailJob(task="digest", args={"a": 2}))
        assert other.inserted
        assert other.id != result.id


def test_an_explicit_key_spans_tasks_and_args(session: Session) -> None:
    with session.begin():
        one = sqla_jobs.enqueue_unique(session, EmailJob(task="a", args={"x": 1}), key="k")
        two = sqla_jobs.enqueue_unique(session, EmailJob(task="b", args={"y": 2}), key="k")
        job = session.get(EmailJob, one.id)
        assert job is not None
        assert (job.task, job.unique_key, job.unique_statuses) == ("a", "k", ["pending", "running"])
    assert one.inserted
    assert not two.inserted
    assert two.id == one.id


def test_a_period_bucket_comes_from_run_at(session: Session) -> None:
    hour = datetime(2031, 5, 4, 10, tzinfo=timezone.utc)

    def at(when: datetime) -> Enqueued:
        job = EmailJob(task="report", run_at=when)
        return sqla_jobs.enqueue_unique(session, job, period=timedelta(hours=1))

    with session.begin():
        first = at(hour + timedelta(minutes=1))
        same_hour = at(hour + timedelta(minutes=59, seconds=59))
        next_hour = at(hour + timedelta(hours=1))
        now = sqla_jobs.enqueue_unique(session, EmailJob(task="report"), period=3600)
    assert first.inserted
    assert not same_hour.inserted
    assert same_hour.id == first.id
    assert next_hour.inserted
    bucket = int(hour.timestamp()) // 3600
    assert first.unique_key == sqla_jobs.unique_key_of("report") + f"@{bucket}"
    assert next_hour.unique_key.endswith(f"@{bucket + 1}")
    assert now.inserted  # run_at defaulted to the database's now: another bucket


def test_a_finished_job_frees_its_key_unless_its_statuses_keep_it(
    queue_engine: sa.Engine, session: Session
) -> None:
    with session.begin():
        plain = sqla_jobs.enqueue_unique(session, EmailJob(task="a"))
        kept = sqla_jobs.enqueue_unique(
            session, EmailJob(task="b"), statuses=["pending", "running", JobStatus.SUCCEEDED]
        )
    with session.begin():
        jobs = sqla_jobs.claim(session, EmailJob, limit=10)
        assert {job.id for job in jobs} == {plain.id, kept.id}
        # While running, the key is still held.
        assert not sqla_jobs.enqueue_unique(session, EmailJob(task="a")).inserted
        sqla_jobs.complete_many(session, jobs)
    with session.begin():
        again = sqla_jobs.enqueue_unique(session, EmailJob(task="a"))
        refused = sqla_jobs.enqueue_unique(
            session, EmailJob(task="b"), statuses=["pending", "running", "succeeded"]
        )
    assert again.inserted
    assert again.id != plain.id
    assert refused == Enqueued(kept.id, False, refused.unique_key)
    # A job that left its statuses keeps its key as data; the index just no longer holds it.
    assert [key for _, key, _ in _keys(queue_engine)].count(again.unique_key) == 2


def test_enqueue_unique_many_reports_each_job_in_order(
    queue_engine: sa.Engine, session: Session
) -> None:
    with session.begin():
        held = sqla_jobs.enqueue_unique(session, EmailJob(task="t", args={"n": 0}))
        results = sqla_jobs.enqueue_unique_many(
            session,
            EmailJob,
            [
                {"task": "t", "args": {"n": 0}},  # held by the earlier job
                {"task": "t", "args": {"n": 1}},
                EmailJob(task="t", args={"n": 1}),  # a duplicate within the batch
                {"task": "t", "args": {"n": 2}, "unique_key": "explicit"},
                {"task": "u", "unique_key": "explicit"},  # across chunks
                {"task": "t", "args": {"n": 3}, "priority": 5, "queue": "q"},
            ],
            chunk_size=2,
        )
    assert [(r.inserted, r.id == held.id) for r in results] == [
        (False, True),
        (True, False),
        (False, False),
        (True, False),
        (False, False),
        (True, False),
    ]
    assert results[2].id == results[1].id
    assert results[4].id == results[3].id
    assert results[4].unique_key == "explicit"
    assert len(_keys(queue_engine)) == 4
    with Session(queue_engine) as check:
        last = check.get(EmailJob, results[5].id)
        assert last is not None
        assert (last.priority, last.queue) == (5, "q")


def test_within_a_batch_the_first_job_of_a_key_is_the_one_kept(session: Session) -> None:
    with session.begin():
        results = sqla_jobs.enqueue_unique_many(
            session,
            EmailJob,
            [{"task": "first", "unique_key": "k"}, {"task": "second", "unique_key": "k"}],
        )
        job = session.get(EmailJob, results[0].id)
        assert job is not None
        assert job.task == "first"
    assert [r.inserted for r in results] == [True, False]


def test_a_rolled_back_holder_frees_the_key_for_the_waiting_enqueuer(
    queue_engine: sa.Engine,
) -> None:
    # The holder is uncommitted: ON CONFLICT waits for its transaction, and inserts the job
    # once that transaction rolls back (nothing is lost); skips it once it commits.
    for outcome in ("rollback", "commit"):
        with queue_engine.begin() as connection:
            connection.execute(sa.text("TRUNCATE email_jobs"))
        holder = Session(queue_engine)
        holder.begin()
        held = sqla_jobs.enqueue_unique(holder, EmailJob(task="x"))
        got: list[Enqueued] = []

        def enqueue(got: list[Enqueued] = got) -> None:
            with Session(queue_engine) as session, session.begin():
                got.append(sqla_jobs.enqueue_unique(session, EmailJob(task="x")))

        waiter = threading.Thread(target=enqueue)
        waiter.start()
        _wait_for_a_lock_wait(queue_engine)  # on the holder's transaction
        if outcome == "rollback":
            holder.rollback()
        else:
            holder.commit()
        holder.close()
        waiter.join(30)
        assert not waiter.is_alive()
        (result,) = got
        assert result.inserted is (outcome == "rollback")
        if outcome == "commit":
            assert result.id == held.id
        assert len(_keys(queue_engine)) == 1


def test_a_holder_that_finishes_during_the_wait_lets_the_job_in(
    queue_engine: sa.Engine,
) -> None:
    # The holder commits its completion while the enqueuer waits on the holder's row: the
    # enqueuer's first statement finds no holder in its snapshot and tries again.
    with Session(queue_engine) as session, session.begin():
        first = sqla_jobs.enqueue_unique(session, EmailJob(task="y"))
    finisher = queue_engine.connect()
    transaction = finisher.begin()
    (job,) = sqla_jobs.claim(finisher, EmailJob)
    transaction.commit()
    transaction = finisher.begin()
    sqla_jobs.complete(finisher, job)  # uncommitted: its row version is locked
    got: list[Enqueued] = []

    def enqueue() -> None:
        with Session(queue_engine) as session, session.begin():
            got.append(sqla_jobs.enqueue_unique(session, EmailJob(task="y")))

    waiter = threading.Thread(target=enqueue)
    waiter.start()
    _wait_for_a_lock_wait(queue_engine)  # on the finisher's transaction
    transaction.commit()
    finisher.close()
    waiter.join(30)
    (result,) = got
    assert result.inserted
    assert result.id != first.id


def test_session_add_of_a_unique_key_is_refused_at_assignment(
    queue_engine: sa.Engine, session: Session
) -> None:
    with _NoSql(queue_engine), pytest.raises(UniqueJobError, match="enqueue_unique") as info:
        EmailJob(task="t", unique_key="k")
    assert info.value.field == "unique_key"
    job = EmailJob(task="t")
    with pytest.raises(UniqueJobError, match=r"session\.add"):
        job.unique_statuses = ["pending", "running"]
    with pytest.raises(UniqueJobError, match="enqueue_unique_many"):
        sqla_jobs.enqueue_many(session, EmailJob, [{"task": "t", "unique_key": "k"}])
    # The caller's transaction is untouched: it goes on and commits.
    with session.begin():
        session.add(job)
    assert len(_keys(queue_engine)) == 1


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({"key": ""}, "unique_key", "1 to 200 characters"),
        ({"key": "k" * 201}, "unique_key", "1 to 200 characters, got 201"),
        ({"key": 7}, "unique_key", "must be a string"),
        ({"key": "a\x00b"}, "unique_key", "NUL"),
        ({"period": 0}, "unique_period", "positive"),
        ({"period": -5}, "unique_period", "positive"),
        ({"period": 1.5}, "unique_period", "whole seconds"),
        ({"period": "1h"}, "unique_period", "unique_period"),
        ({"statuses": ["pending"]}, "unique_statuses", "must include ['running']"),
        ({"statuses": ["running", "succeeded"]}, "unique_statuses", "['pending']"),
        ({"statuses": ["pending", "running", "done"]}, "unique_statuses", "'done'"),
    ],
)
def test_bad_unique_options_are_refused_before_any_sql(
    queue_engine: sa.Engine,
    session: Session,
    options: dict[str, Any],
    field: str,
    message: str,
) -> None:
    with _NoSql(queue_engine), pytest.raises(UniqueJobError, match=re.escape(message)) as info:
        sqla_jobs.enqueue_unique(session, EmailJob(task="t"), **options)
    assert info.value.field == field
    with _NoSql(queue_engine), pytest.raises(UniqueJobError):
        sqla_jobs.enqueue_unique_many(
            session,
            EmailJob,
            [{"task": "t", "unique_key": options.get("key", "ok")}],
            **{k: v for k, v in options.items() if k != "key"},
        )


def test_a_bad_job_in_a_unique_batch_is_refused_before_its_sql(
    queue_engine: sa.Engine, session: Session
) -> None:
    with _NoSql(queue_engine), pytest.raises(sqla_jobs.InvalidJobError, match="priority"):
        sqla_jobs.enqueue_unique_many(session, EmailJob, [{"task": "t", "priority": 1000}])
    with _NoSql(queue_engine), pytest.raises(sqla_jobs.InvalidJobError, match="task"):
        sqla_jobs.enqueue_unique_many(session, EmailJob, [{"args": {}}])


def test_the_unique_index_is_verified(queue_engine: sa.Engine) -> None:
    from sqla_jobs import migrations

    n = names("email_jobs")
    with queue_engine.connect() as connection:
        assert migrations.check_job_tables(connection, EmailJob) == []
        connection.execute(sa.text(f"DROP INDEX {n.unique_index}"))
        connection.execute(
            sa.text(f"CREATE UNIQUE INDEX {n.unique_index} ON email_jobs (unique_key)")
        )
        (problem,) = migrations.check_claim_indexes(connection, EmailJob)
        assert "the predicate" in problem
        assert n.unique_index in problem
        connection.rollback()


def test_jobs_without_a_key_are_not_in_the_unique_index(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.enqueue_many(session, EmailJob, [{"task": "t"}] * 100)
        sqla_jobs.enqueue_unique(session, EmailJob(task="t"))
    n = names("email_jobs")
    with queue_engine.connect() as connection:
        connection.execute(sa.text("ANALYZE email_jobs"))
        entries = connection.execute(
            sa.text("SELECT reltuples FROM pg_class WHERE relname = :name"),
            {"name": n.unique_index},
        ).scalar_one()
    assert entries == 1


@pytest.mark.asyncio
async def test_async_sessions_enqueue_unique_jobs(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        first = await sqla_jobs.aio.enqueue_unique(session, EmailJob(task="a", args={"n": 1}))
        again = await sqla_jobs.aio.enqueue_unique(session, EmailJob(task="a", args={"n": 1}))
        many = await sqla_jobs.aio.enqueue_unique_many(
            session, EmailJob, [{"task": "a", "args": {"n": 1}}, {"task": "a"}], period=60
        )
    assert first.inserted
    assert not again.inserted
    assert again.id == first.id
    assert [r.inserted for r in many] == [True, True]  # with a period: other keys


def test_a_retry_that_would_duplicate_a_held_key_is_refused(
    queue_engine: sa.Engine, session: Session
) -> None:
    with session.begin():
        first = sqla_jobs.enqueue_unique(session, EmailJob(task="once"))
        sqla_jobs.cancel(session, EmailJob, first.id)
        second = sqla_jobs.enqueue_unique(session, EmailJob(task="once"))
    assert second.inserted
    with session.begin():
        with pytest.raises(sqla_jobs.JobStateError, match="holds its unique key"):
            sqla_jobs.retry(session, EmailJob, first.id)
        session.add(Order(id=2, customer="bo"))  # the transaction is still usable
    with session.begin():
        sqla_jobs.cancel(session, EmailJob, second.id)
        sqla_jobs.retry(session, EmailJob, first.id)  # the key is free again
    assert [status for _, _, status in _keys(queue_engine)] == ["pending", "cancelled"]


def test_a_task_enqueues_unique_jobs_with_its_options(session: Session) -> None:
    registry = sqla_jobs.Registry(EmailJob)

    @registry.task(queue="digests", priority=3)
    def digest(ctx: sqla_jobs.JobContext) -> None:
        pass

    with session.begin():
        first = digest.enqueue_unique(session, {"user": 7}, period=3600)
        again = digest.enqueue_unique(session, {"user": 7}, period=3600)
        job = session.get(EmailJob, first.id)
        assert job is not None
        assert (job.queue, job.priority, job.task) == ("digests", 3, "digest")
    assert first.inserted
    assert again == Enqueued(first.id, False, first.unique_key)
    assert first.unique_key.startswith(sqla_jobs.unique_key_of("digest", {"user": 7}) + "@")
