"""The async API is the sync implementation run through AsyncSession.run_sync.

Every test that takes an async engine runs on both async drivers (``async_driver`` in
conftest.py): psycopg 3's async connection and asyncpg, which is strict about parameter
types (text, integers, floats, arrays and jsonb are distinct), prepares every statement and
decodes jsonb and timestamptz itself.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, cast

import pytest
import sqlalchemy as sa
import worker_tasks
from conftest import FreshDatabase, async_url
from ledger_models import LedgerJob, LedgerJobResult, LedgerWorkflow
from models import (
    ArchiveJob,
    EmailJob,
    EmailJobResult,
    EmailJobSchedule,
    Order,
    OrderJob,
    OrderJobResult,
    OrderWorkflow,
    ReportJob,
    ReportJobResult,
    TenantJob,
)
from sqlalchemy.dialects.postgresql import asyncpg as postgresql_asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.sql.compiler import SQLCompiler
from worker_harness import JobDatabase, running, wait_until

import sqla_jobs
from sqla_jobs import (
    ClaimedJob,
    JobMixin,
    JobNotFoundError,
    JobStatus,
    LeaseLostError,
    aio,
    leasing,
    queue,
    workflows,
)
from sqla_jobs import _queries as statements
from sqla_jobs._queries import history as history_queries
from sqla_jobs._queries import workflows as workflow_queries
from sqla_jobs._queries.run import Query
from sqla_jobs.history import history_table
from sqla_jobs.registry import Registry
from sqla_jobs.testing import assert_enqueued

# A time zone that is not the server's nor UTC: an aware datetime must arrive as the same
# instant whatever the driver does with its offset.
_PLUS_5 = timezone(timedelta(hours=5, minutes=30))


async def _enqueue(engine: AsyncEngine, *jobs: JobMixin) -> list[int]:
    async with AsyncSession(engine) as session, session.begin():
        session.add_all(jobs)
        await session.flush()
        return [job.id for job in jobs]


async def _claim(engine: AsyncEngine, model: type[JobMixin] = EmailJob, **kwargs: Any) -> Any:
    async with AsyncSession(engine) as session, session.begin():
        return await aio.claim(session, model, **kwargs)


async def _row(engine: AsyncEngine, job_id: int, model: type[JobMixin] = EmailJob) -> Any:
    table: sa.Table = model.__table__  # type: ignore[attr-defined]
    statement = sa.select(table, sa.func.statement_timestamp().label("db_now"))
    async with AsyncSession(engine) as session:
        return (await session.execute(statement.where(table.c.id == job_id))).one_or_none()


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
        assert [(s.status, s.count) for s in stats] == [(JobStatus.PENDING, 1)]  # live jobs only
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
        # The queue's operations, leasing's (sqla_jobs.leasing) or workflows'.
        implementation = (
            getattr(queue, name, None) or getattr(leasing, name, None) or getattr(workflows, name)
        )
        assert wrapper.__wrapped__ is implementation is getattr(sqla_jobs, name)


def _built_statements() -> Iterator[tuple[str, Any]]:
    """Every statement builder of sqla_jobs._queries, built for the test models."""
    tables = {
        "table": EmailJob.__table__,
        "result_table": EmailJobResult.__table__,
        "schedule_table": EmailJobSchedule.__table__,
    }
    for name in statements.__all__:
        builder = getattr(statements, name)
        if not inspect.isfunction(builder):
            continue
        parameters = inspect.signature(builder).parameters
        args = [tables[p] for p in parameters if p in tables]
        variants: list[dict[str, Any]] = [{}]
        if "column" in parameters:  # the fair shares' statements: a model with a tenant column
            args = [TenantJob.__table__]
            variants = [{"column": "tenant"}]
        if "steps" in parameters:  # prune: a model with workflow steps leaves them
            args = [OrderJob.__table__]
            variants = [{}, {"steps": True}]
        if "queue_count" in parameters:
            variants = [{"queue_count": 1}, {"queue_count": 2}]
            if "limited" in parameters:  # a limited queue is claimed on its own
                variants.append({"queue_count": 1, "limited": True})
        elif "limited" in parameters:
            variants = [options | more for options in variants for more in ({}, {"limited": True})]
        elif "local" in parameters:
            variants = [{"local": True}, {"local": False}]
        elif "name" in parameters:  # reset_setting(name): one of the worker's settings
            variants = [{"name": setting} for setting in sorted(statements.WORKER_SETTINGS)]
        elif "history" in parameters:  # a model with partitioned_history reads it too
            variants = [{}, {"history": history_table(ArchiveJob)}]
        if "rows" in parameters:  # lock_keys: the rows it reads per queue
            variants = [options | {"rows": 64} for options in variants]
        if "busy" in parameters:  # walk_keys after a short claim
            variants += [options | {"busy": True} for options in variants]
        if "rated" in parameters:  # claim_keyed with per-key rate limits
            variants += [options | {"rated": True} for options in variants]
        if "json_text" in parameters:  # a claim on asyncpg reads jsonb as text
            variants += [options | {"json_text": True} for options in variants]
        known = set(tables) | {
            *("queue_count", "limited", "rows", "local", "name", "history", "busy", "json_text"),
            *("rated", "column", "steps"),
        }
        assert set(parameters) <= known, f"{name}: teach this test its parameters"
        for options in variants:
            built = builder(*args, **options)
            # DDL (VACUUM) takes no parameters.
            if isinstance(built, sa.ClauseElement) and not isinstance(
                built, sa.schema.ExecutableDDLElement
            ):
                # Tables by name: a Table's repr holds object addresses, which differ between
                # the test processes that must collect the same ids.
                shown = {k: v.name if isinstance(v, sa.Table) else v for k, v in options.items()}
                yield f"{name}{shown or ''}", built


def _built_workflow_statements() -> Iterator[tuple[str, Any]]:
    """Every statement of sqla_jobs._queries.workflows (its Query objects), built for the
    test models with steps."""
    tables = {
        "table": OrderJob.__table__,
        "workflow": OrderWorkflow.__table__,
        "results": OrderJobResult.__table__,
        # A model with steps and a history (its history is read where an ended workflow's
        # steps moved; the history's own statements of steps are built below).
        "history": history_table(LedgerJob),
    }
    for name in workflow_queries.__all__:
        query = getattr(workflow_queries, name)
        if not isinstance(query, Query):
            continue
        parameters = inspect.signature(query.builder).parameters
        assert set(parameters) <= set(tables), f"{name}: teach this test its parameters"
        positional = [p for p, v in parameters.items() if v.kind is v.POSITIONAL_OR_KEYWORD]
        keywords = {p: tables[p] for p, v in parameters.items() if v.kind is v.KEYWORD_ONLY}
        yield f"workflows.{name}", query.builder(*(tables[p] for p in positional), **keywords)
    ledger: dict[str, Any] = {
        "table": LedgerJob.__table__,
        "result_table": LedgerJobResult.__table__,
        "workflow": LedgerWorkflow.__table__,
    }
    for query in (
        history_queries.SWEEP,
        history_queries.STEP_WORKFLOW,
        history_queries.BRING_BACK,
        history_queries.PRUNE_ENDED_WORKFLOWS,
    ):
        parameters = inspect.signature(query.builder).parameters
        assert set(parameters) <= set(ledger), f"{query.builder.__name__}: teach this test"
        positional = [ledger[p] for p, v in parameters.items() if v.kind is v.POSITIONAL_OR_KEYWORD]
        keywords = {p: ledger[p] for p, v in parameters.items() if v.kind is v.KEYWORD_ONLY}
        yield f"history.{query.builder.__name__}[steps]", query.builder(*positional, **keywords)
    yield "history.lock_workflow", history_queries.LOCK_WORKFLOW.builder(ledger["workflow"])


@pytest.mark.parametrize(
    ("name", "statement"),
    [*_built_statements(), *_built_workflow_statements()],
    ids=lambda v: v,
)
def test_every_statement_parameter_is_typed(name: str, statement: sa.ClauseElement) -> None:
    """asyncpg takes a parameter only as the type it was prepared with; a typed bind
    parameter is sent with its cast (``$1::VARCHAR``), an untyped one leaves the server to
    guess, which fails or picks a type the value is not."""
    dialect = postgresql_asyncpg.dialect()  # type: ignore[no-untyped-call]
    compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
    untyped = [key for key, bind in compiled.binds.items() if bind.type._isnull]
    assert not untyped, f"{name}: untyped parameters {untyped}"


# -- enqueue ------------------------------------------------------------------------------


async def test_orm_enqueue_reads_every_column_back_without_io(
    queue_async_engine: AsyncEngine,
) -> None:
    """After the flush, every column of a job is loaded: reading one does no lazy load,
    which an AsyncSession cannot do (``MissingGreenlet``)."""
    run_at = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=_PLUS_5)
    args = {"name": "Zoë", "nested": {"list": [1, 2.5, None, True]}, "big": 2**63}
    async with AsyncSession(queue_async_engine) as session, session.begin():
        order = Order(id=7, customer="ada")
        plain = EmailJob(task="plain")
        full = EmailJob(
            task="full",
            queue="email",
            args=args,
            priority=-5,
            run_at=run_at,
            max_attempts=3,
            order=order,
        )
        later = EmailJob(task="later", run_at=sa.func.now() + sa.text("interval '1 hour'"))
        session.add_all([order, plain, full, later])
        await session.flush()
        db_now = (await session.execute(sa.select(sa.func.now()))).scalar_one()
        # No await from here on: any attribute that is not loaded would raise.
        assert (plain.queue, plain.args, plain.priority, plain.max_attempts) == (
            "default",
            {},
            0,
            20,
        )
        assert (plain.status, plain.attempts, plain.run_at, plain.created_at) == (
            "pending",
            0,
            db_now,
            db_now,
        )
        assert (plain.lease_expires_at, plain.leased_by, plain.finished_at) == (None, None, None)
        assert plain.last_error is None
        assert (full.queue, full.args, full.priority, full.max_attempts) == ("email", args, -5, 3)
        assert full.run_at == run_at
        assert full.order_id == 7
        assert later.run_at == db_now + timedelta(hours=1)
        full_id = full.id
        assert all(isinstance(job.id, int) for job in (plain, full, later))
    stored = await _row(queue_async_engine, full_id)
    assert (stored.args, stored.run_at, stored.order_id) == (args, run_at, 7)


async def test_task_enqueue_in_an_async_session(queue_async_engine: AsyncEngine) -> None:
    registry = Registry(EmailJob)

    @registry.task(queue="email", priority=3, max_attempts=4)
    def send_receipt(ctx: Any) -> None:
        pass

    async with AsyncSession(queue_async_engine) as session, session.begin():
        order = Order(id=8, customer="bob")
        session.add(order)
        job = send_receipt.enqueue(session, {"order": 8}, order=order)
        assert isinstance(job, EmailJob)
        await session.flush()
        assert (job.task, job.queue, job.priority, job.max_attempts, job.order_id) == (
            "send_receipt",
            "email",
            3,
            4,
            8,
        )
        # The test helpers read through the session's sync side.
        found = await session.run_sync(
            assert_enqueued, EmailJob, task="send_receipt", args={"order": 8}, count=1
        )
        job_id = job.id
        assert [j.id for j in found] == [job_id]

    async with AsyncSession(queue_async_engine) as session:
        session.begin()
        send_receipt.enqueue(session, {"order": 9})
        await session.flush()
        await session.rollback()
    (claimed,) = await _claim(queue_async_engine, queues="email", limit=10)
    assert (claimed.id, claimed.args) == (job_id, {"order": 8})


async def test_enqueue_many_every_kind_of_value(queue_async_engine: AsyncEngine) -> None:
    run_at = datetime(2030, 1, 1, 12, tzinfo=_PLUS_5)
    async with AsyncSession(queue_async_engine) as session, session.begin():
        session.add(Order(id=7, customer="ada"))
        count = await aio.enqueue_many(
            session,
            EmailJob,
            [
                {"task": "plain"},
                {
                    "task": "full",
                    "queue": "email",
                    "args": {"name": "Zoë", "x": [1, 2.5, None], "big": 2**63},
                    "priority": -5,
                    "run_at": run_at,
                    "max_attempts": 3,
                    "order_id": 7,
                },
                EmailJob(task="instance", args={"y": True}, queue="email"),
            ],
        )
        assert count == 3
    async with AsyncSession(queue_async_engine) as session:
        jobs = (await session.scalars(sa.select(EmailJob).order_by(EmailJob.id))).all()
    plain, full, instance = jobs
    assert (plain.queue, plain.args, plain.priority, plain.max_attempts) == ("default", {}, 0, 20)
    assert (full.queue, full.priority, full.run_at, full.max_attempts, full.order_id) == (
        "email",
        -5,
        run_at,
        3,
        7,
    )
    assert full.args == {"name": "Zoë", "x": [1, 2.5, None], "big": 2**63}
    assert (instance.task, instance.args, instance.queue) == ("instance", {"y": True}, "email")


async def test_enqueue_many_in_chunks_under_a_savepoint(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        session.add(Order(id=1, customer="kept"))
        with pytest.raises(sqla_jobs.InvalidJobError, match="priority"):
            await aio.enqueue_many(
                session,
                EmailJob,
                [*({"task": "t"} for _ in range(25)), {"task": "t", "priority": 1000}],
                chunk_size=10,
            )
        assert await aio.enqueue_many(session, EmailJob, [{"task": "t"}] * 25, chunk_size=10) == 25
    async with AsyncSession(queue_async_engine) as session:
        assert (await session.execute(sa.select(sa.func.count(EmailJob.id)))).scalar_one() == 25
        assert await session.get(Order, 1) is not None


# -- claim and outcomes -------------------------------------------------------------------


async def test_claim_from_several_queues_returns_typed_data(
    queue_async_engine: AsyncEngine,
) -> None:
    await _enqueue(
        queue_async_engine,
        EmailJob(task="a", queue="one", args={"n": 1}, priority=1),
        EmailJob(task="b", queue="two", args={"n": [2.5]}),
        EmailJob(task="c", queue="three"),
    )
    jobs = await _claim(queue_async_engine, queues=["one", "two"], limit=10, lease=12.5)
    assert [(job.task, job.args) for job in jobs] == [("b", {"n": [2.5]}), ("a", {"n": 1})]
    for job in jobs:
        assert isinstance(job, ClaimedJob)
        assert (job.attempt, job.max_attempts) == (1, 20)
        assert job.run_at.tzinfo is not None
        assert job.lease_expires_at.tzinfo is not None
        stored = await _row(queue_async_engine, job.id)
        assert (stored.status, stored.lease_expires_at) == ("running", job.lease_expires_at)
        assert stored.leased_by == queue.default_worker_name()
    lease = jobs[0].lease_expires_at - (await _row(queue_async_engine, jobs[0].id)).db_now
    assert timedelta(seconds=11) < lease <= timedelta(seconds=12.5)
    assert await _claim(queue_async_engine, queues=["one", "two"]) == []


@pytest.mark.parametrize(
    "value",
    ["done", 42, 2**70, 2.5, True, [1, "x", None], {"nested": {"a": [1.5]}}, None],
    ids=repr,
)
async def test_complete_stores_any_json_result(queue_async_engine: AsyncEngine, value: Any) -> None:
    (job_id,) = await _enqueue(queue_async_engine, EmailJob(task="t"))
    (job,) = await _claim(queue_async_engine)
    async with AsyncSession(queue_async_engine) as session, session.begin():
        await aio.complete(session, job, result=value, result_model=EmailJobResult)
    async with AsyncSession(queue_async_engine) as session:
        result = await session.get(EmailJobResult, job_id)
        assert result is not None
        assert result.value == value
    assert (await _row(queue_async_engine, job_id)).status == "succeeded"


async def test_complete_many_delete_on_success_and_stale_attempts(
    queue_async_engine: AsyncEngine,
) -> None:
    jobs = [ReportJob(task="r", args={"i": i}) for i in range(4)]
    ids = await _enqueue(queue_async_engine, *jobs)
    stale = await _claim(queue_async_engine, ReportJob, limit=1, lease=0.05)
    await asyncio.sleep(0.1)
    fresh = await _claim(queue_async_engine, ReportJob, limit=4)
    assert len(fresh) == 4
    async with AsyncSession(queue_async_engine) as session, session.begin():
        lost = await aio.complete_many(
            session,
            [*stale, *fresh],
            results=[{"i": job.args["i"]} for job in [*stale, *fresh]],
            result_model=ReportJobResult,
        )
    assert lost == stale
    async with AsyncSession(queue_async_engine) as session:
        assert (await session.execute(sa.select(ReportJob.id))).all() == []
        values = (await session.scalars(sa.select(ReportJobResult.value))).all()
        assert sorted(v["i"] for v in values) == [0, 1, 2, 3]
        assert sorted((await session.scalars(sa.select(ReportJobResult.job_id))).all()) == ids
    async with AsyncSession(queue_async_engine) as session, session.begin():
        with pytest.raises(LeaseLostError):
            await aio.complete(session, stale[0])


async def test_fail_with_backoff_delay_and_without_retry(queue_async_engine: AsyncEngine) -> None:
    backoff, delayed, final = await _enqueue(
        queue_async_engine, EmailJob(task="a"), EmailJob(task="b"), EmailJob(task="c")
    )
    jobs = {job.id: job for job in await _claim(queue_async_engine, limit=3)}
    policy = sqla_jobs.RetryPolicy(base=timedelta(seconds=10), cap=timedelta(seconds=60), jitter=0)
    async with AsyncSession(queue_async_engine) as session, session.begin():
        first = await aio.fail(session, jobs[backoff], "boom", policy=policy)
        second = await aio.fail(session, jobs[delayed], ValueError("x"), delay=timedelta(hours=1))
        third = await aio.fail(session, jobs[final], "no\x00more", retry=False)
        db_now = (await session.execute(sa.select(sa.func.statement_timestamp()))).scalar_one()
    assert (first.status, second.status, third.status) == (
        JobStatus.PENDING,
        JobStatus.PENDING,
        JobStatus.DEAD,
    )
    assert first.will_retry
    assert timedelta(seconds=9) < first.run_at - db_now <= timedelta(seconds=10)
    assert timedelta(minutes=59) < second.run_at - db_now <= timedelta(hours=1)
    dead = await _row(queue_async_engine, final)
    assert (dead.status, dead.last_error) == ("dead", "no\ufffdmore")
    assert "ValueError: x" in (await _row(queue_async_engine, delayed)).last_error
    async with AsyncSession(queue_async_engine) as session:
        (listed,) = await aio.dead_jobs(session, EmailJob, limit=5)
    assert (listed.id, listed.task, listed.attempts, listed.last_error) == (
        final,
        "c",
        1,
        "no\ufffdmore",
    )
    assert listed.finished_at is not None
    async with AsyncSession(queue_async_engine) as session, session.begin():
        with pytest.raises(LeaseLostError):
            await aio.fail(session, jobs[final], "again")


async def test_heartbeat_lock_and_release(queue_async_engine: AsyncEngine) -> None:
    await _enqueue(queue_async_engine, *[EmailJob(task="t") for _ in range(3)])
    jobs = await _claim(queue_async_engine, limit=3, lease=5)
    async with AsyncSession(queue_async_engine) as session, session.begin():
        assert await aio.heartbeat(session, jobs, lease=[60, timedelta(minutes=2), 30.5]) == []
        assert await aio.heartbeat(session, jobs[:1], lease=90) == []
    leases = [
        (await _row(queue_async_engine, job.id)).lease_expires_at - job.lease_expires_at
        for job in jobs
    ]
    assert leases[0] > timedelta(seconds=84)
    assert leases[1] > timedelta(seconds=114)
    assert leases[2] > timedelta(seconds=24)
    async with AsyncSession(queue_async_engine) as session, session.begin():
        assert await aio.lock(session, jobs) == jobs
        assert await aio.release(session, jobs[1:]) == []
    for job in jobs[1:]:
        released = await _row(queue_async_engine, job.id)
        assert (released.status, released.attempts, released.max_attempts) == ("pending", 1, 21)
    async with AsyncSession(queue_async_engine) as session, session.begin():
        assert await aio.heartbeat(session, jobs) == jobs[1:]
        assert await aio.lock(session, jobs) == jobs[:1]


async def test_cancel_retry_and_their_errors(queue_async_engine: AsyncEngine) -> None:
    pending, running = await _enqueue(queue_async_engine, EmailJob(task="p"), EmailJob(task="r"))
    async with AsyncSession(queue_async_engine) as session, session.begin():
        await aio.cancel(session, EmailJob, pending)
    await _claim(queue_async_engine)
    async with AsyncSession(queue_async_engine) as session, session.begin():
        # A running job's cancel is a request to its worker (tests/test_cancel.py).
        assert await aio.cancel(session, EmailJob, running) is JobStatus.RUNNING
        with pytest.raises(JobNotFoundError):
            await aio.retry(session, EmailJob, 10**12)
        await aio.retry(session, EmailJob, pending)
    assert (await _row(queue_async_engine, pending)).status == "pending"


async def test_prune_and_queue_stats(queue_async_engine: AsyncEngine) -> None:
    ids = await _enqueue(queue_async_engine, *[EmailJob(task="t") for _ in range(5)])
    later = datetime(2100, 1, 1, tzinfo=_PLUS_5)
    await _enqueue(queue_async_engine, EmailJob(task="later", run_at=later))
    async with AsyncSession(queue_async_engine) as session, session.begin():
        for job_id in ids:
            await aio.cancel(session, EmailJob, job_id)
        # Age four of the five finished jobs by an hour.
        await session.execute(
            sa.update(EmailJob)
            .where(EmailJob.id.in_(ids[:4]))
            .values(finished_at=sa.func.now() - sa.text("interval '1 hour'"))
        )
    async with AsyncSession(queue_async_engine) as session, session.begin():
        stats = await aio.queue_stats(session, EmailJob)
    # Live jobs only: the cancelled ones are history, which queue_stats does not read.
    assert [(s.queue, s.status, s.count) for s in stats] == [("default", JobStatus.PENDING, 1)]
    assert stats[0].oldest_pending_seconds is None
    async with AsyncSession(queue_async_engine) as session, session.begin():
        assert await aio.prune(session, EmailJob, older_than=timedelta(hours=2)) == 0
        assert await aio.prune(session, EmailJob, older_than=1800, limit=3) == 3
        assert await aio.prune(session, EmailJob, older_than=1800.0) == 1
    await _enqueue(queue_async_engine, EmailJob(task="now", queue="other"))
    await asyncio.sleep(0.05)
    async with AsyncSession(queue_async_engine) as session:
        stats = await aio.queue_stats(session, EmailJob)
    (other,) = [s for s in stats if s.queue == "other"]
    assert isinstance(other.oldest_pending_seconds, float)
    assert other.oldest_pending_seconds > 0


async def test_many_claims_reuse_prepared_statements(queue_async_engine: AsyncEngine) -> None:
    """More round trips than a driver's statement cache warms up in, on one connection
    and then on a fresh one: a statement prepared once keeps working."""
    await _enqueue(queue_async_engine, *[EmailJob(task="t", args={"i": i}) for i in range(30)])
    done = 0
    async with queue_async_engine.connect() as connection:
        session = AsyncSession(bind=connection)
        for _ in range(15):
            async with session.begin():
                jobs = await aio.claim(session, EmailJob, limit=1)
                await aio.complete_many(session, jobs)
                done += len(jobs)
        await session.close()
    await queue_async_engine.dispose()
    while jobs := await _claim(queue_async_engine, limit=4):
        async with AsyncSession(queue_async_engine) as session, session.begin():
            assert await aio.complete_many(session, jobs) == []
        done += len(jobs)
    assert done == 30


# -- the worker's coroutine path ----------------------------------------------------------


@pytest.fixture
def worker_db(
    fresh_database: FreshDatabase, monkeypatch: pytest.MonkeyPatch
) -> Iterator[JobDatabase]:
    """The worker tests' tables (tests/worker_tasks.py) in a database of their own."""
    database = JobDatabase(fresh_database("sqla_jobs_async_worker"))
    monkeypatch.setenv(worker_tasks.DATABASE_URL_VARIABLE, database.url)
    try:
        yield database
    finally:
        worker_tasks.forget_engines()
        database.dispose()


