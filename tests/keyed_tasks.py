"""Tasks with ordering keys for real worker processes (``keyed_tasks:registry``).

The same tables as :mod:`worker_tasks` (``worker_jobs``, ``worker_effects``); each handler
commits a ``start`` row when it begins and an ``end`` row when it is done, each stamped by
the database's ``clock_timestamp()``, so that a test can measure how many jobs of one key
ran at once.
"""

from __future__ import annotations

from worker_tasks import WorkerJob, WorkerJobResult, timed_sleep

from sqla_jobs.registry import JobContext, Registry

registry = Registry(WorkerJob, result_model=WorkerJobResult, default_lease=1.0, ordering_keys=True)


@registry.task(queue="work", key_limit=3)
def three_at_a_time(ctx: JobContext) -> None:
    timed_sleep(ctx)


@registry.task(queue="work")
def in_order(ctx: JobContext) -> None:
    timed_sleep(ctx)


@registry.task(queue="work", mode="lock")
def in_order_locked(ctx: JobContext) -> None:
    timed_sleep(ctx)
