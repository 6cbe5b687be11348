"""Workflows run by workers: each step woken by the transaction that ended its last dependency
(the worker polls once a minute here, so only that wake-up can move a workflow along in
time), in both modes, with results passed along and steps added by a running step; and a
workflow written through an AsyncSession."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from in_process import PATIENCE, running
from models import Order, OrderJob, OrderWorkflow
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session, sessionmaker

import sqla_jobs.aio
from sqla_jobs import JobContext, Registry, Workflow
from sqla_jobs.workflows import WorkflowStatus, enqueue_workflow, wait_for_workflow

#: Longer than any test waits: a step that ran was woken, not found by a poll.
POLL = 60.0


def order_flow(order: int, *, parts: int = 0, attempts: int = 20) -> Workflow:
    """charge, then reserve and email side by side, then ship; with ``parts``, charge adds
    that many steps that ship waits for too."""
    flow = Workflow(f"order {order}")
    charge = flow.add(
        "charge",
        OrderJob(task="charge", args={"order": order, "parts": parts}, max_attempts=attempts),
    )
    stock = flow.add("reserve", OrderJob(task="reserve", args={"order": order}), after=charge)
    email = flow.add("email", OrderJob(task="email", args={"order": order}), after=charge)
    flow.add("ship", OrderJob(task="ship", args={"order": order}), after=[stock, email])
    return flow


def registry_for(mode: str, seen: dict[str, Any]) -> Registry:
    registry = Registry(OrderJob, default_mode=mode)  # type: ignore[arg-type]
    lock = threading.Lock()

    def note(key: str, value: Any) -> None:
        with lock:
            seen[key] = value

    @registry.task
    def charge(ctx: JobContext) -> dict[str, int]:
        parts = ctx.args["parts"]
        if parts:
            more = Workflow()
            for i in range(parts):
                more.add(f"part{i}", OrderJob(task="part", args={"i": i}))
            ctx.add_steps(more, then=["ship"])
        if mode == "lock":
            ctx.session.add(Order(id=ctx.args["order"], customer="charged"))
        return {"paid": 10 * ctx.args["order"]}

    @registry.task
    def reserve(ctx: JobContext) -> str:
        note(f"reserve {ctx.args['order']}", ctx.dependency_results())
        return "reserved"

    @registry.task
    def email(ctx: JobContext) -> str:
        return "emailed"

    @registry.task
    def part(ctx: JobContext) -> int:
        return int(ctx.args["i"])

    @registry.task
    def ship(ctx: JobContext) -> None:
        note(f"ship {ctx.args['order']}", ctx.dependency_results())

    return registry


@pytest.mark.parametrize("mode", ["lease", "lock"])
def test_a_worker_runs_workflows_woken_step_by_step(queue_engine: sa.Engine, mode: str) -> None:
    seen: dict[str, Any] = {}
    registry = registry_for(mode, seen)
    sessions = sessionmaker(queue_engine)
    with running(registry, queue_engine, poll_interval=POLL, concurrency=4):
        written = []
        for order in (1, 2):
            with sessions.begin() as session:
                written.append(enqueue_workflow(session, order_flow(order, parts=order * 3)))
        for flow in written:
            status = wait_for_workflow(sessions, OrderWorkflow, flow.id, timeout=PATIENCE)
            assert status is WorkflowStatus.SUCCEEDED
    assert seen["reserve 1"] == {"charge": {"paid": 10}}
    assert seen["ship 2"] == {"reserve": "reserved", "email": "emailed"} | {
        f"part{i}": i for i in range(6)
    }
    with queue_engine.connect() as connection:
        early = connection.scalar(
            sa.text(
                "SELECT count(*) FROM order_jobs AS s JOIN order_jobs AS d "
                "ON d.id = ANY (s.depends_on) WHERE s.attempted_at < d.finished_at"
            )
        )
        totals = connection.execute(
            sa.text("SELECT steps_total, steps_left FROM order_workflows ORDER BY id")
        ).all()
        orders = connection.scalar(sa.text("SELECT count(*) FROM orders"))
    assert early == 0
    assert [tuple(row) for row in totals] == [(4 + 3, 0), (4 + 6, 0)]
    assert orders == (2 if mode == "lock" else 0)  # a lock-mode step's writes commit with it


def test_a_failed_lock_mode_step_rolls_back_and_cancels_what_follows(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(OrderJob, default_mode="lock")

    @registry.task
    def charge(ctx: JobContext) -> None:
        ctx.session.add(Order(id=1, customer="never"))
        raise RuntimeError("card declined")

    sessions = sessionmaker(queue_engine)
    with sessions.begin() as session:
        written = enqueue_workflow(session, order_flow(1, attempts=1))
    with running(registry, queue_engine, poll_interval=0.1):
        status = wait_for_workflow(sessions, OrderWorkflow, written.id, timeout=PATIENCE)
    assert status is WorkflowStatus.FAILED
    with queue_engine.connect() as connection:
        steps: dict[str, str] = {
            row.step: row.status
            for row in connection.execute(sa.text("SELECT step, status FROM order_jobs"))
        }
        assert connection.scalar(sa.text("SELECT count(*) FROM orders")) == 0
    assert steps == {
        "charge": "dead",
        "reserve": "cancelled",
        "email": "cancelled",
        "ship": "cancelled",
    }


@pytest.mark.asyncio
async def test_a_workflow_written_through_an_async_session(
    queue_async_engine: AsyncEngine, queue_engine: sa.Engine
) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        written = await sqla_jobs.aio.enqueue_workflow(session, order_flow(5))
        assert written.created
    async with AsyncSession(queue_async_engine) as session, session.begin():
        steps = await sqla_jobs.aio.workflow_steps(session, OrderJob, written.id)
        assert [s.status for s in steps] == ["pending", "waiting", "waiting", "waiting"]
        assert await sqla_jobs.aio.cancel_workflow(session, OrderJob, written.id) is (
            WorkflowStatus.CANCELLED
        )
    with Session(queue_engine) as sync_session:
        row = sync_session.get(OrderWorkflow, written.id)
        assert row is not None
        assert row.status == "cancelled"
