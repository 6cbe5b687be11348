"""Workflows: graphs of steps written in the caller's transaction, each step runnable in the
transaction that ends its last dependency, failures cancelling (or not) what depends on
them, retries reviving it, cancels, steps added by a running step, pruning."""

from __future__ import annotations

import re
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from in_process import PATIENCE, running
from models import EmailJob, Order, OrderJob, OrderWorkflow
from no_sql import no_sql
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.pool import NullPool

import sqla_jobs
from sqla_jobs import (
    ClaimedJob,
    ConfigurationError,
    InvalidJobError,
    JobMixin,
    JobNotFoundError,
    LeaseLostError,
    Registry,
    StepMixin,
    UniqueJobError,
    Worker,
    WorkflowMixin,
    WorkflowTimeoutError,
)
from sqla_jobs.errors import InvalidWorkflowError
from sqla_jobs.schema.workflows import WorkflowStatus
from sqla_jobs.workflows import (
    Workflow,
    add_steps,
    cancel_workflow,
    dependency_results,
    enqueue_workflow,
    wait_for_workflow,
    workflow_steps,
)


def job(task: str, **args: Any) -> OrderJob:
    return OrderJob(task=task, args=args)


def order_flow(order: int = 7) -> Workflow:
    """The worked example: charge, then reserve stock and email side by side, then ship."""
    flow = Workflow(f"order {order}")
    charge = flow.add("charge", job("charge", order=order))
    stock = flow.add("reserve", job("reserve", order=order), after=charge)
    email = flow.add("email", job("email", order=order), after=charge)
    flow.add("ship", job("ship", order=order), after=[stock, email])
    return flow


def enqueue(
    engine: sa.Engine, flow: Workflow, **options: Any
) -> sqla_jobs.workflows.EnqueuedWorkflow:
    with Session(engine) as session, session.begin():
        return enqueue_workflow(session, flow, **options)


def statuses(engine: sa.Engine, workflow_id: int) -> dict[str, str]:
    with Session(engine) as session:
        return {s.step: s.status for s in workflow_steps(session, OrderJob, workflow_id)}


def workflow(engine: sa.Engine, workflow_id: int) -> Any:
    with engine.connect() as connection:
        return connection.execute(
            sa.text("SELECT * FROM order_workflows WHERE id = :id"), {"id": workflow_id}
        ).one()


def claim(engine: sa.Engine, limit: int = 10) -> list[ClaimedJob]:
    with Session(engine) as session, session.begin():
        return sqla_jobs.claim(session, OrderJob, limit=limit)


def complete(engine: sa.Engine, attempt: ClaimedJob, result: Any = None) -> None:
    with Session(engine) as session, session.begin():
        sqla_jobs.complete(session, attempt, result=result)


def fail(engine: sa.Engine, attempt: ClaimedJob) -> None:
    with Session(engine) as session, session.begin():
        sqla_jobs.fail(session, attempt, "boom", retry=False)


def run_all(engine: sa.Engine) -> list[str]:
    """Claim and complete until nothing is runnable; the steps in the order they ran."""
    ran: list[str] = []
    while batch := claim(engine):
        for attempt in batch:
            ran.append(attempt.task)
            complete(engine, attempt, {"done": attempt.task})
    return ran


