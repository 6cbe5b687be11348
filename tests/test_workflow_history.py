"""Workflows on a model with a partitioned history: steps finish in place, an ended workflow's
steps move into the history together (the mover), a retry brings them back and the workflow
runs again, retention deletes ended workflows, the migration helpers build what create_all
builds."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations
from conftest import FreshDatabase
from in_process import PATIENCE
from ledger_models import Base, LedgerJob, LedgerJobHistory, LedgerJobResult, LedgerWorkflow
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool
from starlette.testclient import TestClient
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import (
    ClaimedJob,
    JobContext,
    JobStateError,
    Registry,
    Worker,
    migrations,
)
from sqla_jobs.dashboard import create_app
from sqla_jobs.history import drop_partitions, job_record, move_finished
from sqla_jobs.schema.history import history_names
from sqla_jobs.workflows import Workflow, enqueue_workflow, wait_for_workflow, workflow_steps


@pytest.fixture(scope="module")
def _ledger_database(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(fresh_database("sqla_jobs_ledger"), poolclass=NullPool)
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def engine(_ledger_database: sa.Engine) -> sa.Engine:
    with _ledger_database.begin() as connection:
        connection.execute(
            sa.text(
                "TRUNCATE ledger_jobs, ledger_jobs_history, ledger_workflows, ledger_job_results "
                "RESTART IDENTITY"
            )
        )
    return _ledger_database


def order(number: int = 1) -> Workflow:
    flow = Workflow(f"order {number}")
    charge = flow.add("charge", LedgerJob(task="charge", args={"order": number}))
    stock = flow.add("reserve", LedgerJob(task="reserve"), after=charge)
    email = flow.add("email", LedgerJob(task="email"), after=charge)
    flow.add("ship", LedgerJob(task="ship"), after=[stock, email])
    return flow


def claim(engine: sa.Engine) -> list[ClaimedJob]:
    with Session(engine) as session, session.begin():
        return sqla_jobs.claim(session, LedgerJob, limit=10)


def complete(engine: sa.Engine, attempt: ClaimedJob) -> None:
    with Session(engine) as session, session.begin():
        sqla_jobs.complete(session, attempt, result={"done": attempt.task})


def count(engine: sa.Engine, sql: str) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(sa.text(sql)) or 0)


def flow_status(engine: sa.Engine, workflow_id: int) -> str:
    with engine.connect() as connection:
        return str(
            connection.scalar(
                sa.text("SELECT status FROM ledger_workflows WHERE id = :id"), {"id": workflow_id}
            )
        )


def steps(engine: sa.Engine, workflow_id: int) -> dict[str, str]:
    with Session(engine) as session:
        return {s.step: s.status for s in workflow_steps(session, LedgerJob, workflow_id)}


def test_steps_finish_in_place_and_move_into_the_history_with_their_workflow(
    engine: sa.Engine,
) -> None:
    with Session(engine) as session, session.begin():
        flow = enqueue_workflow(session, order())
        session.add(LedgerJob(task="plain"))
    (charge, plain) = sorted(claim(engine), key=lambda a: a.task)
    complete(engine, charge)
    complete(engine, plain)
    # The mover takes the plain job; the charge stays, its workflow runs on.
    assert move_finished(engine, LedgerJob) == 1
    middle = claim(engine)
    assert sorted(a.task for a in middle) == ["email", "reserve"]
    with Session(engine) as session:
        record = job_record(session, LedgerJob, plain.id)
        assert record is not None
        assert record.in_history
        assert record.result == {"done": "plain"}
        assert sqla_jobs.workflows.dependency_results(session, middle[0]) == {
            "charge": {"done": "charge"}
        }
    for attempt in middle:
        complete(engine, attempt)
    (ship,) = claim(engine)
    complete(engine, ship)
    assert flow_status(engine, flow.id) == "succeeded"
    assert count(engine, "SELECT count(*) FROM ledger_job_results") == 4

    assert move_finished(engine, LedgerJob) == 4
    assert count(engine, "SELECT count(*) FROM ledger_jobs") == 0
    assert count(engine, "SELECT count(*) FROM ledger_job_results") == 0  # moved along
    assert steps(engine, flow.id) == dict.fromkeys(
        ("charge", "reserve", "email", "ship"), "succeeded"
    )
    with Session(engine) as session:
        moved = session.scalars(
            sa.select(LedgerJobHistory).where(LedgerJobHistory.status == "succeeded")
        ).all()
        assert sorted(row.result["done"] for row in moved) == [
            "charge",
            "email",
            "plain",
            "reserve",
            "ship",
        ]


def test_the_mover_leaves_a_running_workflows_ended_steps(engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        flow = enqueue_workflow(session, order())
    (charge,) = claim(engine)
    complete(engine, charge)
    assert move_finished(engine, LedgerJob) == 0
    assert steps(engine, flow.id)["charge"] == "succeeded"
    assert count(engine, "SELECT count(*) FROM ledger_jobs_history") == 0


def fail_charge(engine: sa.Engine) -> tuple[int, int]:
    """A two-step workflow whose first step ends dead: failed, and moved by the mover."""
    flow = Workflow("doomed")
    first = flow.add("charge", LedgerJob(task="charge", max_attempts=1))
    flow.add("ship", LedgerJob(task="ship"), after=first)
    with Session(engine) as session, session.begin():
        enqueued = enqueue_workflow(session, flow)
    (charge,) = claim(engine)
    with Session(engine) as session, session.begin():
        sqla_jobs.fail(session, charge, "card declined")
    assert flow_status(engine, enqueued.id) == "failed"
    return enqueued.id, charge.id


def test_a_retry_brings_a_moved_workflow_back_and_it_runs_again(engine: sa.Engine) -> None:
    flow_id, charge_id = fail_charge(engine)
    assert move_finished(engine, LedgerJob) == 2
    assert steps(engine, flow_id) == {"charge": "dead", "ship": "cancelled"}
    assert count(engine, "SELECT count(*) FROM ledger_jobs") == 0

    with Session(engine) as session, session.begin():
        sqla_jobs.retry(session, LedgerJob, charge_id)
    assert count(engine, "SELECT count(*) FROM ledger_jobs_history") == 0
    assert steps(engine, flow_id) == {"charge": "pending", "ship": "waiting"}
    assert flow_status(engine, flow_id) == "running"
    while batch := claim(engine):
        for attempt in batch:
            complete(engine, attempt)
    assert flow_status(engine, flow_id) == "succeeded"
    assert move_finished(engine, LedgerJob) == 2
    assert steps(engine, flow_id) == {"charge": "succeeded", "ship": "succeeded"}


def test_a_retry_of_a_step_that_was_not_moved_yet_takes_back_its_moved_siblings(
    engine: sa.Engine,
) -> None:
    # The mover took one of the workflow's steps (its window ended between them): the retry
    # brings that one back too, so the trigger reads the whole graph.
    flow_id, charge_id = fail_charge(engine)
    # One window of one id: the first step only.
    assert move_finished(engine, LedgerJob, scan=1, max_windows=1) == 1
    assert set(steps(engine, flow_id)) == {"charge", "ship"}
    assert count(engine, "SELECT count(*) FROM ledger_jobs_history") == 1
    with Session(engine) as session, session.begin():
        sqla_jobs.retry(session, LedgerJob, charge_id)
    assert steps(engine, flow_id) == {"charge": "pending", "ship": "waiting"}
    assert count(engine, "SELECT count(*) FROM ledger_jobs_history") == 0


def test_the_mover_skips_a_workflow_whose_row_a_retry_holds(engine: sa.Engine) -> None:
    flow_id, _ = fail_charge(engine)
    moved: list[int] = []
    with engine.begin() as holder:
        holder.execute(
            sa.text("SELECT id FROM ledger_workflows WHERE id = :id FOR UPDATE"), {"id": flow_id}
        )
        mover = threading.Thread(target=lambda: moved.append(move_finished(engine, LedgerJob)))
        mover.start()
        mover.join(PATIENCE)
        assert not mover.is_alive()  # skipped, never waited
    assert moved == [0]
    assert move_finished(engine, LedgerJob) == 2  # once the lock is gone


def test_retention_deletes_ended_workflows_whose_steps_left(engine: sa.Engine) -> None:
    gone_id, charge_id = fail_charge(engine)
    assert move_finished(engine, LedgerJob) == 2
    with Session(engine) as session, session.begin():
        kept = enqueue_workflow(session, order(2))  # running: kept
        single = Workflow("late")
        single.add("only", LedgerJob(task="x"))
        late = enqueue_workflow(session, single)
    (only,) = [a for a in claim(engine) if a.task == "x"]
    complete(engine, only)  # ended, its step not moved yet: kept
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                "UPDATE ledger_workflows SET finished_at = now() - interval '40 days' "
                "WHERE status <> 'running'"
            )
        )
    report = drop_partitions(engine, LedgerJob, older_than=timedelta(days=30))
    assert report.workflows_deleted == 1
    with engine.connect() as connection:
        left = set(connection.scalars(sa.text("SELECT id FROM ledger_workflows")))
    assert left == {kept.id, late.id}
    # Its dead step is still in the history, but cannot run again without its workflow.
    with Session(engine) as session, session.begin():
        with pytest.raises(JobStateError, match=f"workflow {gone_id}, which is gone"):
            sqla_jobs.retry(session, LedgerJob, charge_id)
        # Nothing came back: the kept workflow's four steps and the late one's.
        assert session.scalar(sa.select(sa.func.count()).select_from(LedgerJob)) == 5


@pytest.mark.parametrize("mode", ["lease", "lock"])
def test_a_worker_runs_workflows_and_its_history_keeper_moves_them(
    engine: sa.Engine, mode: str
) -> None:
    registry = Registry(LedgerJob, default_mode=mode)  # type: ignore[arg-type]
    ran: list[str] = []

    @registry.task
    def charge(ctx: JobContext) -> dict[str, int]:
        ran.append("charge")
        return {"paid": ctx.job.args["order"]}

    def middle(ctx: JobContext) -> str:
        assert ctx.dependency_results() == {"charge": {"paid": 3}}
        return ctx.job.task

    registry.task(name="reserve")(middle)
    registry.task(name="email")(middle)

    @registry.task
    def ship(ctx: JobContext) -> list[str]:
        return sorted(ctx.dependency_results())

    with Session(engine) as session, session.begin():
        flow = enqueue_workflow(session, order(3))
    worker = Worker(registry, engine, poll_interval=0.05, history_every=0.1)
    with worker:
        sessions = sa.orm.sessionmaker(engine)
        assert wait_for_workflow(sessions, LedgerWorkflow, flow.id, timeout=30) == "succeeded"
        wait_until(
            lambda: count(engine, "SELECT count(*) FROM ledger_jobs") == 0,
            timeout=30,
            message="the workflow's steps moved into the history",
        )
    assert ran == ["charge"]
    with Session(engine) as session:
        results = {
            row.step: record.result
            for row in workflow_steps(session, LedgerJob, flow.id)
            if (record := job_record(session, LedgerJob, row.id)) is not None
        }
    assert results == {
        "charge": {"paid": 3},
        "reserve": "reserve",
        "email": "email",
        "ship": ["email", "reserve"],
    }


def migrate(engine: sa.Engine, *operations: Any) -> None:
    """Run migration helpers as a revision's ``upgrade()`` runs them, and commit."""
    with engine.connect() as connection:
        context = MigrationContext.configure(connection)
        with Operations.context(context), context.begin_transaction():
            for operation in operations:
                operation()