async def test_a_worker_runs_coroutines_that_use_an_async_session_of_their_own(
    worker_db: JobDatabase, async_driver: str
) -> None:
    """Enqueued through an AsyncSession on ``async_driver``; run by a real Worker (whose own
    connections are psycopg's) whose coroutine handler writes through a pooled AsyncSession
    of the same driver, on the worker's event loop."""
    engine = create_async_engine(async_url(worker_db.url, async_driver))
    try:
        async with AsyncSession(engine) as session, session.begin():
            task = worker_tasks.registry["async_own_session"]
            jobs = [
                task.enqueue(session, {"driver": async_driver, "n": n, "sleep": 0.05})
                for n in range(8)
            ]
            await session.flush()
            ids = [job.id for job in jobs]
    finally:
        await engine.dispose()

    def work() -> int:
        with running(worker_db, concurrency=4):
            wait_until(lambda: worker_db.all_succeeded(8), timeout=20, message="all succeed")
            # While the worker's loop still runs: an async engine's connections are closed
            # on the loop that opened them.
            return worker_tasks.dispose_async_engines()

    assert await asyncio.to_thread(work) == 1  # one engine: every coroutine ran on one loop
    for job_id in ids:
        assert worker_db.result(job_id) == async_driver
        assert len(worker_db.effects(job_id, "effect")) == 1