def test_a_workflow_exists_only_if_its_transaction_commits(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(Order(id=1, customer="a"))
        enqueue_workflow(session, order_flow(1))
        session.flush()
        session.rollback()
    with queue_engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM order_jobs")) == 0
        assert connection.scalar(sa.text("SELECT count(*) FROM order_workflows")) == 0

    with Session(queue_engine) as session, session.begin():
        order = Order(id=2, customer="b")
        session.add(order)
        written = enqueue_workflow(session, order_flow(2), workflow=OrderWorkflow(order=order))
    assert written.created
    assert set(written.steps) == {"charge", "reserve", "email", "ship"}
    assert statuses(queue_engine, written.id) == {
        "charge": "pending",
        "reserve": "waiting",
        "email": "waiting",
        "ship": "waiting",
    }
    row = workflow(queue_engine, written.id)
    assert (row.name, row.status, row.steps_total, row.steps_left, row.order_id) == (
        "order 2",
        "running",
        4,
        4,
        2,
    )


def test_steps_run_after_their_dependencies_and_read_their_results(
    queue_engine: sa.Engine,
) -> None:
    written = enqueue(queue_engine, order_flow())
    [charge] = claim(queue_engine)
    assert charge.task == "charge"
    assert claim(queue_engine) == []  # nothing else is runnable while charge runs
    complete(queue_engine, charge, {"paid": 12})
    second = claim(queue_engine)
    assert sorted(a.task for a in second) == ["email", "reserve"]
    with Session(queue_engine) as session:
        assert dependency_results(session, second[0]) == {"charge": {"paid": 12}}
    complete(queue_engine, second[0], "one")
    assert claim(queue_engine) == []  # ship waits for both
    complete(queue_engine, second[1], "two")
    [ship] = claim(queue_engine)
    assert ship.task == "ship"
    with Session(queue_engine) as session:
        assert dependency_results(session, ship) == {"reserve": "one", "email": "two"} or (
            dependency_results(session, ship) == {"reserve": "two", "email": "one"}
        )
    assert workflow(queue_engine, written.id).status == "running"
    complete(queue_engine, ship)
    row = workflow(queue_engine, written.id)
    assert (row.status, row.steps_left, row.steps_failed) == ("succeeded", 0, 0)
    assert row.finished_at is not None


def test_a_chain_and_a_group_with_a_callback(queue_engine: sa.Engine) -> None:
    flow = Workflow("shapes")
    last = flow.chain(("a", job("a")), ("b", job("b")), ("c", job("c")))
    parts = flow.group({f"part{i}": job(f"part{i}") for i in range(5)}, after=last)
    flow.add("merge", job("merge"), after=parts)
    written = enqueue(queue_engine, flow)
    ran = run_all(queue_engine)
    assert ran[:3] == ["a", "b", "c"]
    assert sorted(ran[3:8]) == [f"part{i}" for i in range(5)]
    assert ran[8:] == ["merge"]
    assert workflow(queue_engine, written.id).status == "succeeded"


def test_a_failed_dependency_cancels_its_dependents_unless_they_run_anyway(
    queue_engine: sa.Engine,
) -> None:
    flow = Workflow()
    root = flow.add("root", job("root"))
    child = flow.add("child", job("child"), after=root)
    flow.add("grandchild", job("grandchild"), after=child)
    flow.add("cleanup", job("cleanup"), after=child, if_dependency_fails="run")
    written = enqueue(queue_engine, flow)
    [attempt] = claim(queue_engine)
    fail(queue_engine, attempt)
    assert statuses(queue_engine, written.id) == {
        "root": "dead",
        "child": "cancelled",
        "grandchild": "cancelled",
        "cleanup": "pending",
    }
    with Session(queue_engine) as session:
        steps = {s.step: s for s in workflow_steps(session, OrderJob, written.id)}
    assert steps["child"].blocked_by == steps["root"].id
    assert steps["grandchild"].blocked_by == steps["root"].id
    assert workflow(queue_engine, written.id).status == "running"  # cleanup still to run
    assert run_all(queue_engine) == ["cleanup"]
    row = workflow(queue_engine, written.id)
    assert (row.status, row.steps_left, row.steps_failed) == ("failed", 0, 3)


def test_retrying_a_dead_step_resumes_its_workflow(queue_engine: sa.Engine) -> None:
    written = enqueue(queue_engine, order_flow())
    [charge] = claim(queue_engine)
    fail(queue_engine, charge)
    assert workflow(queue_engine, written.id).status == "failed"
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.retry(session, OrderJob, charge.id)
    assert statuses(queue_engine, written.id) == {
        "charge": "pending",
        "reserve": "waiting",
        "email": "waiting",
        "ship": "waiting",
    }
    row = workflow(queue_engine, written.id)
    assert (row.status, row.steps_left, row.steps_failed, row.finished_at) == (
        "running",
        4,
        0,
        None,
    )
    assert sorted(run_all(queue_engine)) == ["charge", "email", "reserve", "ship"]
    assert workflow(queue_engine, written.id).status == "succeeded"


def test_a_step_blocked_by_another_failure_stays_cancelled_on_retry(
    queue_engine: sa.Engine,
) -> None:
    flow = Workflow()
    a = flow.add("a", job("a"))
    b = flow.add("b", job("b"))
    flow.add("both", job("both"), after=[a, b])
    written = enqueue(queue_engine, flow)
    first, second = claim(queue_engine)
    fail(queue_engine, first)
    fail(queue_engine, second)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.retry(session, OrderJob, second.id)
    # "both" was cancelled by the first failure: retrying the second does not revive it.
    assert statuses(queue_engine, written.id)["both"] == "cancelled"
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.retry(session, OrderJob, first.id)
    assert statuses(queue_engine, written.id)["both"] == "waiting"
    assert sorted(run_all(queue_engine)) == ["a", "b", "both"]
    assert workflow(queue_engine, written.id).status == "succeeded"


def test_cancelling_a_workflow(queue_engine: sa.Engine) -> None:
    written = enqueue(queue_engine, order_flow())
    [charge] = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        assert cancel_workflow(session, OrderJob, written.id) is WorkflowStatus.RUNNING
    assert statuses(queue_engine, written.id) == {
        "charge": "running",
        "reserve": "cancelled",
        "email": "cancelled",
        "ship": "cancelled",
    }
    with (
        Session(queue_engine) as session,
        session.begin(),
        pytest.raises(sqla_jobs.JobCancelledError),
    ):
        sqla_jobs.complete(session, charge)  # its cancel was requested: ends cancelled
    row = workflow(queue_engine, written.id)
    assert (row.status, row.steps_left) == ("cancelled", 0)
    with Session(queue_engine) as session, session.begin():
        assert cancel_workflow(session, OrderJob, written.id) is WorkflowStatus.CANCELLED
        with pytest.raises(JobNotFoundError):
            cancel_workflow(session, OrderJob, written.id + 1000)


def test_cancelling_a_waiting_step_cancels_what_depends_on_it(queue_engine: sa.Engine) -> None:
    written = enqueue(queue_engine, order_flow())
    with Session(queue_engine) as session, session.begin():
        assert (
            sqla_jobs.cancel(session, OrderJob, written.steps["email"])
            is sqla_jobs.JobStatus.CANCELLED
        )
    assert statuses(queue_engine, written.id)["ship"] == "cancelled"
    assert sorted(run_all(queue_engine)) == ["charge", "reserve"]
    assert workflow(queue_engine, written.id).status == "failed"


def test_deleting_a_step_that_has_not_ended_counts_as_cancelled(queue_engine: sa.Engine) -> None:
    written = enqueue(queue_engine, order_flow())
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.delete(session, OrderJob, written.steps["reserve"])
    assert statuses(queue_engine, written.id)["ship"] == "cancelled"
    assert sorted(run_all(queue_engine)) == ["charge", "email"]
    row = workflow(queue_engine, written.id)
    assert (row.status, row.steps_left, row.steps_failed) == ("failed", 0, 2)


def test_a_unique_workflow_is_written_once(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(Order(id=9, customer="c"))
        session.flush()
        first = enqueue_workflow(
            session, order_flow(9), unique_key="order:9", workflow=OrderWorkflow(order_id=9)
        )
        again = enqueue_workflow(session, order_flow(9), unique_key="order:9")
        session.add(Order(id=10, customer="d"))  # the transaction goes on
    assert first.created
    assert (again.created, again.id, again.steps) == (False, first.id, {})
    assert workflow(queue_engine, first.id).order_id == 9
    with queue_engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM order_jobs")) == 4
        assert connection.scalar(sa.text("SELECT count(*) FROM orders")) == 2
    run_all(queue_engine)
    # Once it ended, the key is free again.
    assert enqueue(queue_engine, order_flow(9), unique_key="order:9").created


def test_a_running_step_adds_steps_before_the_fan_in(queue_engine: sa.Engine) -> None:
    flow = Workflow()
    split = flow.add("split", job("split"))
    flow.add("merge", job("merge"), after=split)
    written = enqueue(queue_engine, flow)
    [attempt] = claim(queue_engine)
    more = Workflow()
    for i in range(3):
        more.add(f"part{i}", job("part", i=i))
    with Session(queue_engine) as session, session.begin():
        added = add_steps(session, attempt, more, then=["merge"])
    assert set(added) == {"part0", "part1", "part2"}
    assert workflow(queue_engine, written.id).steps_total == 5
    assert claim(queue_engine) == []  # the new steps run after split succeeded
    complete(queue_engine, attempt)
    ran = run_all(queue_engine)
    assert ran == ["part", "part", "part", "merge"]
    row = workflow(queue_engine, written.id)
    assert (row.status, row.steps_total, row.steps_left) == ("succeeded", 5, 0)


def test_adding_steps_is_fenced_by_the_attempt(queue_engine: sa.Engine) -> None:
    flow = Workflow()
    flow.add("split", job("split"))
    written = enqueue(queue_engine, flow)
    [attempt] = claim(queue_engine)
    with queue_engine.begin() as connection:  # its lease runs out, another attempt takes it
        connection.execute(
            sa.text("UPDATE order_jobs SET lease_expires_at = now() - interval '1 hour'")
        )
    [newer] = claim(queue_engine)
    assert newer.attempt == attempt.attempt + 1
    more = Workflow()
    more.add("late", job("late"))
    with Session(queue_engine) as session, session.begin(), pytest.raises(LeaseLostError):
        add_steps(session, attempt, more)
    assert workflow(queue_engine, written.id).steps_total == 1
    with queue_engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM order_jobs")) == 1


def test_bad_workflows_are_refused_before_any_sql(queue_engine: sa.Engine) -> None:
    flow = Workflow()
    flow.add("a", job("a"))
    with no_sql(queue_engine):
        with pytest.raises(InvalidWorkflowError, match="not a step added before"):
            flow.add("b", job("b"), after="c")
        with pytest.raises(InvalidWorkflowError, match="not a step added before"):
            flow.add("self", job("self"), after="self")  # a cycle cannot be written
        with pytest.raises(InvalidWorkflowError, match="already added"):
            flow.add("a", job("a"))
        with pytest.raises(InvalidWorkflowError, match="if_dependency_fails"):
            flow.add("b", job("b"), after="a", if_dependency_fails="ignore")
        with pytest.raises(InvalidWorkflowError, match="StepMixin"):
            flow.add("email", EmailJob(task="email"))
        with pytest.raises(InvalidWorkflowError, match="name"):
            flow.add("", job("b"))
        with pytest.raises(InvalidWorkflowError, match="twice"):
            flow.add("b", job("b"), after=["a", "a"])
        with pytest.raises(InvalidWorkflowError, match="at least one"):
            Workflow().chain()
        with Session(queue_engine) as session:
            with pytest.raises(InvalidWorkflowError, match="at least one step"):
                enqueue_workflow(session, Workflow())
            with pytest.raises(UniqueJobError):
                enqueue_workflow(session, flow, unique_key="")
            with pytest.raises(InvalidWorkflowError, match="must be a new"):
                enqueue_workflow(session, flow, workflow=OrderJob(task="x"))  # type: ignore[arg-type]
            assert not session.new  # nothing half added
        with pytest.raises(InvalidJobError):
            OrderJob(task="x", workflow_id=3)
        with pytest.raises(InvalidJobError, match="waiting"):
            OrderJob(task="x", status="waiting")
    assert len(flow) == 1  # the refused steps were not added


def test_a_step_of_a_written_workflow_cannot_be_added_again(queue_engine: sa.Engine) -> None:
    flow = order_flow()
    enqueue(queue_engine, flow)
    again = Workflow()
    with pytest.raises(InvalidWorkflowError, match="not a new job row"):
        again.add("charge", flow.steps[0].job)


def test_pruning_keeps_running_workflows_and_deletes_finished_ones_whole(
    queue_engine: sa.Engine,
) -> None:
    done = enqueue(queue_engine, order_flow(1))
    with Session(queue_engine) as session, session.begin():
        session.add(OrderJob(task="plain"))  # a job of the same table that is not a step
    run_all(queue_engine)
    running = enqueue(queue_engine, order_flow(2))
    [charge] = claim(queue_engine)
    complete(queue_engine, charge)  # a finished step of a running workflow
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text("UPDATE order_jobs SET finished_at = finished_at - interval '2 days'")
        )
        connection.execute(
            sa.text("UPDATE order_workflows SET finished_at = finished_at - interval '2 days'")
        )
    with Session(queue_engine) as session, session.begin():
        pruned = sqla_jobs.prune(session, OrderJob, older_than=3600)
    assert pruned == 5  # the plain job, and the finished workflow's four steps with it
    with queue_engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM order_workflows")) == 1
        left = connection.execute(
            sa.text("SELECT workflow_id, count(*) FROM order_jobs GROUP BY 1")
        ).all()
    assert [tuple(row) for row in left] == [(running.id, 4)]
    assert done.id != running.id


def test_concurrent_claimers_run_every_step_after_its_dependencies(
    queue_engine: sa.Engine,
) -> None:
    """Four threads claim and complete in batches over 30 diamonds and 10 fan-ins: every
    workflow succeeds, and no step started before each of its dependencies had ended."""
    for i in range(30):
        enqueue(queue_engine, order_flow(i))
    for i in range(10):
        flow = Workflow(f"fan {i}")
        parts = flow.group({f"p{k}": job("part") for k in range(20)})
        flow.add("merge", job("merge"), after=parts)
        enqueue(queue_engine, flow)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            idle = 0
            while idle < 20:
                with Session(queue_engine) as session, session.begin():
                    batch = sqla_jobs.claim(session, OrderJob, limit=7)
                if not batch:
                    idle += 1
                    threading.Event().wait(0.02)
                    continue
                idle = 0
                with Session(queue_engine) as session, session.begin():
                    sqla_jobs.complete_many(session, batch)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    with queue_engine.connect() as connection:
        flows = connection.execute(
            sa.text(
                "SELECT status, steps_left, steps_failed, count(*) "
                "FROM order_workflows GROUP BY 1, 2, 3"
            )
        ).all()
        early = connection.scalar(
            sa.text(
                "SELECT count(*) FROM order_jobs AS s JOIN order_jobs AS d "
                "ON d.id = ANY (s.depends_on) WHERE s.attempted_at < d.finished_at"
            )
        )
        steps = connection.execute(
            sa.text("SELECT status, count(*) FROM order_jobs GROUP BY 1")
        ).all()
    assert [tuple(row) for row in flows] == [("succeeded", 0, 0, 40)]
    assert [tuple(row) for row in steps] == [("succeeded", 30 * 4 + 10 * 21)]
    assert early == 0


def test_a_worker_of_steps_needs_the_workflow_trigger(fresh_database: FreshDatabase) -> None:
    import models

    engine = sa.create_engine(fresh_database("sqla_jobs_steps"), poolclass=NullPool)
    try:
        models.Base.metadata.create_all(engine)
        with engine.begin() as connection:
            connection.execute(sa.text("DROP TRIGGER order_jobs_workflow_tg ON order_jobs"))
        with pytest.raises(
            ConfigurationError,
            match=r"lacks the workflow trigger.*add_workflow_steps\('order_jobs', "
            r"'order_workflows'\)",
        ):
            Worker(Registry(OrderJob), engine).run()
    finally:
        engine.dispose()


def test_a_workflow_is_one_trace(queue_engine: sa.Engine) -> None:
    tracer = TracerProvider().get_tracer("tests")
    with (
        tracer.start_as_current_span("checkout") as span,
        Session(queue_engine) as session,
        session.begin(),
    ):
        written = enqueue_workflow(session, order_flow())
    context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    with queue_engine.connect() as connection:
        contexts = connection.execute(
            sa.text(
                "SELECT trace_context->>'traceparent' FROM order_jobs UNION ALL "
                "SELECT trace_context->>'traceparent' FROM order_workflows WHERE id = :id"
            ),
            {"id": written.id},
        ).scalars()
        assert list(contexts) == [expected] * 5
    [charge] = claim(queue_engine)
    assert charge.trace_context == {"traceparent": expected}


def test_a_step_with_an_ordering_key_waits_for_its_key_too(queue_engine: sa.Engine) -> None:
    flow = Workflow()
    first = flow.add("first", job("first"))
    flow.add("keyed", OrderJob(task="keyed", ordering_key="customer:1"), after=first)
    written = enqueue(queue_engine, flow)
    with Session(queue_engine) as session, session.begin():
        session.add(OrderJob(task="ahead", ordering_key="customer:1"))
    with Session(queue_engine) as session, session.begin():
        ahead = sqla_jobs.claim(session, OrderJob, keys=True, limit=5)
    assert sorted(a.task for a in ahead) == ["ahead", "first"]  # "keyed" still waits
    for attempt in ahead:
        if attempt.task == "first":
            complete(queue_engine, attempt)
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, OrderJob, keys=True) == []  # "ahead" holds the key
    for attempt in ahead:
        if attempt.task == "ahead":
            complete(queue_engine, attempt)
    with Session(queue_engine) as session, session.begin():
        [keyed] = sqla_jobs.claim(session, OrderJob, keys=True)
    assert keyed.id == written.steps["keyed"]


