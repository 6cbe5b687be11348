"""Tables and tasks of the fault harness (tests/chaos.py); workers import ``chaos_tasks:registry``.

Every handler records what it did in ``chaos_effects``:

* a ``start`` row, committed at once on a connection of the handler's own, so the harness
  sees every attempt that began (even one whose worker died a moment later);
* an ``effect`` row, the job's real work: committed on the handler's own connection in lease
  mode (at least once: an attempt whose lease was taken over may still write it), or written
  through ``ctx.session`` in lock mode, where it commits together with the completion,
  exactly once.

The four tasks, and what the harness expects of each:

``leased``        lease mode, a plain function: start, sleep ``args["sleep"]``, effect, sleep
                  ``args["after"]`` (work after the effect: a worker killed then leaves an
                  effect whose completion never commits, a duplicate once the job runs again)
``async_leased``  the same as a coroutine (runs on the worker's event loop)
``locked``        lock mode: start, effect through the claim's session, sleep
``poison``        lease mode, ``max_attempts=3``, a fast retry policy: start, sleep, raise

Leases are two seconds (heartbeats every 0.67 s), so a killed or paused worker's jobs come
back within a few seconds, and retries are quick, so a job that failed during a fault does
not wait long for its next attempt.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_jobs import JobMixin, JobResultMixin, RetryPolicy
from sqla_jobs.registry import JobContext, Registry

#: The variable the ``sqla-jobs`` command reads its database URL from; the handlers too.
DATABASE_URL_VARIABLE = "SQLA_JOBS_DATABASE_URL"
LEASE_SECONDS = 2.0
QUEUE = "chaos"
LOCK_QUEUE = "chaos_lock"
QUEUES = (QUEUE, LOCK_QUEUE)
POISON_MAX_ATTEMPTS = 3
#: Retries of jobs that failed during a fault (their effect could not be written while the
#: server was down, ...): quick, so that the drain after the faults is short.
RETRY = RetryPolicy(base=timedelta(milliseconds=200), cap=timedelta(seconds=2))
POISON_RETRY = RetryPolicy(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=200))

LEASE_TASKS = ("leased", "async_leased")
LOCK_TASKS = ("locked",)
POISON_TASKS = ("poison",)


class Base(DeclarativeBase):
    pass


class ChaosJob(JobMixin, Base):
    __tablename__ = "chaos_jobs"


class ChaosJobResult(JobResultMixin, Base):
    __tablename__ = "chaos_job_results"


class ChaosEffect(Base):
    """One row per thing a handler did: ``kind`` is ``start`` or ``effect``."""

    __tablename__ = "chaos_effects"

    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    attempt: Mapped[int]
    kind: Mapped[str] = mapped_column(sa.String(10))
    pid: Mapped[int]
    at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), server_default=sa.func.clock_timestamp()
    )
    #: When the attempt was claimed, by the database clock (its first lease's end minus the
    #: lease): the harness attributes a duplicate to a fault by it, as the attempt held its
    #: job from then on, whenever its handler got to write the start row.
    claimed_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))


registry = Registry(
    ChaosJob,
    result_model=ChaosJobResult,
    default_queue=QUEUE,
    default_lease=LEASE_SECONDS,
    default_retry=RETRY,
)

_engine: sa.Engine | None = None
_engine_lock = threading.Lock()


def own_engine() -> sa.Engine:
    """The handlers' own engine (not the worker's), on the URL the worker was given.

    ``pool_pre_ping`` replaces the connections a server restart broke.
    """
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = sa.create_engine(
                os.environ[DATABASE_URL_VARIABLE],
                pool_size=2,
                max_overflow=30,
                pool_pre_ping=True,
                connect_args={"connect_timeout": 5},
            )
        return _engine


def _row(ctx: JobContext, kind: str) -> ChaosEffect:
    return ChaosEffect(
        job_id=ctx.id,
        attempt=ctx.attempt,
        kind=kind,
        pid=os.getpid(),
        claimed_at=ctx.job.lease_expires_at - timedelta(seconds=LEASE_SECONDS),
    )


def record(ctx: JobContext, kind: str) -> None:
    """Commit a row at once, on a connection of the handler's own."""
    with Session(own_engine()) as session, session.begin():
        session.add(_row(ctx, kind))


def _sleep(ctx: JobContext, key: str = "sleep") -> float:
    return float(ctx.args.get(key, 0.0))


@registry.task
def leased(ctx: JobContext) -> dict[str, Any]:
    """Lease mode: start row, sleep, effect row (its own transaction: at least once)."""
    record(ctx, "start")
    time.sleep(_sleep(ctx))
    record(ctx, "effect")
    time.sleep(_sleep(ctx, "after"))
    return {"attempt": ctx.attempt}


@registry.task
async def async_leased(ctx: JobContext) -> dict[str, Any]:
    """A coroutine in lease mode: the same as ``leased``."""
    await asyncio.to_thread(record, ctx, "start")
    await asyncio.sleep(_sleep(ctx))
    await asyncio.to_thread(record, ctx, "effect")
    await asyncio.sleep(_sleep(ctx, "after"))
    return {"attempt": ctx.attempt}


@registry.task(queue=LOCK_QUEUE, mode="lock")
def locked(ctx: JobContext) -> None:
    """Lock mode: the effect row commits with the completion, exactly once."""
    record(ctx, "start")
    ctx.session.add(_row(ctx, "effect"))
    ctx.session.flush()
    time.sleep(_sleep(ctx))


@registry.task(max_attempts=POISON_MAX_ATTEMPTS, retry=POISON_RETRY)
def poison(ctx: JobContext) -> None:
    """Fails on every attempt, after a short sleep (so that faults hit some attempts)."""
    record(ctx, "start")
    time.sleep(_sleep(ctx))
    raise RuntimeError(f"poisoned on attempt {ctx.attempt}")
