"""Transactional enqueue: the job exists if and only if the business transaction commits."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from models import EmailJob, Order
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqla_jobs import JobStatus


def _count(engine: sa.Engine, table: str) -> int:
    with engine.connect() as connection:
        return int(connection.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def test_committed_transaction_enqueues_with_database_defaults(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        order = Order(id=7, customer="ada")
        session.add(order)
        session.add(EmailJob(task="send_receipt", args={"order": 7}, queue="email", order=order))

    with Session(queue_engine) as session:
        job = session.execute(sa.select(EmailJob)).scalar_one()
        db_now = session.execute(sa.select(sa.func.now())).scalar_one()
        assert (job.task, job.queue, job.args, job.order_id) == (
            "send_receipt",
            "email",
            {"order": 7},
            7,
        )
        assert job.status == JobStatus.PENDING.value
        assert (job.attempts, job.max_attempts, job.priority) == (0, 20, 0)
        assert job.lease_expires_at is None
        assert job.finished_at is None
        # run_at and created_at come from the database's clock, not the client's.
        assert job.run_at <= db_now
        assert job.created_at <= db_now
        assert db_now - job.run_at < timedelta(minutes=1)


def test_rolled_back_transaction_leaves_no_job_and_no_business_row(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session:
        session.begin()
        session.add(Order(id=8, customer="bob"))
        session.add(EmailJob(task="send_receipt", args={"order": 8}))
        session.flush()  # the rows were sent to the server...
        session.rollback()  # ...and are gone with the transaction

    def business_transaction() -> None:
        with Session(queue_engine) as session, session.begin():
            session.add(EmailJob(task="send_receipt", args={"order": 9}))
            session.flush()
            raise RuntimeError("the business logic failed after the enqueue")

    with pytest.raises(RuntimeError):
        business_transaction()

    assert _count(queue_engine, "email_jobs") == 0
    assert _count(queue_engine, "orders") == 0


def test_add_all_flushes_as_one_multi_row_insert(queue_engine: sa.Engine) -> None:
    inserts: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO EMAIL_JOBS"):
            inserts.append(statement)

    event.listen(queue_engine, "before_cursor_execute", record)
    try:
        with Session(queue_engine) as session, session.begin():
            session.add_all([EmailJob(task="t", args={"i": i}, priority=i % 3) for i in range(500)])
    finally:
        event.remove(queue_engine, "before_cursor_execute", record)

    assert len(inserts) == 1
    assert _count(queue_engine, "email_jobs") == 500


def test_explicit_run_at_priority_and_max_attempts_are_stored(queue_engine: sa.Engine) -> None:
    later = datetime(2100, 1, 1, tzinfo=timezone.utc)
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t", run_at=later, priority=-5, max_attempts=3))
    with Session(queue_engine) as session:
        job = session.execute(sa.select(EmailJob)).scalar_one()
        assert (job.run_at, job.priority, job.max_attempts) == (later, -5, 3)


def test_run_at_can_be_a_database_expression(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t", run_at=sa.func.now() + sa.text("interval '1 hour'")))
    with Session(queue_engine) as session:
        delay = session.execute(sa.select(EmailJob.run_at - EmailJob.created_at)).scalar_one()
        assert delay == timedelta(hours=1)


async def test_async_session_enqueues_and_rolls_back(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        session.add_all([EmailJob(task="async_task", args={"n": n}) for n in range(3)])

    async with AsyncSession(queue_async_engine) as session:
        await session.begin()
        session.add(EmailJob(task="rolled_back"))
        await session.flush()
        await session.rollback()

    async with AsyncSession(queue_async_engine) as session:
        tasks = (await session.execute(sa.select(EmailJob.task))).scalars().all()
    assert sorted(tasks) == ["async_task"] * 3