def test_waiting_for_a_workflow(queue_engine: sa.Engine) -> None:
    sessions = sessionmaker(queue_engine)
    written = enqueue(queue_engine, order_flow())
    with pytest.raises(WorkflowTimeoutError, match="still running"):
        wait_for_workflow(sessions, OrderWorkflow, written.id, timeout=0.3, poll=0.1)
    with pytest.raises(JobNotFoundError):
        wait_for_workflow(sessions, OrderWorkflow, written.id + 99, timeout=1)
    run_all(queue_engine)
    assert wait_for_workflow(sessions, OrderWorkflow, written.id, timeout=1) is (
        WorkflowStatus.SUCCEEDED
    )


def test_the_documented_grants_suffice(queue_engine: sa.Engine) -> None:
    """docs/operations/privileges.md's grants for workflows: the application enqueues a
    workflow, a worker drains it and adds steps, each as a role with only those grants."""
    suffix = uuid.uuid4().hex[:8]
    names = ("jobs_app", "jobs_worker", "jobs_operator", "jobs_dashboard")
    roles = {name: f"{name}_{suffix}" for name in names}
    app, worker = roles["jobs_app"], roles["jobs_worker"]
    page = (Path(__file__).resolve().parents[1] / "docs/operations/privileges.md").read_text()
    match = re.search(r"<!-- privileges-test: workflows -->\n```sql\n(.*?)```", page, re.S)
    assert match is not None
    documented = re.sub(r"\bjobs_\w+", lambda role: roles[role.group(0)], match.group(1))
    with queue_engine.begin() as connection:
        for role in roles.values():
            connection.execute(sa.text(f"CREATE ROLE {role}"))
        connection.execute(sa.text(f"GRANT USAGE ON SCHEMA public TO {app}, {worker}"))
        connection.exec_driver_sql(documented)
        # What every worker needs anyway (the general grants of the page).
        connection.execute(sa.text(f"GRANT SELECT ON order_jobs_pauses TO {worker}"))
        connection.execute(
            sa.text(f"GRANT SELECT, INSERT, UPDATE ON order_job_results TO {worker}")
        )

    def session_as(role: str) -> Session:
        session = Session(queue_engine)
        session.begin()
        session.execute(sa.text(f"SET LOCAL ROLE {role}"))
        return session

    try:
        with session_as(app) as session:
            written = enqueue_workflow(session, order_flow())
            session.commit()
        with session_as(worker) as session:
            [charge] = sqla_jobs.claim(session, OrderJob)
            session.commit()
        more = Workflow()
        more.add("gift", job("gift"))
        with session_as(worker) as session:
            add_steps(session, charge, more, then=["ship"])
            sqla_jobs.complete(session, charge)
            session.commit()
        while True:
            with session_as(worker) as session:
                batch = sqla_jobs.claim(session, OrderJob, limit=10)
                sqla_jobs.complete_many(session, batch)
                session.commit()
            if not batch:
                break
        assert workflow(queue_engine, written.id).status == "succeeded"
    finally:
        with queue_engine.begin() as connection:
            for role in roles.values():
                connection.execute(sa.text(f"DROP OWNED BY {role}"))
                connection.execute(sa.text(f"DROP ROLE {role}"))


