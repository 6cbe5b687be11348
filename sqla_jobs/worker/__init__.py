"""The worker: claims jobs, runs their handlers, records what happened.

::

    worker = Worker(registry, engine, queues=["email"], concurrency=8)
    worker.run()          # blocks; SIGTERM/SIGINT stop it gracefully, a second one at once

    with Worker(registry, engine) as worker:   # or: async with, inside an application
        ...               # runs in background threads until the block ends

Or from the command line: ``sqla-jobs worker myapp.tasks:registry --queues email``.

How a job goes through it, one module per role:

:mod:`~sqla_jobs.worker.fetcher`
    claims up to as many jobs as there are free slots, in a short transaction that commits
    (the attempt is counted, the lease starts), woken by a NOTIFY
    (:mod:`~sqla_jobs.worker.listener`) or the poll interval.
:mod:`~sqla_jobs.worker.runner`
    the one path every attempt takes to exactly one outcome, on ``concurrency`` handler
    threads; a handler that returns an awaitable has it awaited on an event loop thread.
    Lock mode: the handler runs inside the transaction that holds the job's row lock and
    commits its completion.
:mod:`~sqla_jobs.worker.writer`
    commits the outcomes, batched, fenced by attempt; a poison outcome is isolated.
:mod:`~sqla_jobs.worker.heartbeat`
    extends the leases of the attempts the worker holds.
:mod:`~sqla_jobs.worker.lifecycle`
    :class:`Worker`: start, supervision, signals, shutdown; with its settings' rules
    (:mod:`~sqla_jobs.worker.settings`), the restartable role threads
    (:mod:`~sqla_jobs.worker.roles`) and how health is judged
    (:mod:`~sqla_jobs.worker.health`).
:mod:`~sqla_jobs.worker.state`
    what they share, with its locking rules, and where "one outcome per attempt" lives.
:mod:`~sqla_jobs.worker.group`
    :class:`WorkerGroup`: one worker per database in one process, for jobs spread over
    several primaries.

Shutdown
    The first SIGTERM or SIGINT (to :meth:`Worker.run` on the main thread, unless
    ``handle_signals=False``), :meth:`Worker.stop` or the
    end of a ``with`` block stops the claiming; running jobs
    get ``grace`` seconds to finish. The jobs still running then are given back (runnable at
    once, the attempt not charged) after the worker has ended its own lock-mode
    transactions, and :meth:`Worker.run` returns 0. A second signal exits the process at
    once with status 128 + the signal number; its jobs come back when their leases run out.

Faults
    Database errors are retried with exponential backoff (``database_error``, then
    ``database_recovered``); a kept connection found gone after a server restart is
    replaced at once. A role thread that dies of a bug is logged (``thread_crashed``) and
    restarted. :meth:`Worker.health` reports what is stuck, and ``health_file`` is touched
    every second while the worker is healthy, for a liveness probe.

The events the worker logs are listed in :mod:`sqla_jobs.events`.
"""

from sqla_jobs.worker.group import WorkerGroup
from sqla_jobs.worker.lifecycle import Worker, WorkerHealth
from sqla_jobs.worker.settings import (
    ClaimSettings,
    MaintenanceSettings,
    ObservabilitySettings,
    SessionSettings,
    TimingSettings,
    WorkerOptions,
)

__all__ = [
    "ClaimSettings",
    "MaintenanceSettings",
    "ObservabilitySettings",
    "SessionSettings",
    "TimingSettings",
    "Worker",
    "WorkerGroup",
    "WorkerHealth",
    "WorkerOptions",
]
