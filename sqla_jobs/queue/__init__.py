"""The queue operations: claim, complete, fail, heartbeat, release, retry, cancel, prune.

Every function takes the caller's :class:`~sqlalchemy.orm.Session` and runs inside the
caller's transaction: it may flush, it never commits, rolls back or closes (but
:func:`commit`, which the caller calls to commit an enqueue: :mod:`.committing`). A claim in lease
mode is therefore durable only once the caller commits, and a completion commits together
with whatever else the caller wrote in that transaction.

For :class:`~sqlalchemy.ext.asyncio.AsyncSession`, :mod:`sqla_jobs.aio` runs these same
functions through ``AsyncSession.run_sync``.

A typical lease-mode worker step::

    with Session(engine) as session, session.begin():
        jobs = claim(session, EmailJob, queues=["email"], limit=10)
    for job in jobs:
        with Session(engine) as session, session.begin():
            try:
                send(job.args)
            except Exception as exc:
                fail(session, job, exc)
            else:
                complete(session, job)

The operations live in four modules, all re-exported here: :mod:`.enqueueing`
(``enqueue_many``, unique jobs), :mod:`.claiming` (``claim`` in both modes, with ordering
keys and queue limits; ``lock``), :mod:`.outcomes` (``complete``, ``fail``,
``heartbeat``, ``release``) and :mod:`.admin` (``retry``, ``cancel``, ``delete``,
``prune``, ``vacuum``, statistics, dead jobs). What they share (:class:`ClaimedJob` and
the other types, the limits, the hot path's driver shortcut, the argument checks) is in
:mod:`._plumbing`.
"""

from __future__ import annotations

from sqla_jobs._queries.claiming import KEY_CLAIM_MAX, KEY_SCAN_EXTRA, key_lock_params
from sqla_jobs._queries.run import Executor, UnreadableJson, readable_jsonb, readable_values
from sqla_jobs.queue._plumbing import (
    DEFAULT_ENQUEUE_CHUNK,
    DEFAULT_LEASE,
    MAX_CLAIM_LIMIT,
    MAX_ENQUEUE_CHUNK,
    MAX_ERROR_CHARS,
    VACUUM_DEAD_ROWS,
    ClaimedJob,
    FailOutcome,
    QueueStat,
    default_worker_name,
)
from sqla_jobs.queue.admin import (
    DeadJob,
    cancel,
    cancel_attempts,
    cancel_requests,
    dead_jobs,
    delete,
    prune,
    queue_stats,
    retry,
    vacuum,
)
from sqla_jobs.queue.claiming import (
    claim,
    job_columns,
    lock,
    lock_one,
    lock_started,
)
from sqla_jobs.queue.committing import commit
from sqla_jobs.queue.enqueueing import (
    MAX_UNIQUE_KEY_LENGTH,
    Enqueued,
    enqueue_debounced,
    enqueue_many,
    enqueue_unique,
    enqueue_unique_many,
    unique_key_of,
)
from sqla_jobs.queue.outcomes import (
    complete,
    complete_attempts,
    complete_held,
    complete_many,
    fail,
    heartbeat,
    release,
    report_progress,
    snooze,
    storable_text,
)
from sqla_jobs.queue.pausing import QueuePause, pause_queue, paused_queues, resume_queue
from sqla_jobs.queue.rating import (
    RateUsage,
    TenantDepths,
    prune_rates,
    rate_usage,
    tenant_depths,
)

__all__ = [
    "DEFAULT_ENQUEUE_CHUNK",
    "DEFAULT_LEASE",
    "KEY_CLAIM_MAX",
    "KEY_SCAN_EXTRA",
    "MAX_CLAIM_LIMIT",
    "MAX_ENQUEUE_CHUNK",
    "MAX_ERROR_CHARS",
    "MAX_UNIQUE_KEY_LENGTH",
    "VACUUM_DEAD_ROWS",
    "ClaimedJob",
    "DeadJob",
    "Enqueued",
    "Executor",
    "FailOutcome",
    "QueuePause",
    "QueueStat",
    "RateUsage",
    "TenantDepths",
    "UnreadableJson",
    "cancel",
    "cancel_attempts",
    "cancel_requests",
    "claim",
    "commit",
    "complete",
    "complete_attempts",
    "complete_held",
    "complete_many",
    "dead_jobs",
    "default_worker_name",
    "delete",
    "enqueue_debounced",
    "enqueue_many",
    "enqueue_unique",
    "enqueue_unique_many",
    "fail",
    "heartbeat",
    "job_columns",
    "key_lock_params",
    "lock",
    "lock_one",
    "lock_started",
    "pause_queue",
    "paused_queues",
    "prune",
    "prune_rates",
    "queue_stats",
    "rate_usage",
    "readable_jsonb",
    "readable_values",
    "release",
    "report_progress",
    "resume_queue",
    "retry",
    "snooze",
    "storable_text",
    "tenant_depths",
    "unique_key_of",
    "vacuum",
]
