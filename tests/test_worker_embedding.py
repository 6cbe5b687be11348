"""The worker inside an application: in a thread, on the application's event loop, with the
application's session factories, and the FastAPI example of docs/how-to/embedding.md under
FastAPI's own TestClient."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from worker_harness import JobDatabase, wait_until
from worker_tasks import Effect, WorkerJob

from sqla_jobs import ConfigurationError, JobContext, Registry, Worker

PAGE = Path(__file__).resolve().parents[1] / "docs" / "how-to" / "embedding.md"


@pytest.fixture
def db(fresh_database: FreshDatabase) -> Iterator[JobDatabase]:
    database = JobDatabase(fresh_database("sqla_jobs_embed"))
    try:
        yield database
    finally:
        database.dispose()


@pytest.fixture
def engine(db: JobDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(db.url, pool_size=10)
    try:
        yield engine
    finally:
        engine.dispose()


def _enqueue(engine: sa.Engine, registry: Registry, task: str, **args: Any) -> int:
    with Session(engine) as session, session.begin():
        job = registry[task].job(args)
        session.add(job)
        session.flush()
        return job.id


def _status(engine: sa.Engine, job_id: int) -> str:
    with Session(engine) as session:
        job = session.get(WorkerJob, job_id)
        assert job is not None
        return job.status


def test_with_worker_runs_in_a_thread_and_installs_no_signal_handler(engine: sa.Engine) -> None:
    registry = Registry(WorkerJob)
    threads: list[str] = []

    @registry.task(queue="embed")
    def where(ctx: JobContext) -> None:
        threads.append(threading.current_thread().name)

    before = signal.getsignal(signal.SIGTERM)
    worker = Worker(registry, engine, poll_interval=0.1, name="embedded")
    with worker:
        assert signal.getsignal(signal.SIGTERM) is before
        job_id = _enqueue(engine, registry, "where")
        wait_until(lambda: _status(engine, job_id) == "succeeded", timeout=10, message="ran")
        assert worker.is_healthy()
    assert not worker.is_healthy()  # stopped, and the with block returned
    assert len(threads) == 1
    assert threads[0].startswith("sqla-jobs-embedded-handler-")


def test_run_off_the_main_thread_says_once_that_signals_do_not_stop_it(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry(WorkerJob)

    @registry.task(queue="embed")
    def noop(ctx: JobContext) -> None:
        pass

    def signal_lines() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.__dict__.get("action") == "signals_not_handled"
        ]

    caplog.set_level(logging.INFO, logger="sqla_jobs")
    with Worker(registry, engine, poll_interval=0.1):  # start(): embedding, signals opt-in
        pass
    assert signal_lines() == []
    before = signal.getsignal(signal.SIGTERM)
    worker = Worker(registry, engine, poll_interval=0.1)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(worker.run()))
    thread.start()
    try:
        wait_until(lambda: worker.is_healthy(), timeout=10, message="the worker runs")
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        worker.stop()
        thread.join(15)
    assert status == [0]
    (line,) = signal_lines()
    assert "SIGTERM and SIGINT do not stop it" in line


def test_run_freezes_the_startup_heap_and_start_does_not(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The call that owns the process moves what it made before starting out of the garbage
    # collector's full collections (lifecycle.freeze_startup_heap); a worker started inside
    # an application leaves the application's heap alone.
    frozen: list[bool] = []
    monkeypatch.setattr(
        "sqla_jobs.worker.lifecycle.freeze_startup_heap", lambda: frozen.append(True)
    )
    registry = Registry(WorkerJob)

    @registry.task(queue="embed")
    def noop(ctx: JobContext) -> None:
        pass

    with Worker(registry, engine, poll_interval=0.1):
        pass
    assert frozen == []
    worker = Worker(registry, engine, poll_interval=0.1, handle_signals=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: bool(frozen), timeout=10, message="run() froze the startup heap")
    finally:
        worker.stop()
        thread.join(15)
    assert frozen == [True]  # once


def test_start_raises_what_kept_the_worker_from_starting(db: JobDatabase) -> None:
    engine = sa.create_engine(sa.make_url(db.url).set(database="sqla_jobs_no_such_db"))
    try:
        worker = Worker(Registry(WorkerJob), engine)
        with pytest.raises(ConfigurationError, match="does not exist"):
            worker.start()
        with pytest.raises(ConfigurationError, match="does not exist"):
            worker.start()  # and it can be tried again
    finally:
        engine.dispose()


async def test_async_with_runs_coroutines_on_the_applications_loop(engine: sa.Engine) -> None:
    registry = Registry(WorkerJob)
    loops: list[asyncio.AbstractEventLoop] = []

    @registry.task(queue="embed")
    async def where(ctx: JobContext) -> None:
        await asyncio.sleep(0)
        loops.append(asyncio.get_running_loop())

    async with Worker(registry, engine, poll_interval=0.1) as worker:
        job_id = await asyncio.to_thread(_enqueue, engine, registry, "where")
        for _ in range(200):
            if await asyncio.to_thread(_status, engine, job_id) == "succeeded":
                break
            await asyncio.sleep(0.05)
        assert worker.is_healthy()
    assert loops == [asyncio.get_running_loop()]
    assert not asyncio.get_running_loop().is_closed()


def test_lock_mode_sessions_come_from_the_applications_factory(engine: sa.Engine) -> None:
    registry = Registry(WorkerJob)
    seen: list[Any] = []

    @registry.task(queue="embed", mode="lock")
    def write(ctx: JobContext) -> None:
        seen.append(ctx.session.info.get("made_by"))
        ctx.session.add(Effect(job_id=ctx.id, attempt=ctx.attempt, kind="effect", pid=0))

    factory = sessionmaker(engine, info={"made_by": "the application"})
    with Worker(registry, engine, poll_interval=0.1, session_factory=factory):
        job_id = _enqueue(engine, registry, "write")
        wait_until(lambda: _status(engine, job_id) == "succeeded", timeout=10, message="ran")
    assert seen == ["the application"]
    with Session(engine) as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(Effect)) == 1


async def test_a_lock_mode_coroutine_gets_an_async_session(db: JobDatabase) -> None:
    registry = Registry(WorkerJob)

    @registry.task(queue="embed", mode="lock")
    async def write(ctx: JobContext) -> str:
        ctx.async_session.add(Effect(job_id=ctx.id, attempt=ctx.attempt, kind="effect", pid=0))
        await ctx.async_session.flush()
        return "written"

    @registry.task(queue="embed", mode="lock", max_attempts=1)
    async def write_then_fail(ctx: JobContext) -> None:
        ctx.async_session.add(Effect(job_id=ctx.id, attempt=ctx.attempt, kind="effect", pid=0))
        await ctx.async_session.flush()
        raise RuntimeError("rolled back with the job's failure")

    engine = sa.create_engine(db.url, pool_size=10)
    async_engine = create_async_engine(db.url)
    sessions: async_sessionmaker[AsyncSession] = async_sessionmaker(async_engine)
    try:
        async with Worker(registry, engine, poll_interval=0.1, async_session_factory=sessions):
            ok = await asyncio.to_thread(_enqueue, engine, registry, "write")
            bad = await asyncio.to_thread(_enqueue, engine, registry, "write_then_fail")
            for _ in range(200):
                statuses = [await asyncio.to_thread(_status, engine, i) for i in (ok, bad)]
                if statuses == ["succeeded", "dead"]:
                    break
                await asyncio.sleep(0.05)
        assert statuses == ["succeeded", "dead"]
        effects = await asyncio.to_thread(db.effects)
        assert [e.job_id for e in effects] == [ok]  # the failed one's write rolled back
    finally:
        await async_engine.dispose()
        engine.dispose()


def _docs_fastapi_block() -> str:
    text = PAGE.read_text()
    marker = r"<!-- docs-test: not run, .*?tests/test_worker_embedding\.py.*?-->"
    found = re.search(marker + r"\s*```python\n(.*?)```", text, re.S)
    assert found, (
        "the FastAPI example of docs/how-to/embedding.md is missing (or its marker changed)"
    )
    return found.group(1)


def test_the_docs_fastapi_example(db: JobDatabase) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    code = _docs_fastapi_block().replace("postgresql+psycopg://app@localhost/app", db.url)
    namespace: dict[str, Any] = {"__name__": "readme_fastapi"}
    exec(compile(code, "docs/how-to/embedding.md (FastAPI example)", "exec"), namespace)
    engine: sa.Engine = namespace["engine"]
    namespace["Base"].metadata.create_all(engine)
    try:
        with TestClient(namespace["app"]) as client:
            response = client.post("/users/42")
            assert response.status_code == 200
            job_id = response.json()["job_id"]
            model = namespace["AppJob"]

            def status() -> str:
                with Session(engine) as session:
                    return str(session.get(model, job_id).status)  # type: ignore[union-attr]

            wait_until(lambda: status() == "succeeded", timeout=10, message="the job ran")
    finally:
        asyncio.run(namespace["async_engine"].dispose())
        engine.dispose()


def test_a_worker_refuses_an_async_engines_sync_engine(db: JobDatabase) -> None:
    pytest.importorskip("asyncpg")
    url = sa.make_url(db.url).set(drivername="postgresql+asyncpg")
    async_engine = create_async_engine(url)
    try:
        with pytest.raises(ConfigurationError, match="needs a sync engine"):
            Worker(Registry(WorkerJob), async_engine.sync_engine)
    finally:
        asyncio.run(async_engine.dispose())