def test_a_model_of_steps_needs_a_workflow_model_and_keeps_its_rows() -> None:
    class Base(DeclarativeBase):
        metadata = sa.MetaData()

    class Flows(WorkflowMixin, Base):
        __tablename__ = "refused_flows"

    with pytest.raises(ConfigurationError, match="set its workflow_model"):

        class NoWorkflow(StepMixin, JobMixin, Base):
            __tablename__ = "refused_no_workflow"

    with pytest.raises(ConfigurationError, match="sets delete_on_success"):

        class Deleted(StepMixin, JobMixin, Base):
            __tablename__ = "refused_delete_on_success"
            workflow_model = Flows
            delete_on_success = True

    # A history is allowed: its steps finish in place (tests/test_workflow_history.py).
    class Kept(StepMixin, JobMixin, Base):
        __tablename__ = "kept_steps"
        workflow_model = Flows
        partitioned_history = True

    assert "kept_steps_history" in Base.metadata.tables


def test_steps_keep_their_queue_limits(queue_engine: sa.Engine) -> None:
    flow = Workflow()
    root = flow.add("root", job("root"))
    flow.group({f"p{i}": OrderJob(task="part", queue="narrow") for i in range(6)}, after=root)
    enqueue(queue_engine, flow)
    [attempt] = claim(queue_engine)
    complete(queue_engine, attempt)
    with Session(queue_engine) as session, session.begin():
        first = sqla_jobs.claim(
            session, OrderJob, queues="narrow", limit=10, queue_limits={"narrow": 2}
        )
    assert len(first) == 2  # six runnable steps, two at a time
    with Session(queue_engine) as session, session.begin():
        assert (
            sqla_jobs.claim(
                session, OrderJob, queues="narrow", limit=10, queue_limits={"narrow": 2}
            )
            == []
        )


