"""Pausing and resuming a queue (see :mod:`sqla_jobs.queue`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from sqla_jobs import validation
from sqla_jobs._queries.pauses import PAUSE, PAUSED_QUEUES, RESUME
from sqla_jobs._queries.run import Executor, job_table_of
from sqla_jobs.errors import InvalidJobError
from sqla_jobs.schema import JobMixin
from sqla_jobs.schema.pauses import MAX_REASON_LENGTH

__all__ = ["QueuePause", "pause_queue", "paused_queues", "resume_queue"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class QueuePause:
    """A paused queue: since when (``paused_at``, the database's clock) and why
    (``reason``, None when none was given). ``paused_seconds``: for how long, when read by
    :func:`paused_queues` (None from :func:`pause_queue`)."""

    queue: str
    paused_at: datetime
    reason: str | None = None
    paused_seconds: float | None = None


def _check_reason(reason: object) -> str | None:
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise InvalidJobError("reason", f"must be a string or None, not {type(reason).__name__}")
    if len(reason) > MAX_REASON_LENGTH:
        raise InvalidJobError(
            "reason", f"is {len(reason)} characters, the limit is {MAX_REASON_LENGTH}"
        )
    if "\x00" in reason:
        raise InvalidJobError("reason", "must not contain NUL characters")
    return reason


def pause_queue(
    session: Executor, model: type[JobMixin], queue: str, *, reason: str | None = None
) -> QueuePause:
    """Pause ``queue``: from the caller's commit on, no claim of ``model``'s jobs starts an
    attempt of a job of that queue, on any worker, with no worker restarted and no leader.

    The claim statements themselves read the table's pause table (``<table>_pauses``,
    ``sqla_jobs.schema.pauses.pause_table``): a plain, keyed, limited, lease-mode or
    lock-held claim skips the queue's pending jobs and its expired leases (a job whose
    worker died is taken over once the queue is resumed). Jobs running in the queue go on
    and end as usual (complete, fail, retry: a retry waits, pending, for the resume).
    Enqueueing goes on too: the jobs wait.

    Any well-formed queue name can be paused, whether or not a job names it yet: a queue
    exists as soon as one does, and pausing one before its first job is enqueued holds that
    job. Idempotent: pausing a paused queue keeps its ``paused_at`` (and its reason,
    unless a new ``reason`` is given). Runs in the caller's transaction: nothing happens
    until the caller commits. Returns the pause.

    Raises :class:`~sqla_jobs.errors.InvalidJobError` for a malformed ``queue`` (the rule of
    every queue name, ``sqla_jobs.validation.NAME_RULE``) or ``reason`` (a string of at
    most 1000 characters, or None), and :class:`~sqla_jobs.errors.ConfigurationError` for a
    ``model`` that is not a job model, before any SQL::

        with Session(engine) as session, session.begin():
            sqla_jobs.pause_queue(session, EmailJob, "email", reason="provider outage")
    """
    table = job_table_of(model)
    name = validation.check_name("queue", queue)
    why = _check_reason(reason)
    row = PAUSE.one(session, table, {"queue": name, "reason": why})
    assert row is not None  # an upsert returns its row
    logger.info(
        "queue %s of %s paused",
        name,
        table.fullname,
        extra={"action": "queue_paused", "queue": name, "reason": row.reason},
    )
    return QueuePause(queue=row.queue, paused_at=row.paused_at, reason=row.reason)


def resume_queue(session: Executor, model: type[JobMixin], queue: str) -> bool:
    """Resume ``queue``: from the caller's commit on, claims start its jobs again, and the
    workers that serve it, woken by a notification on the table's channel (as by an
    enqueue), claim at once instead of at their next poll. Returns whether it was paused
    (resuming a queue that is not paused changes nothing, and sends nothing: idempotent).

    Runs in the caller's transaction. Raises :class:`~sqla_jobs.errors.InvalidJobError` for
    a malformed ``queue``, and :class:`~sqla_jobs.errors.ConfigurationError` for a ``model``
    that is not a job model, before any SQL."""
    table = job_table_of(model)
    name = validation.check_name("queue", queue)
    resumed = RESUME.one(session, table, {"queue": name}) is not None
    if resumed:
        logger.info(
            "queue %s of %s resumed",
            name,
            table.fullname,
            extra={"action": "queue_resumed", "queue": name},
        )
    return resumed


def paused_queues(session: Executor, model: type[JobMixin]) -> list[QueuePause]:
    """The paused queues of ``model``'s jobs, by name, each with its ``paused_at``, reason
    and ``paused_seconds`` (database time). One read of the pause table, in the caller's
    transaction; no lock."""
    table = job_table_of(model)
    return [
        QueuePause(
            queue=row.queue,
            paused_at=row.paused_at,
            reason=row.reason,
            paused_seconds=None if row.paused_seconds is None else float(row.paused_seconds),
        )
        for row in PAUSED_QUEUES.rows(session, table, {})
    ]
