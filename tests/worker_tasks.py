"""Tasks for the worker tests: imported by real worker processes (``worker_tasks:registry``).

Each handler records what it did in ``worker_effects``: a ``start`` row committed at once on
a connection of its own (so a test sees that an attempt began, even one that dies), and an
``effect`` row that is the job's real work, committed on its own connection in lease mode
(at-least-once) or through the claim's session in lock mode (exactly once with the
completion). Handlers take their instructions from the job's ``args``:

``sleep``           seconds to sleep after the start row
``sleep_attempts``  attempts that sleep (default: every attempt)
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import NullPool

from sqla_jobs import JobMixin, JobResultMixin, RetryPolicy
from sqla_jobs.registry import JobContext, Registry
from sqla_jobs.urls import asyncpg_url, psycopg_url

DATABASE_URL_VARIABLE = "SQLA_JOBS_DATABASE_URL"
FAST_RETRY = RetryPolicy(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=100))


class Base(DeclarativeBase):
    pass


class WorkerJob(JobMixin, Base):
    __tablename__ = "worker_jobs"


class WorkerJobResult(JobResultMixin, Base):
    __tablename__ = "worker_job_results"


class Effect(Base):
    __tablename__ = "worker_effects"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int]
    attempt: Mapped[int]
    kind: Mapped[str] = mapped_column(sa.String(20))
    pid: Mapped[int]
    at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), server_default=sa.func.clock_timestamp()
    )


registry = Registry(WorkerJob, result_model=WorkerJobResult, default_lease=1.0)

_bound = threading.local()
_engines: list[sa.Engine] = []


def own_engine() -> sa.Engine:
    """An engine of the handler's own, outside the worker's, on the URL the environment
    named when the calling thread first asked. A worker's threads are its test's: a handler
    still sleeping when its test ended (a worker stopped before its handlers returned)
    writes into its own test's database, never into the next test's."""
    engine: sa.Engine | None = getattr(_bound, "engine", None)
    if engine is None:
        engine = sa.create_engine(os.environ[DATABASE_URL_VARIABLE], poolclass=NullPool)
        _bound.engine = engine
        _engines.append(engine)
    return engine


def forget_engines() -> None:
    """Dispose of the handlers' engines (at the end of a test), the calling thread's
    binding with them."""
    while _engines:
        _engines.pop().dispose()
    _bound.__dict__.clear()


def _row(ctx: JobContext, kind: str) -> Effect:
    return Effect(job_id=ctx.id, attempt=ctx.attempt, kind=kind, pid=os.getpid())


def record(ctx: JobContext, kind: str) -> None:
    """Commit a row at once, on a connection of the handler's own."""
    with Session(own_engine()) as session, session.begin():
        session.add(_row(ctx, kind))


def _sleep_time(ctx: JobContext) -> float:
    attempts = ctx.args.get("sleep_attempts")
    if attempts is not None and ctx.attempt not in attempts:
        return 0.0
    return float(ctx.args.get("sleep", 0))


def timed_sleep(ctx: JobContext) -> None:
    """Sleep as the job's args say, between a committed ``start`` and ``end`` row: the span
    a test measures overlap with (the rows carry the database's clock)."""
    record(ctx, "start")
    time.sleep(_sleep_time(ctx))
    record(ctx, "end")


@registry.task(queue="work")
def sleepy(ctx: JobContext) -> dict[str, Any]:
    """Lease mode: start row, sleep, effect row (on its own connection)."""
    record(ctx, "start")
    time.sleep(_sleep_time(ctx))
    record(ctx, "effect")
    return {"attempt": ctx.attempt}


@registry.task(queue="work", mode="lock")
def sleepy_locked(ctx: JobContext) -> None:
    """Lock mode: start row, effect row through the claim's session, then sleep."""
    record(ctx, "start")
    ctx.session.add(_row(ctx, "effect"))
    ctx.session.flush()
    time.sleep(_sleep_time(ctx))


@registry.task(queue="work", max_attempts=3, retry=FAST_RETRY)
def poison(ctx: JobContext) -> None:
    """Fails every time."""
    record(ctx, "start")
    raise RuntimeError(f"poisoned on attempt {ctx.attempt}")


@registry.task(queue="work", mode="lock", max_attempts=2)
def crasher(ctx: JobContext) -> None:
    """Kills its own worker process in the middle of its transaction, every time."""
    record(ctx, "start")
    ctx.session.add(_row(ctx, "effect"))
    ctx.session.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@registry.task(queue="work")
async def async_sleepy(ctx: JobContext) -> int:
    """A coroutine in lease mode."""
    await asyncio.to_thread(record, ctx, "start")
    await asyncio.sleep(_sleep_time(ctx))
    await asyncio.to_thread(record, ctx, "effect")
    return ctx.attempt


