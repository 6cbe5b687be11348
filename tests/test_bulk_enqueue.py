"""Bulk enqueue: many jobs in one statement per chunk, in the caller's transaction."""

from __future__ import annotations

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
from sqla_jobs import InvalidJobError, JobArgumentsError, JobStatus


def _jobs(engine: sa.Engine) -> list[EmailJob]:
    with Session(engine) as session:
        return list(session.execute(sa.select(EmailJob).order_by(EmailJob.id)).scalars())


class _Statements:
    """Counts the INSERT statements sent on an engine."""

    def __init__(self, engine: sa.Engine) -> None:
        self.inserts = 0
        self.engine = engine

    def __enter__(self) -> _Statements:
        event.listen(self.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)

    def _seen(self, *args: Any) -> None:
        if args[2].lstrip().upper().startswith("INSERT"):
            self.inserts += 1


def test_rows_land_with_database_defaults(queue_engine: sa.Engine) -> None:
    run_at = datetime(2030, 1, 1, tzinfo=timezone.utc)
    with Session(queue_engine) as session, session.begin():
        session.add(Order(id=7, customer="ada"))
        count = sqla_jobs.enqueue_many(
            session,
            EmailJob,
            [
                {"task": "send_receipt"},
                {
                    "task": "send_receipt",
                    "queue": "email",
                    "args": {"order": 7, "name": "Zoë"},
                    "priority": -5,
                    "run_at": run_at,
                    "max_attempts": 3,
                    "order_id": 7,  # the model's own column, referring to a pending row
                },
                EmailJob(task="from_instance", args={"x": [1, 2.5, None]}, queue="email"),
            ],
        )
        db_now = session.execute(sa.select(sa.func.now())).scalar_one()
    assert count == 3
    plain, full, instance = _jobs(queue_engine)
    assert (plain.queue, plain.args, plain.priority, plain.max_attempts) == ("default", {}, 0, 20)
    assert (plain.status, plain.attempts, plain.order_id) == (JobStatus.PENDING.value, 0, None)
    assert plain.run_at == plain.created_at == db_now
    assert (full.queue, full.args, full.priority, full.run_at, full.max_attempts) == (
        "email",
        {"order": 7, "name": "Zoë"},
        -5,
        run_at,
        3,
    )
    assert full.order_id == 7
    assert (instance.task, instance.args, instance.queue) == (
        "from_instance",
        {"x": [1, 2.5, None]},
        "email",
    )


def test_rollback_leaves_nothing(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session:
        session.begin()
        sqla_jobs.enqueue_many(session, EmailJob, ({"task": "t"} for _ in range(2500)))
        session.rollback()
    assert _jobs(queue_engine) == []


@pytest.mark.parametrize(
    ("job", "field", "error"),
    [
        ({"task": ""}, "task", InvalidJobError),
        ({}, "task", InvalidJobError),
        ({"task": "t", "queue": "bad queue"}, "queue", InvalidJobError),
        ({"task": "t", "args": {"s": "nul\x00"}}, "args", JobArgumentsError),
        ({"task": "t", "args": [1]}, "args", JobArgumentsError),
        ({"task": "t", "args": {"f": float("nan")}}, "args", JobArgumentsError),
        ({"task": "t", "priority": 101}, "priority", InvalidJobError),
        ({"task": "t", "priority": True}, "priority", InvalidJobError),
        ({"task": "t", "max_attempts": 0}, "max_attempts", InvalidJobError),
        ({"task": "t", "run_at": datetime(2030, 1, 1)}, "run_at", InvalidJobError),  # noqa: DTZ001
        ({"task": "t", "run_at": sa.func.now()}, "run_at", InvalidJobError),
        ({"task": "t", "status": "running"}, "status", InvalidJobError),
        ({"task": "t", "attempts": 3}, "attempts", InvalidJobError),
        ({"task": "t", "nonsense": 1}, "nonsense", InvalidJobError),
    ],
)
def test_bad_input_raises_before_any_sql(
    queue_engine: sa.Engine, job: dict[str, Any], field: str, error: type[Exception]
) -> None:
    good = [{"task": "ok"}] * 5
    with _Statements(queue_engine) as seen, Session(queue_engine) as session:
        with pytest.raises(error) as raised, session.begin():
            sqla_jobs.enqueue_many(session, EmailJob, [*good, job, *good])
        assert raised.value.field == field  # type: ignore[attr-defined]
        assert seen.inserts == 0
    assert _jobs(queue_engine) == []


def test_bad_input_in_a_later_chunk_leaves_nothing_of_the_call(queue_engine: sa.Engine) -> None:
    def jobs() -> Iterator[dict[str, Any]]:
        yield from ({"task": "ok"} for _ in range(25))
        yield {"task": "ok", "priority": 1000}

    with Session(queue_engine) as session, session.begin():
        session.add(Order(id=1, customer="kept"))
        with pytest.raises(InvalidJobError, match="priority"):
            sqla_jobs.enqueue_many(session, EmailJob, jobs(), chunk_size=10)
        # the caller's transaction goes on, without any job of the failed call
    assert _jobs(queue_engine) == []
    with Session(queue_engine) as session:
        assert session.get(Order, 1) is not None


def test_generator_is_consumed_in_chunks(queue_engine: sa.Engine) -> None:
    taken: list[int] = []

    def jobs() -> Iterator[dict[str, Any]]:
        for n in range(2500):
            taken.append(n)
            yield {"task": "t", "args": {"n": n}}

    with _Statements(queue_engine) as seen, Session(queue_engine) as session, session.begin():
        assert sqla_jobs.enqueue_many(session, EmailJob, jobs(), chunk_size=1000) == 2500
    assert seen.inserts == 3
    assert taken == list(range(2500))
    assert [job.args["n"] for job in _jobs(queue_engine)] == list(range(2500))


def test_empty_input_runs_nothing(queue_engine: sa.Engine) -> None:
    with _Statements(queue_engine) as seen, Session(queue_engine) as session, session.begin():
        assert sqla_jobs.enqueue_many(session, EmailJob, iter(())) == 0
    assert seen.inserts == 0


def test_chunk_size_is_checked(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, pytest.raises(InvalidJobError, match="chunk_size"):
        sqla_jobs.enqueue_many(session, EmailJob, [{"task": "t"}], chunk_size=0)


def test_enqueued_jobs_are_claimable(queue_engine: sa.Engine) -> None:
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.enqueue_many(
            session,
            EmailJob,
            [{"task": "now", "queue": "q"}, {"task": "later", "queue": "q", "run_at": later}],
        )
    with Session(queue_engine) as session, session.begin():
        jobs = sqla_jobs.claim(session, EmailJob, queues="q", limit=10)
    assert [job.task for job in jobs] == ["now"]


async def test_async(queue_async_engine: AsyncEngine, queue_engine: sa.Engine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        count = await sqla_jobs.aio.enqueue_many(
            session, EmailJob, ({"task": "t", "args": {"n": n}} for n in range(30)), chunk_size=7
        )
    assert count == 30
    assert len(_jobs(queue_engine)) == 30
