"""Cancelling jobs: pending ones at once, running ones through their worker; every
transition, the claim's takeover included, respects a cancel request; fenced by attempt."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from in_process import enqueue, running
from models import EmailJob, EmailJobResult, Order, ReportJob
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.pool import NullPool
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import (
    InvalidJobError,
    JobCancelledError,
    JobContext,
    JobMixin,
    JobNotFoundError,
    JobStateError,
    JobStatus,
    LeaseLostError,
    Registry,
    Worker,
)
from sqla_jobs.queue import cancel_attempts
from sqla_jobs.schema import names
from sqla_jobs.worker.state import Attempt, Kind, Outcome, State

#: How long a handler waits for its cancel before giving up (a failing test, not a hang).
HANDLER_PATIENCE = 20.0


def claim(engine: sa.Engine, model: Any = EmailJob, **options: Any) -> list[sqla_jobs.ClaimedJob]:
    with Session(engine) as session, session.begin():
        return sqla_jobs.claim(session, model, **options)


def cancel(engine: sa.Engine, job_id: int, model: Any = EmailJob) -> JobStatus:
    with Session(engine) as session, session.begin():
        # A cancel must never wait for a running handler's row lock: fail fast if it did.
        session.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
        return sqla_jobs.cancel(session, model, job_id)


def row(engine: sa.Engine, job_id: int, table: str = "email_jobs") -> Any:
    with engine.connect() as connection:
        return connection.execute(
            sa.text(f"SELECT * FROM {table} WHERE id = :id"), {"id": job_id}
        ).one_or_none()


def status(engine: sa.Engine, job_id: int) -> str:
    return str(row(engine, job_id).status)


def results(engine: sa.Engine) -> dict[int, Any]:
    with Session(engine) as session:
        return {r.job_id: r.value for r in session.scalars(sa.select(EmailJobResult))}


def orders(engine: sa.Engine) -> list[int]:
    with Session(engine) as session:
        return list(session.scalars(sa.select(Order.id)))


def wait_for(flag: Callable[[], bool]) -> bool:
    """In a handler: wait until ``flag()`` (the cancel) or give up."""
    deadline = time.monotonic() + HANDLER_PATIENCE
    while not flag():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- the queue API ----------------------------------------------------------------------


def test_cancel_of_a_pending_job_is_immediate_and_idempotent(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    assert cancel(queue_engine, job_id) is JobStatus.CANCELLED
    first = row(queue_engine, job_id)
    assert (first.status, first.cancel_requested_at) == ("cancelled", None)
    assert cancel(queue_engine, job_id) is JobStatus.CANCELLED  # again: nothing changes
    assert row(queue_engine, job_id).finished_at == first.finished_at
    assert claim(queue_engine) == []


def test_cancel_refuses_bad_input_before_any_sql_and_says_what_is_wrong(
    queue_engine: sa.Engine,
) -> None:
    unbound = Session()  # any SQL would raise UnboundExecutionError
    for bad in ("12", True, 1.0, None):
        with pytest.raises(InvalidJobError, match="job_id: must be an integer"):
            sqla_jobs.cancel(unbound, EmailJob, bad)  # type: ignore[arg-type]
    with (
        Session(queue_engine) as session,
        session.begin(),
        pytest.raises(JobNotFoundError, match="EmailJob has no job 424242"),
    ):
        sqla_jobs.cancel(session, EmailJob, 424242)
    (done_id,) = enqueue(queue_engine, EmailJob(task="t"))
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job)
    with pytest.raises(JobStateError, match="is succeeded; only pending or running"):
        cancel(queue_engine, done_id)


def test_a_cancel_request_is_final_for_every_transition_of_its_attempt(
    queue_engine: sa.Engine,
) -> None:
    ids = enqueue(queue_engine, *[EmailJob(task="t") for _ in range(4)])
    jobs = {job.id: job for job in claim(queue_engine, limit=4)}
    for job_id in ids:
        assert cancel(queue_engine, job_id) is JobStatus.RUNNING
    requested = row(queue_engine, ids[0]).cancel_requested_at
    assert requested is not None
    assert cancel(queue_engine, ids[0]) is JobStatus.RUNNING  # idempotent: the first time kept
    assert row(queue_engine, ids[0]).cancel_requested_at == requested

    completing, failing, releasing, cancelling = (jobs[i] for i in ids)
    with Session(queue_engine) as session, session.begin():
        with pytest.raises(JobCancelledError, match="cancelled, not succeeded"):
            sqla_jobs.complete(
                session, completing, result={"done": True}, result_model=EmailJobResult
            )
        assert sqla_jobs.fail(session, failing, "boom").status is JobStatus.CANCELLED
        assert sqla_jobs.release(session, [releasing]) == []
        assert cancel_attempts(session, [cancelling]) == []
    for job_id in ids:
        ended = row(queue_engine, job_id)
        assert (ended.status, ended.attempts) == ("cancelled", 1)
        assert ended.finished_at is not None
        assert ended.lease_expires_at is None
    assert results(queue_engine) == {}  # the completion's result was not stored
    assert claim(queue_engine, limit=4) == []  # none of them is pending again

    # Fenced: the old attempt can change nothing any more.
    with Session(queue_engine) as session, session.begin():
        with pytest.raises(LeaseLostError):
            sqla_jobs.complete(session, cancelling)
        with pytest.raises(LeaseLostError):
            sqla_jobs.fail(session, completing, "late")
        assert cancel_attempts(session, [failing]) == [failing]


def test_a_delete_on_success_job_whose_cancel_was_requested_is_kept_cancelled(
    queue_engine: sa.Engine,
) -> None:
    kept, deleted = enqueue(queue_engine, ReportJob(task="r"), ReportJob(task="r"))
    jobs = claim(queue_engine, ReportJob, limit=2)
    cancel(queue_engine, kept, ReportJob)
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.complete_many(session, jobs) == []
    assert row(queue_engine, kept, "report_jobs").status == "cancelled"
    assert row(queue_engine, deleted, "report_jobs") is None


def test_a_dead_workers_cancelled_job_is_not_taken_over_when_its_lease_runs_out(
    queue_engine: sa.Engine,
) -> None:
    leased, locked, other = enqueue(queue_engine, *[EmailJob(task="t") for _ in range(3)])
    claim(queue_engine, limit=1, lease=0.2)  # leased: its worker then dies
    # A lock-held attempt whose worker dies while holding the row (its transaction ends).
    holder = Session(queue_engine)
    holder.begin()
    (held,) = sqla_jobs.claim(holder, EmailJob, limit=1, lease=0.2, hold=True)
    assert held.id == locked
    assert cancel(queue_engine, leased) is JobStatus.RUNNING
    assert cancel(queue_engine, locked) is JobStatus.RUNNING  # not blocked by the row lock
    holder.close()  # the worker "dies": its transaction rolls back, the lock goes

    # Claims after the leases ran out hand out the other job, never the cancelled ones.
    handed_out: list[int] = []

    def both_cancelled() -> bool:
        handed_out.extend(job.id for job in claim(queue_engine, limit=3, lease=30))
        return status(queue_engine, leased) == status(queue_engine, locked) == "cancelled"

    wait_until(both_cancelled, timeout=10, message="the expired leases are found cancelled")
    assert handed_out == [other]
    for job_id in (leased, locked):
        assert row(queue_engine, job_id).attempts == 1


def test_retry_of_a_job_cancelled_while_running_clears_the_request(
    queue_engine: sa.Engine,
) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    (job,) = claim(queue_engine)
    cancel(queue_engine, job_id)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.fail(session, job, "stopped")
        sqla_jobs.retry(session, EmailJob, job_id)
    assert row(queue_engine, job_id).cancel_requested_at is None
    (again,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, again)
    assert status(queue_engine, job_id) == "succeeded"


# -- the worker -------------------------------------------------------------------------


def test_a_running_thread_handler_sees_the_cancel_within_a_second_or_so(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob, result_model=EmailJobResult)
    started = {"raising": threading.Event(), "ignoring": threading.Event()}
    seen: dict[str, Any] = {}

    # A long lease: its heartbeat comes every 20 s, so only the notification can be in time.
    @registry.task(queue="cancel", lease=60)
    def raising(ctx: JobContext) -> None:
        started["raising"].set()
        deadline = time.monotonic() + HANDLER_PATIENCE
        try:
            while time.monotonic() < deadline:
                ctx.raise_if_cancelled()
                time.sleep(0.01)
        except JobCancelledError as exc:
            seen["raising"] = exc
            raise

    @registry.task(queue="cancel", lease=60)
    def ignoring(ctx: JobContext) -> str:
        started["ignoring"].set()
        seen["ignoring"] = wait_for(lambda: ctx.cancelled)
        return "finished anyway"

    with running(registry, queue_engine, concurrency=2):
        ids = {name: enqueue(queue_engine, registry[name].job())[0] for name in started}
        for event in started.values():
            assert event.wait(10)
        for job_id in ids.values():
            assert cancel(queue_engine, job_id) is JobStatus.RUNNING
        wait_until(
            lambda: all(status(queue_engine, i) == "cancelled" for i in ids.values()),
            timeout=5,
            message="both jobs are cancelled",
        )
    assert isinstance(seen["raising"], JobCancelledError)
    assert seen["ignoring"] is True
    # The handler that ignored the request ended cancelled too; its result is not stored.
    assert results(queue_engine) == {}
    assert [row(queue_engine, i).attempts for i in ids.values()] == [1, 1]


def test_a_running_coroutine_handler_is_cancelled(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)
    started = threading.Event()
    seen: list[str] = []

    @registry.task(queue="cancel", lease=60)
    async def sleeper(ctx: JobContext) -> None:
        started.set()
        try:
            await asyncio.sleep(HANDLER_PATIENCE)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        seen.append("slept")

    with running(registry, queue_engine):
        (job_id,) = enqueue(queue_engine, sleeper.job())
        assert started.wait(10)
        cancel(queue_engine, job_id)
        wait_until(
            lambda: status(queue_engine, job_id) == "cancelled", timeout=5, message="cancelled"
        )
    assert seen == ["cancelled"]


def test_a_lock_held_handlers_writes_roll_back_when_it_is_cancelled(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob)
    started = threading.Event()
    seen: list[bool] = []

    @registry.task(queue="cancel", mode="lock", lease=60)
    def charge(ctx: JobContext) -> str:
        ctx.session.add(Order(id=ctx.args["order"], customer="ada"))
        ctx.session.flush()
        started.set()
        # It even ignores the request and returns: its writes roll back all the same.
        seen.append(wait_for(lambda: ctx.cancelled))
        return "charged"

    with running(registry, queue_engine):
        (job_id,) = enqueue(queue_engine, charge.job({"order": 5}))
        assert started.wait(10)
        assert cancel(queue_engine, job_id) is JobStatus.RUNNING  # the row lock does not block it
        wait_until(
            lambda: status(queue_engine, job_id) == "cancelled", timeout=5, message="cancelled"
        )
    assert seen == [True]
    assert orders(queue_engine) == []


def test_a_missed_notification_is_made_up_for_by_the_heartbeat(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)
    started = threading.Event()

    @registry.task(queue="cancel", lease=1.5)  # a heartbeat every half second
    def patient(ctx: JobContext) -> None:
        started.set()
        wait_for(lambda: ctx.cancelled)
        ctx.raise_if_cancelled()

    # No LISTEN at all: every notification is missed.
    with running(registry, queue_engine, listen=False):
        (job_id,) = enqueue(queue_engine, patient.job())
        assert started.wait(10)
        cancel(queue_engine, job_id)
        wait_until(
            lambda: status(queue_engine, job_id) == "cancelled", timeout=10, message="cancelled"
        )


# -- a cancel is the row's, not the notification's (issue 29, 1 and 2) -------------------


def _channel(model: Any) -> str:
    return names(model.__table__.name).channel


@contextmanager
def role_without_grants(engine: sa.Engine) -> Iterator[sa.Engine]:
    """An engine logged in as a fresh role with LOGIN and no grant at all."""
    role = f"sqla_jobs_nobody_{uuid.uuid4().hex[:12]}"
    with engine.begin() as connection:
        connection.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
    nobody = sa.create_engine(engine.url.set(username=role, password=None), poolclass=NullPool)
    try:
        yield nobody
    finally:
        nobody.dispose()
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"
                ),
                {"r": role},
            )
            connection.execute(sa.text(f"DROP ROLE {role}"))


def _victim_and_witness(
    registry: Registry, mode: Literal["lease", "lock"]
) -> tuple[Any, Any, dict[str, Any]]:
    """Two tasks with a long lease (the heartbeat's own read comes after 20 s, so only a
    notification can act in time). The victim runs until the test lets it go, recording
    whether it was ever told it is cancelled (and writes an order in lock mode); the
    witness waits for its cancel."""
    seen: dict[str, Any] = {"victim started": threading.Event(), "go": threading.Event()}
    seen["witness started"] = threading.Event()

    @registry.task(queue="cancel", lease=60, mode=mode)
    def victim(ctx: JobContext) -> str:
        if mode == "lock":
            ctx.session.add(Order(id=ctx.args["order"], customer="ada"))
            ctx.session.flush()
        seen["victim started"].set()
        deadline = time.monotonic() + HANDLER_PATIENCE
        while not seen["go"].is_set() and time.monotonic() < deadline:
            seen.setdefault("victim told cancelled", False)
            if ctx.cancelled:
                seen["victim told cancelled"] = True
            time.sleep(0.01)
        return "done"

    @registry.task(queue="cancel", lease=60)
    def witness(ctx: JobContext) -> None:
        seen["witness started"].set()
        wait_for(lambda: ctx.cancelled)
        ctx.raise_if_cancelled()

    return victim, witness, seen


@pytest.mark.parametrize("mode", ["lease", "lock"])
def test_a_forged_cancel_notification_from_a_role_without_grants_changes_nothing(
    queue_engine: sa.Engine, mode: Literal["lease", "lock"]
) -> None:
    registry = Registry(EmailJob)
    victim, witness, seen = _victim_and_witness(registry, mode)
    with (
        role_without_grants(queue_engine) as nobody,
        running(registry, queue_engine, concurrency=2),
    ):
        victim_id, witness_id = enqueue(queue_engine, victim.job({"order": 7}), witness.job())
        assert seen["victim started"].wait(10)
        assert seen["witness started"].wait(10)
        with nobody.connect() as connection:
            # The role may not even read the job table ...
            with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
                connection.execute(sa.text("SELECT 1 FROM email_jobs"))
            connection.rollback()
            # ... but any role may NOTIFY, with the payload of a real cancel.
            connection.execute(
                sa.text("SELECT pg_notify(:channel, :payload)"),
                {"channel": _channel(EmailJob), "payload": f"!cancel:{victim_id}:1"},
            )
            connection.commit()
        # A genuine cancel, notified after the forged one: once it took effect, the worker
        # has heard the forged one too (a listener gets notifications in commit order).
        assert cancel(queue_engine, witness_id) is JobStatus.RUNNING
        wait_until(
            lambda: status(queue_engine, witness_id) == "cancelled",
            timeout=5,
            message="the genuine cancel took effect",
        )
        assert seen["victim told cancelled"] is False
        assert status(queue_engine, victim_id) == "running"
        seen["go"].set()
        wait_until(
            lambda: status(queue_engine, victim_id) == "succeeded",
            timeout=10,
            message="the victim succeeds",
        )
    ended = row(queue_engine, victim_id)
    assert (ended.status, ended.attempts, ended.cancel_requested_at) == ("succeeded", 1, None)
    assert seen["victim told cancelled"] is False
    assert orders(queue_engine) == ([7] if mode == "lock" else [])


def test_the_cancelled_outcome_needs_a_cancel_request_in_the_row(queue_engine: sa.Engine) -> None:
    # The statement that writes ``cancelled`` holds the rule by itself, whoever calls it.
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        assert cancel_attempts(session, [job]) == [job]  # no request: not cancelled
    assert status(queue_engine, job_id) == "running"
    cancel(queue_engine, job_id)
    with Session(queue_engine) as session, session.begin():
        assert cancel_attempts(session, [job]) == []
    assert status(queue_engine, job_id) == "cancelled"


class _TenantA(DeclarativeBase):
    metadata = sa.MetaData(schema="tenant_a")


class _TenantB(DeclarativeBase):
    metadata = sa.MetaData(schema="tenant_b")


class TenantAJob(JobMixin, _TenantA):
    __tablename__ = "jobs"


class TenantBJob(JobMixin, _TenantB):
    __tablename__ = "jobs"


def test_a_cancel_in_one_schema_leaves_the_same_job_of_another_schema_running(
    fresh_database: FreshDatabase,
) -> None:
    engine = sa.create_engine(fresh_database("sqla_jobs_tenants"), pool_size=20)
    try:
        with engine.begin() as connection:
            connection.execute(sa.text("CREATE SCHEMA tenant_a"))
            connection.execute(sa.text("CREATE SCHEMA tenant_b"))
        _TenantA.metadata.create_all(engine)
        _TenantB.metadata.create_all(engine)
        assert _channel(TenantAJob) == _channel(TenantBJob)  # one channel: only a hint
        registry_a, registry_b = Registry(TenantAJob), Registry(TenantBJob)

        @registry_a.task(queue="cancel", lease=60)
        def doomed(ctx: JobContext) -> None:
            wait_for(lambda: ctx.cancelled)
            ctx.raise_if_cancelled()

        victim, witness, seen = _victim_and_witness(registry_b, "lease")
        with (
            running(registry_a, engine, concurrency=1),
            running(registry_b, engine, concurrency=2),
        ):
            (a_id,) = enqueue(engine, doomed.job())
            b_id, b_witness = enqueue(engine, victim.job({"order": 1}), witness.job())
            assert a_id == b_id == 1
            assert seen["victim started"].wait(10)
            assert seen["witness started"].wait(10)
            wait_until(
                lambda: _status_in(engine, "tenant_a", a_id) == "running",
                timeout=10,
                message="tenant_a's job 1 runs",
            )
            with Session(engine) as session, session.begin():
                assert sqla_jobs.cancel(session, TenantAJob, a_id) is JobStatus.RUNNING
            wait_until(
                lambda: _status_in(engine, "tenant_a", a_id) == "cancelled",
                timeout=5,
                message="tenant_a's job 1 is cancelled",
            )
            # tenant_b's worker heard tenant_a's notification before this one of its own.
            with Session(engine) as session, session.begin():
                assert sqla_jobs.cancel(session, TenantBJob, b_witness) is JobStatus.RUNNING
            wait_until(
                lambda: _status_in(engine, "tenant_b", b_witness) == "cancelled",
                timeout=5,
                message="tenant_b's witness is cancelled",
            )
            assert seen["victim told cancelled"] is False
            seen["go"].set()
            wait_until(
                lambda: _status_in(engine, "tenant_b", b_id) == "succeeded",
                timeout=10,
                message="tenant_b's job 1 succeeds",
            )
        assert seen["victim told cancelled"] is False
    finally:
        engine.dispose()


def _status_in(engine: sa.Engine, schema: str, job_id: int) -> str:
    with engine.connect() as connection:
        return str(
            connection.execute(
                sa.text(f"SELECT status FROM {schema}.jobs WHERE id = :id"), {"id": job_id}
            ).scalar_one()
        )


# -- the rest of the handler's view ------------------------------------------------------


def test_the_result_model_is_declared_once_on_the_job_model(
    queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(EmailJob, "result_model", EmailJobResult)
    assert Registry(EmailJob).result_model is EmailJobResult
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job, result={"sent": 1})  # no result_model= here
    assert results(queue_engine) == {job_id: {"sent": 1}}


def test_handlers_see_the_job_models_own_columns(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob, result_model=EmailJobResult)

    @registry.task(queue="cancel")
    def leased(ctx: JobContext) -> dict[str, Any]:
        return ctx.columns

    @registry.task(queue="cancel", mode="lock")
    def locked(ctx: JobContext) -> dict[str, Any]:
        assert ctx.columns is ctx.columns  # read once
        return ctx.columns

    with Session(queue_engine) as session, session.begin():
        session.add(Order(id=7, customer="ada"))
    ids = enqueue(queue_engine, leased.job(order_id=7), locked.job(order_id=7), leased.job())
    with running(registry, queue_engine):
        wait_until(
            lambda: all(status(queue_engine, i) == "succeeded" for i in ids),
            timeout=10,
            message="all succeeded",
        )
    assert results(queue_engine) == {
        ids[0]: {"order_id": 7},
        ids[1]: {"order_id": 7},
        ids[2]: {"order_id": None},
    }


async def test_a_lock_mode_coroutines_async_session_rolls_back_when_it_is_cancelled(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob)
    started = asyncio.Event()
    seen: list[str] = []
    loop = asyncio.get_running_loop()

    @registry.task(queue="cancel", mode="lock", lease=60)
    async def charge(ctx: JobContext) -> None:
        ctx.async_session.add(Order(id=ctx.args["order"], customer="ada"))
        await ctx.async_session.flush()
        loop.call_soon_threadsafe(started.set)
        try:
            await asyncio.sleep(HANDLER_PATIENCE)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async_engine = create_async_engine(queue_engine.url)
    sessions: async_sessionmaker[AsyncSession] = async_sessionmaker(async_engine)
    try:
        async with Worker(
            registry, queue_engine, poll_interval=0.1, grace=5, async_session_factory=sessions
        ):
            (job_id,) = await asyncio.to_thread(enqueue, queue_engine, charge.job({"order": 6}))
            await asyncio.wait_for(started.wait(), 10)
            await asyncio.to_thread(cancel, queue_engine, job_id)
            deadline = time.monotonic() + 5
            while await asyncio.to_thread(status, queue_engine, job_id) != "cancelled":
                assert time.monotonic() < deadline, "timed out waiting for the cancel"
                await asyncio.sleep(0.05)
    finally:
        await async_engine.dispose()
    assert seen == ["cancelled"]
    assert await asyncio.to_thread(orders, queue_engine) == []


def test_an_attempt_whose_handler_has_not_started_is_settled_as_a_cancel_at_once() -> None:
    # The worker's bookkeeping alone (no database): a request for an attempt still queued
    # for a handler thread fixes its outcome, and its handler then never starts.
    state = State(concurrency=1)
    job = sqla_jobs.ClaimedJob(EmailJob, 1, "q", "t", {}, 0, 1, 20, None, None)  # type: ignore[arg-type]
    attempt = Attempt(job, None, 0.0, 0.0)
    assert state.admit([attempt])
    assert state.request_cancel(attempt.key) is None
    assert attempt.outcome is not None
    assert attempt.outcome.kind is Kind.CANCEL
    assert not state.start(attempt)
    assert state.request_cancel(attempt.key) is None  # idempotent
    assert not state.settle(attempt, Outcome(Kind.COMPLETE))  # one outcome per attempt
    assert state.free_slots() == 1
