"""Models for the several-databases tests (tests/test_worker_group.py) and drill
(tests/shards.py): an order and its job, spread over databases by the order's region with
SQLAlchemy's ``horizontal_shard``; workers import ``shard_models:registry``.

Tasks: ``fulfil`` (lease mode, sleeps ``args["sleep"]``) and ``record`` (lock mode: writes a
:class:`ShardEffect` through the claim's session, so that it commits with the completion,
exactly once)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.horizontal_shard import ShardedSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker

from sqla_jobs import JobMixin
from sqla_jobs.registry import JobContext, Registry


class Base(DeclarativeBase):
    pass


class RegionOrder(Base):
    __tablename__ = "region_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    region: Mapped[str] = mapped_column(sa.String(8))


class RegionJob(JobMixin, Base):
    __tablename__ = "region_jobs"

    order_id: Mapped[int | None] = mapped_column(sa.ForeignKey("region_orders.id"))
    order: Mapped[RegionOrder | None] = relationship()


class ShardEffect(Base):
    """One row per lock-mode completion (it commits with it)."""

    __tablename__ = "shard_effects"

    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)


QUEUE = "regions"
LOCK_QUEUE = "regions_lock"
registry = Registry(RegionJob, default_queue=QUEUE, default_lease=2.0)


@registry.task
def fulfil(ctx: JobContext) -> None:
    """Sleeps ``args["sleep"]`` seconds (default none)."""
    import time

    time.sleep(float(ctx.args.get("sleep", 0.0)))


@registry.task(queue=LOCK_QUEUE, mode="lock")
def record(ctx: JobContext) -> None:
    """Lock mode: the effect row through the claim's session."""
    ctx.session.add(ShardEffect(job_id=ctx.id))


def shard_of(mapper: Any, instance: Any, clause: Any = None) -> str:
    """The database of a row: an order's region; a job's order's."""
    if isinstance(instance, RegionOrder):
        return instance.region
    if isinstance(instance, RegionJob) and instance.order is not None:
        return instance.order.region
    raise ValueError(f"no region for {instance!r}: a job is enqueued with its order")


def sharded_sessions(engines: Mapping[str, sa.Engine]) -> sessionmaker[ShardedSession]:
    """Sessions that write each order and its job to its region's database, in one
    transaction there, and read from every database."""

    def every_shard(*_: Any, **__: Any) -> Iterable[str]:
        return list(engines)

    return sessionmaker(
        class_=ShardedSession,
        shards=dict(engines),
        shard_chooser=shard_of,
        identity_chooser=every_shard,
        execute_chooser=every_shard,
    )
