"""The async API is the sync implementation run through AsyncSession.run_sync."""

from __future__ import annotations

import inspect

import sqlalchemy as sa
from models import EmailJob, EmailJobResult
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import sqla_jobs
from sqla_jobs import JobStatus, aio, leasing, queue


async def test_async_claim_complete_fail_retry(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        session.add_all([EmailJob(task="ok"), EmailJob(task="bad", max_attempts=1)])

    async with AsyncSession(queue_async_engine) as session, session.begin():
        jobs = await aio.claim(session, EmailJob, limit=2, lease=30)
    by_task = {job.task: job for job in jobs}
    assert set(by_task) == {"ok", "bad"}

    async with AsyncSession(queue_async_engine) as session, session.begin():
        await aio.complete(session, by_task["ok"], result="done", result_model=EmailJobResult)
        outcome = await aio.fail(session, by_task["bad"], RuntimeError("nope"))
        assert outcome.status is JobStatus.DEAD
        await aio.retry(session, EmailJob, by_task["bad"].id)

    async with AsyncSession(queue_async_engine) as session:
        rows = (await session.execute(sa.select(EmailJob.task, EmailJob.status))).all()
        assert {row.task: row.status for row in rows} == {"ok": "succeeded", "bad": "pending"}
        stats = await aio.queue_stats(session, EmailJob)
        assert sum(s.count for s in stats) == 2
        result = await session.get(EmailJobResult, by_task["ok"].id)
        assert result is not None
        assert result.value == "done"


async def test_async_lock_held_claim(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        session.add(EmailJob(task="held"))
    async with AsyncSession(queue_async_engine) as session, session.begin():
        (job,) = await aio.claim(session, EmailJob, hold=True)
        await aio.complete(session, job)
    async with AsyncSession(queue_async_engine) as session:
        status = (await session.execute(sa.select(EmailJob.status))).scalar_one()
        assert status == "succeeded"


def test_every_operation_has_one_implementation() -> None:
    for name in aio.__all__:
        wrapper = getattr(aio, name)
        assert inspect.iscoroutinefunction(wrapper)
        # The queue's operations, or leasing's (sqla_jobs.leasing).
        implementation = getattr(queue, name, None) or getattr(leasing, name)
        assert wrapper.__wrapped__ is implementation is getattr(sqla_jobs, name)
