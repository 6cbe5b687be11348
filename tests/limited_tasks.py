"""Tasks of a limited queue for real worker processes (``limited_tasks:registry``).

The same tables as :mod:`worker_tasks` (``worker_jobs``, ``worker_effects``); the queue
``work`` runs at most three jobs at once across all workers. Each handler commits a ``start``
and an ``end`` row, each stamped by the database's ``clock_timestamp()``, so that a test can
measure how many of the queue's jobs ran at once.
"""

from __future__ import annotations

from worker_tasks import WorkerJob, WorkerJobResult, timed_sleep

from sqla_jobs.registry import JobContext, Registry

#: The most jobs of the queue ``work`` running at once.
LIMIT = 3

registry = Registry(
    WorkerJob, result_model=WorkerJobResult, default_lease=1.0, queue_limits={"work": LIMIT}
)


@registry.task(queue="work")
def limited(ctx: JobContext) -> None:
    timed_sleep(ctx)


@registry.task(queue="work", mode="lock")
def limited_locked(ctx: JobContext) -> None:
    timed_sleep(ctx)
