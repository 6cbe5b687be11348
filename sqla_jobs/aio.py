"""The queue operations for :class:`~sqlalchemy.ext.asyncio.AsyncSession`.

Each function here is the synchronous one from :mod:`sqla_jobs.queue`, run through
``AsyncSession.run_sync``: one implementation, awaited. Same arguments, same semantics, same
transaction rules (the caller's transaction, never committed here)::

    async with async_session.begin():
        jobs = await sqla_jobs.aio.claim(async_session, EmailJob, queues="email", limit=10)

Either async driver serves: psycopg 3's (``postgresql+psycopg://``) and asyncpg
(``postgresql+asyncpg://``, ``pip install "sqla-jobs[asyncpg]"``). Every parameter of the
statements carries its type, so asyncpg, strict about parameter types, gets each with its
cast. The Core-connection fast path of :mod:`sqla_jobs.queue` is psycopg's sync one: here
every statement goes through ``execute``.
"""

from __future__ import annotations

import importlib

try:
    # SQLAlchemy's asyncio extension runs on greenlet (untyped, hence not a plain import).
    importlib.import_module("greenlet")
except ImportError as exc:
    raise ImportError(
        "sqla_jobs.aio needs greenlet, which SQLAlchemy's asyncio extension runs on and "
        'SQLAlchemy 2.1 no longer installs: pip install "sqla-jobs[asyncio]"',
        name="greenlet",
    ) from exc

import functools
from collections.abc import Awaitable, Callable
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from sqla_jobs import leasing, queue, workflows

__all__ = [
    "acquire_leases",
    "add_steps",
    "cancel",
    "cancel_workflow",
    "claim",
    "commit",
    "complete",
    "complete_many",
    "dead_jobs",
    "dependency_results",
    "enqueue_debounced",
    "enqueue_many",
    "enqueue_unique",
    "enqueue_unique_many",
    "enqueue_workflow",
    "fail",
    "heartbeat",
    "lock",
    "pause_queue",
    "paused_queues",
    "prune",
    "prune_rates",
    "queue_stats",
    "rate_usage",
    "release",
    "release_lease",
    "release_leases",
    "renew_lease",
    "renew_leases",
    "report_progress",
    "resume_queue",
    "retry",
    "snooze",
    "tenant_depths",
    "workflow_steps",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _awaitable(
    operation: Callable[Concatenate[Session, _P], _R],
) -> Callable[Concatenate[AsyncSession, _P], Awaitable[_R]]:
    @functools.wraps(operation)
    async def run(session: AsyncSession, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return await session.run_sync(operation, *args, **kwargs)

    return run


claim = _awaitable(queue.claim)
lock = _awaitable(queue.lock)
complete = _awaitable(queue.complete)
commit = _awaitable(queue.commit)
complete_many = _awaitable(queue.complete_many)
dead_jobs = _awaitable(queue.dead_jobs)
enqueue_many = _awaitable(queue.enqueue_many)
enqueue_debounced = _awaitable(queue.enqueue_debounced)
enqueue_unique = _awaitable(queue.enqueue_unique)
enqueue_unique_many = _awaitable(queue.enqueue_unique_many)
fail = _awaitable(queue.fail)
snooze = _awaitable(queue.snooze)
report_progress = _awaitable(queue.report_progress)
heartbeat = _awaitable(queue.heartbeat)
release = _awaitable(queue.release)
retry = _awaitable(queue.retry)
cancel = _awaitable(queue.cancel)
prune = _awaitable(queue.prune)
queue_stats = _awaitable(queue.queue_stats)
prune_rates = _awaitable(queue.prune_rates)
rate_usage = _awaitable(queue.rate_usage)
tenant_depths = _awaitable(queue.tenant_depths)
pause_queue = _awaitable(queue.pause_queue)
resume_queue = _awaitable(queue.resume_queue)
paused_queues = _awaitable(queue.paused_queues)

# Leasing any row (sqla_jobs.leasing): the same one-implementation wrappers.
acquire_leases = _awaitable(leasing.acquire_leases)
renew_lease = _awaitable(leasing.renew_lease)
renew_leases = _awaitable(leasing.renew_leases)
release_lease = _awaitable(leasing.release_lease)
release_leases = _awaitable(leasing.release_leases)

# Workflows (sqla_jobs.workflows): the same.
enqueue_workflow = _awaitable(workflows.enqueue_workflow)
add_steps = _awaitable(workflows.add_steps)
cancel_workflow = _awaitable(workflows.cancel_workflow)
workflow_steps = _awaitable(workflows.workflow_steps)
dependency_results = _awaitable(workflows.dependency_results)
