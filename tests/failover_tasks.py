"""Tables and tasks of the failover drill (tests/failover.py); workers import
``failover_tasks:registry``.

A producer writes a :class:`DrillOrder` (the business row) and its :class:`DrillJob` in one
transaction; the job's unique key is the order's, so that a producer that retries a commit
whose outcome it does not know (the primary died during it) never enqueues twice.

Each order's job runs one of two tasks, which record what they did in ``drill_effects``:

``leased``  lease mode: sleeps, then commits an ``effect`` row on a connection of its own, then
            returns (its completion is written after: a primary killed between the two leaves
            an effect whose job runs again on the new primary, a duplicate that lease mode
            allows)
``locked``  lock mode: writes the ``effect`` row through the claim's session, so that it
            commits with the completion, exactly once, failover or not

Leases are two seconds, so the jobs the dead primary's workers held come back quickly.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_jobs import JobMixin, RetryPolicy
from sqla_jobs.registry import JobContext, Registry

DATABASE_URL_VARIABLE = "SQLA_JOBS_DATABASE_URL"
LEASE_SECONDS = 2.0
QUEUE = "drill"
LOCK_QUEUE = "drill_lock"
QUEUES = (QUEUE, LOCK_QUEUE)
TASKS = ("leased", "locked")
#: Attempts lost to the failover are retried quickly, and never run out.
RETRY = RetryPolicy(base=timedelta(milliseconds=200), cap=timedelta(seconds=1))
MAX_ATTEMPTS = 100


class Base(DeclarativeBase):
    pass


class DrillOrder(Base):
    """The business row: its id is the producer's, chosen before the transaction."""

    __tablename__ = "drill_orders"

    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    producer: Mapped[int]


class DrillJob(JobMixin, Base):
    __tablename__ = "drill_jobs"

    order_id: Mapped[int | None] = mapped_column(sa.ForeignKey("drill_orders.id"))


class DrillEffect(Base):
    """One row per effect a handler committed (``attempt``: the job's attempt then)."""

    __tablename__ = "drill_effects"

    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    attempt: Mapped[int]
    pid: Mapped[int]


registry = Registry(
    DrillJob,
    default_queue=QUEUE,
    default_lease=LEASE_SECONDS,
    default_retry=RETRY,
    default_max_attempts=MAX_ATTEMPTS,
)

_engine: sa.Engine | None = None
_engine_lock = threading.Lock()


def own_engine() -> sa.Engine:
    """The handlers' own engine, on the worker's URL (both hosts, read-write);
    ``pool_pre_ping`` replaces the connections the failover broke."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = sa.create_engine(
                os.environ[DATABASE_URL_VARIABLE], pool_size=2, max_overflow=30, pool_pre_ping=True
            )
        return _engine


def _effect(ctx: JobContext) -> DrillEffect:
    return DrillEffect(job_id=ctx.id, attempt=ctx.attempt, pid=os.getpid())


@registry.task
def leased(ctx: JobContext) -> None:
    """Lease mode: sleep, then the effect in a transaction of its own (at least once)."""
    time.sleep(float(ctx.args.get("sleep", 0.0)))
    with Session(own_engine()) as session, session.begin():
        session.add(_effect(ctx))


@registry.task(queue=LOCK_QUEUE, mode="lock")
def locked(ctx: JobContext) -> None:
    """Lock mode: the effect through the claim's session, committed with the completion."""
    ctx.session.add(_effect(ctx))
    ctx.session.flush()
    time.sleep(float(ctx.args.get("sleep", 0.0)))
