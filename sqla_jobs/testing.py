"""Helpers for your own tests: what did this transaction enqueue?

They read through your session, so they see the jobs your code added in the test's
transaction, flushed or not, and work with the usual fixture that rolls the whole test back::

    def test_checkout_sends_a_receipt(session):
        checkout(session, order_id=7)
        assert_enqueued(session, EmailJob, task="send_receipt", args={"order": 7})

To run the enqueued jobs inline, see :func:`sqla_jobs.registry.Registry` and the worker's
own documentation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from sqla_jobs.schema import JobMixin, JobStatus

__all__ = ["assert_enqueued", "assert_not_enqueued", "enqueued"]

_Job = TypeVar("_Job", bound=JobMixin)


def enqueued(
    session: Session,
    model: type[_Job],
    *,
    task: str | None = None,
    queue: str | None = None,
    args: Mapping[str, Any] | None = None,
    status: JobStatus | str = JobStatus.PENDING,
) -> list[_Job]:
    """The jobs of ``model`` in ``status`` (default pending) visible to ``session``,
    oldest first, filtered by ``task``, ``queue`` and ``args`` (a subset match: every given
    key must be present with an equal value). Flushes the session first."""
    session.flush()
    statement = select(model).where(model.status == JobStatus(status).value)
    if task is not None:
        statement = statement.where(model.task == task)
    if queue is not None:
        statement = statement.where(model.queue == queue)
    if args is not None:
        # jsonb containment: the job's args hold at least these keys and values.
        statement = statement.where(model.args.contains(dict(args)))
    return list(session.scalars(statement.order_by(model.id)))


def assert_enqueued(
    session: Session,
    model: type[_Job],
    *,
    task: str | None = None,
    queue: str | None = None,
    args: Mapping[str, Any] | None = None,
    count: int | None = None,
) -> list[_Job]:
    """Assert that at least one (or exactly ``count``) matching pending job exists; return
    them. The failure message lists what was enqueued instead."""
    found = enqueued(session, model, task=task, queue=queue, args=args)
    if (count is None and not found) or (count is not None and len(found) != count):
        everything = enqueued(session, model)
        wanted = {k: v for k, v in (("task", task), ("queue", queue), ("args", args)) if v}
        raise AssertionError(
            f"expected {count if count is not None else 'at least one'} pending "
            f"{model.__name__} matching {wanted}, found {len(found)}; pending: "
            f"{[(job.task, job.queue, job.args) for job in everything]}"
        )
    return found


def assert_not_enqueued(
    session: Session,
    model: type[_Job],
    *,
    task: str | None = None,
    queue: str | None = None,
    args: Mapping[str, Any] | None = None,
) -> None:
    """Assert that no matching pending job exists."""
    assert_enqueued(session, model, task=task, queue=queue, args=args, count=0)