def test_a_step_past_its_time_limit_fails_and_cancels_what_follows(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(OrderJob)

    @registry.task
    def slow(ctx: sqla_jobs.JobContext) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ctx.raise_if_cancelled()  # raises JobTimeoutError past the limit
            time.sleep(0.05)

    flow = Workflow()
    first = flow.add(
        "slow", OrderJob(task="slow", time_limit=timedelta(seconds=0.5), max_attempts=1)
    )
    flow.add("after", OrderJob(task="slow"), after=first)
    written = enqueue(queue_engine, flow)
    sessions = sessionmaker(queue_engine)
    with running(registry, queue_engine):
        status = wait_for_workflow(sessions, OrderWorkflow, written.id, timeout=PATIENCE)
    assert status is WorkflowStatus.FAILED
    assert statuses(queue_engine, written.id) == {"slow": "dead", "after": "cancelled"}


def test_a_retried_step_finds_the_steps_an_earlier_attempt_added(
    queue_engine: sa.Engine,
) -> None:
    flow = Workflow()
    split = flow.add("split", job("split"))
    flow.add("merge", job("merge"), after=split)
    written = enqueue(queue_engine, flow)

    def parts(*names: str) -> Workflow:
        more = Workflow()
        for name in names:
            more.add(name, job("part"))
        return more

    [first] = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        added = add_steps(session, first, parts("p0", "p1"), then=["merge"])
    with queue_engine.begin() as connection:  # its worker died: the lease runs out
        connection.execute(
            sa.text("UPDATE order_jobs SET lease_expires_at = now() - interval '1 hour'")
        )
    [retried] = claim(queue_engine)
    assert retried.id == first.id
    with Session(queue_engine) as session, session.begin():
        with pytest.raises(InvalidWorkflowError, match="already a step"):
            add_steps(session, retried, parts("p0", "p1"), then=["merge"])
        assert add_steps(session, retried, parts("p0", "p1"), exist_ok=True) == added
        with pytest.raises(InvalidWorkflowError, match="all of them or none"):
            add_steps(session, retried, parts("p0", "p2"), exist_ok=True)
    row = workflow(queue_engine, written.id)
    assert (row.steps_total, row.steps_left) == (4, 4)  # nothing added twice
    complete(queue_engine, retried)
    assert run_all(queue_engine) == ["part", "part", "merge"]
    assert workflow(queue_engine, written.id).status == "succeeded"
