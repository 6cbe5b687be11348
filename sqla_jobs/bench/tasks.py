"""The jobs the bench's workers run, and the queues they run in."""

from __future__ import annotations

import time
from typing import Final

from sqla_jobs.bench.statements import write_row
from sqla_jobs.context import JobContext
from sqla_jobs.models import Job, JobResult
from sqla_jobs.registry import Registry

__all__ = [
    "LEASE_SECONDS",
    "Q_ASYNC",
    "Q_CLAIM",
    "Q_ENQUEUE",
    "Q_HISTORY",
    "Q_LATENCY",
    "Q_LEASE",
    "Q_LOCK",
    "latency_registry",
    "registry",
]

Q_LEASE: Final = "bench_lease"
Q_LOCK: Final = "bench_lock"
Q_LATENCY: Final = "bench_latency"
Q_CLAIM: Final = "bench_claim"
Q_HISTORY: Final = "bench_history"
Q_ENQUEUE: Final = "bench_enqueue"
Q_ASYNC: Final = "bench_async"
Q_KEYS: Final = "bench_keys"
LEASE_SECONDS: Final = 300.0
SLOW_HANDLER_SECONDS: Final = 0.2

registry = Registry(Job, default_lease=LEASE_SECONDS)
latency_registry = Registry(Job, result_model=JobResult)


@registry.task(queue=Q_LEASE)
def bench_noop(ctx: JobContext) -> None:
    """A no-op job in lease mode."""


@registry.task(queue=Q_LOCK, mode="lock")
def bench_noop_lock(ctx: JobContext) -> None:
    """A no-op job in lock-held mode."""


@registry.task(queue=Q_LOCK, mode="lock")
def bench_write_lock(ctx: JobContext) -> None:
    """A lock-held job that writes one row through the claim's session, as lock-held
    handlers are for: its write commits with its completion (``drain.lock.writes``)."""
    ctx.session.execute(write_row(), {"job_id": ctx.job.id})


@latency_registry.task(queue=Q_LATENCY)
def bench_stamp(ctx: JobContext) -> float:
    """Returns the wall-clock time at which the handler started."""
    return time.time()


@latency_registry.task(queue=Q_LATENCY)
def bench_stamp_slow(ctx: JobContext) -> float:
    """Returns the wall-clock time at which the handler started, after working 200 ms."""
    started = time.time()
    time.sleep(SLOW_HANDLER_SECONDS)
    return started
