"""The helpers users get for their own tests, used as a user would, in a rolled-back session."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from models import EmailJob, EmailJobResult, Order
from sqlalchemy.orm import Session

from sqla_jobs import (
    ConfigurationError,
    InvalidJobError,
    JobContext,
    JobStatus,
    Registry,
    RetryPolicy,
)
from sqla_jobs.testing import assert_enqueued, assert_not_enqueued, enqueued, run_inline


def checkout(session: Session, order_id: int) -> None:
    """Business code under test: commits an order and its receipt job together."""
    with session.begin_nested() if session.in_transaction() else session.begin():
        order = Order(id=order_id, customer="ada")
        session.add(order)
        session.add(EmailJob(task="send_receipt", args={"order": order_id}, order=order))


def test_assert_enqueued_sees_the_jobs_of_the_transaction(db_session: Session) -> None:
    checkout(db_session, 7)
    (job,) = assert_enqueued(db_session, EmailJob, task="send_receipt", args={"order": 7})
    assert job.order_id == 7
    assert_enqueued(db_session, EmailJob, queue="default", count=1)
    assert_not_enqueued(db_session, EmailJob, task="send_invoice")
    assert enqueued(db_session, EmailJob, args={"order": 8}) == []


def test_assert_enqueued_explains_what_it_found(db_session: Session) -> None:
    checkout(db_session, 9)
    with pytest.raises(AssertionError, match=r"found 0; pending: \[\('send_receipt'"):
        assert_enqueued(db_session, EmailJob, task="send_invoice")
    with pytest.raises(AssertionError, match="expected 2"):
        assert_enqueued(db_session, EmailJob, count=2)


# -- run_inline ---------------------------------------------------------------------------


def inline_registry() -> tuple[Registry, list[str]]:
    registry = Registry(EmailJob, result_model=EmailJobResult)
    calls: list[str] = []

    @registry.task(mode="lock")
    def send_receipt(ctx: JobContext) -> dict[str, Any]:
        calls.append("send_receipt")
        order = ctx.session.get(Order, ctx.columns["order_id"])  # the job's own column
        assert order is not None
        order.customer = "ada (receipt sent)"
        follow_up.enqueue(ctx.session, {"order": order.id})  # runs in the same call
        return {"to": "ada"}

    @registry.task
    def follow_up(ctx: JobContext) -> None:
        calls.append("follow_up")

    @registry.task(retry=RetryPolicy(base=timedelta(hours=1)))
    def flaky(ctx: JobContext) -> None:
        calls.append("flaky")
        ctx.session.add(Order(id=99, customer="never"))
        raise RuntimeError("smtp down")

    @registry.task
    async def coroutine(ctx: JobContext) -> str:
        calls.append("coroutine")
        return "awaited"

    return registry, calls


def test_run_inline_runs_the_jobs_in_the_tests_own_transaction(db_session: Session) -> None:
    registry, calls = inline_registry()
    checkout(db_session, 7)  # enqueues send_receipt, tied to order 7, not committed
    db_session.add(EmailJob(task="flaky"))
    db_session.add(EmailJob(task="coroutine"))
    db_session.add(EmailJob(task="nobody_knows"))

    runs = run_inline(db_session, registry)

    assert sorted(calls) == ["coroutine", "flaky", "follow_up", "send_receipt"]
    by_task = {run.task: run for run in runs}
    assert by_task["send_receipt"].status is JobStatus.SUCCEEDED
    assert by_task["send_receipt"].result == {"to": "ada"}
    assert by_task["follow_up"].status is JobStatus.SUCCEEDED
    assert by_task["coroutine"].result == "awaited"
    # A failure is recorded with the task's retry policy (pending again in an hour), and
    # its writes are rolled back (a savepoint per job).
    assert by_task["flaky"].status is JobStatus.PENDING
    assert isinstance(by_task["flaky"].error, RuntimeError)
    assert db_session.get(Order, 99) is None
    assert by_task["nobody_knows"].status is JobStatus.DEAD
    # What the handlers wrote is there, in the test's transaction, not committed.
    order = db_session.get(Order, 7)
    assert order is not None
    assert order.customer == "ada (receipt sent)"
    stored = db_session.get(EmailJobResult, by_task["send_receipt"].job_id)
    assert stored is not None
    assert stored.value == {"to": "ada"}
    assert run_inline(db_session, registry) == []  # nothing runnable is left
    assert_enqueued(db_session, EmailJob, count=1, task="flaky")  # its retry, in an hour


def test_run_inline_stops_at_its_limit_and_refuses_bad_input(db_session: Session) -> None:
    registry, _calls = inline_registry()
    for _ in range(3):
        db_session.add(EmailJob(task="follow_up"))
    assert len(run_inline(db_session, registry, limit=2)) == 2
    assert len(run_inline(db_session, registry, queues=["default"])) == 1
    with pytest.raises(InvalidJobError, match="limit"):
        run_inline(db_session, registry, limit=0)
    with pytest.raises(ConfigurationError, match="Registry"):
        run_inline(db_session, EmailJob)  # type: ignore[arg-type]