# The handlers' own async engines, by event loop and driver: a connection of an async driver
# belongs to the loop it was opened on, and a worker runs every coroutine handler on its one
# event loop.
_async_engines: dict[tuple[asyncio.AbstractEventLoop, str], AsyncEngine] = {}


def own_async_engine(driver: str) -> AsyncEngine:
    """The handler's own pooled async engine (``"asyncpg"`` or ``"psycopg"``) on this loop."""
    key = (asyncio.get_running_loop(), driver)
    if key not in _async_engines:
        url = os.environ[DATABASE_URL_VARIABLE]
        _async_engines[key] = create_async_engine(
            asyncpg_url(url) if driver == "asyncpg" else psycopg_url(url)
        )
    return _async_engines[key]


def dispose_async_engines(timeout: float = 10.0) -> int:
    """Dispose of the handlers' async engines on their own loops (which must still run, as
    a worker's does until it stops); return how many there were."""
    engines = list(_async_engines.items())
    _async_engines.clear()
    for (loop, _), engine in engines:
        asyncio.run_coroutine_threadsafe(engine.dispose(), loop).result(timeout)
    return len(engines)


@registry.task(queue="work")
async def async_own_session(ctx: JobContext) -> str:
    """A coroutine that writes its effect through an AsyncSession of its own, on the async
    driver ``args["driver"]``; returns the driver the session ran on."""
    async with AsyncSession(own_async_engine(ctx.args["driver"])) as session, session.begin():
        session.add(_row(ctx, "effect"))
        connection = await session.connection()
        await asyncio.sleep(_sleep_time(ctx))
        return connection.dialect.driver


@registry.task(queue="work", mode="lock")
def commits_itself(ctx: JobContext) -> None:
    """A lock-mode handler that wrongly ends the worker's transaction."""
    ctx.session.commit()


@registry.task(queue="work")
def bad_result(ctx: JobContext) -> float:
    """Returns a value jsonb cannot store."""
    return float("nan")


# -- handlers that earlier workers got wrong (tests/test_worker_faults.py) -------------------


@registry.task(queue="elsewhere")
async def async_elsewhere(ctx: JobContext) -> int:
    """A coroutine registered on a queue the test worker does not serve, enqueued onto one
    it does (``Task.job(queue=...)``)."""
    await asyncio.to_thread(record, ctx, "effect")
    return ctx.attempt


@registry.task(queue="work", max_attempts=1)
async def huge_result(ctx: JobContext) -> int:
    """Returns an int too long to encode as JSON (a ValueError, not InvalidJobError)."""
    return 10**5000


@registry.task(queue="work", max_attempts=1)
def surrogate_error(ctx: JobContext) -> None:
    """Raises with a message holding a lone surrogate (a non-UTF-8 file name)."""
    raise RuntimeError("cannot open " + os.fsdecode(b"report-\xff.csv"))


def _sync_wrapper(function: Callable[[JobContext], Awaitable[Any]]) -> Callable[[JobContext], Any]:
    @functools.wraps(function)
    def wrapper(ctx: JobContext) -> Any:
        return function(ctx)  # a coroutine object, returned by a plain function

    return wrapper


@registry.task(queue="work")
@_sync_wrapper
async def wrapped_async(ctx: JobContext) -> str:
    """An ``async def`` behind a sync decorator: not a coroutine function, returns one."""
    await asyncio.to_thread(record, ctx, "effect")
    return "wrapped"


class AsyncCallable:
    """An object whose ``__call__`` is ``async def``."""

    async def __call__(self, ctx: JobContext) -> str:
        await asyncio.to_thread(record, ctx, "effect")
        return "called"


registry.add(AsyncCallable(), name="async_callable", queue="work")


@registry.task(queue="work", mode="lock", lease=30)
def long_locked(ctx: JobContext) -> None:
    """Lock mode with a lease longer than the registry's default (1 s)."""
    record(ctx, "start")
    time.sleep(_sleep_time(ctx))


@registry.task(queue="work")
def result_of(ctx: JobContext) -> Any:
    """Returns ``args["result"]``."""
    return ctx.args.get("result")


@registry.task(queue="work", mode="lock", max_attempts=2, retry=FAST_RETRY)
def bad_write_locked(ctx: JobContext) -> None:
    """Lock mode: a write the database refuses only when the worker flushes it."""
    ctx.session.add(Effect(id=-1, job_id=ctx.id, attempt=ctx.attempt, kind="a", pid=0))
    ctx.session.add(Effect(id=-1, job_id=ctx.id, attempt=ctx.attempt, kind="b", pid=0))