def catalog(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        columns = connection.execute(
            sa.text(
                "SELECT table_name, column_name, data_type, is_nullable FROM "
                "information_schema.columns WHERE table_name LIKE 'ledger_jobs_history%'"
            )
        )
        indexes = connection.execute(
            sa.text(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'ledger_jobs_history'"
            )
        )
        return sorted(tuple(row) for row in [*columns, *indexes])


@pytest.mark.parametrize("concurrently", [False, True])
def test_the_migration_helpers_give_a_history_its_steps(
    fresh_database: FreshDatabase, concurrently: bool
) -> None:
    declared = sa.create_engine(fresh_database("sqla_jobs_ledger_all"), poolclass=NullPool)
    migrated = sa.create_engine(fresh_database("sqla_jobs_ledger_mig"), poolclass=NullPool)
    try:
        Base.metadata.create_all(declared)
        migrate(
            migrated,
            lambda: migrations.create_job_table("ledger_jobs", version=4, history=True),
            lambda: migrations.create_workflow_table("ledger_workflows"),
        )
        # Day partitions made before the steps came: each gets its own copy of the index.
        sqla_jobs.history.create_partitions(migrated, LedgerJob, days_ahead=1)
        sqla_jobs.history.create_partitions(declared, LedgerJob, days_ahead=1)
        migrate(
            migrated,
            lambda: migrations.add_workflow_steps(
                "ledger_jobs", "ledger_workflows", concurrently=concurrently, history=True
            ),
        )
        assert catalog(migrated) == catalog(declared)
        with migrated.connect() as connection:
            valid = connection.scalar(
                sa.text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
                {"name": history_names("ledger_jobs").workflow_index},
            )
        assert valid is True
        migrate(
            migrated,
            lambda: migrations.drop_workflow_steps("ledger_jobs", "ledger_workflows", history=True),
        )
        assert not {row[1] for row in catalog(migrated)} & {"workflow_id", "depends_on"}
    finally:
        declared.dispose()
        migrated.dispose()


def test_the_dashboard_draws_a_moved_workflow_from_the_history(engine: sa.Engine) -> None:
    flow_id, charge_id = fail_charge(engine)
    assert move_finished(engine, LedgerJob) == 2
    with TestClient(create_app(engine, LedgerJob, result_model=LedgerJobResult)) as client:
        page = client.get(f"/workflows/{flow_id}")
        assert page.status_code == 200
        assert 'id="workflow-status">failed<' in page.text
        drawn = dict(re.findall(r'data-step-id="(\d+)" data-status="(\w+)"', page.text))
        assert sorted(drawn.values()) == ["cancelled", "dead"]
        assert drawn[str(charge_id)] == "dead"
        assert client.get(f"/jobs/{charge_id}").status_code == 200  # its page, from the history
