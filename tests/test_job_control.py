"""Job control: time limits (a task's or a job's own) and snoozes, proven from SQL with real
workers; their bad inputs refused before any SQL."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import advance_clock
from in_process import PATIENCE, enqueue, running
from models import EmailJob, EmailJobResult, Order
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import ConfigurationError, InvalidJobError, JobContext, LeaseLostError, Registry
from sqla_jobs.context import Snooze
from sqla_jobs.queue import ClaimedJob
from sqla_jobs.queue.outcomes import report_progress, snooze
from sqla_jobs.validation import MAX_SNOOZES
from sqla_jobs.worker.state import Attempt, Kind, Outcome, State


def row(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as connection:
        return connection.execute(
            sa.text(
                "SELECT status, attempts, max_attempts, snoozes, last_error, run_at, "
                "run_at - now() AS wait FROM email_jobs WHERE id = :id"
            ),
            {"id": job_id},
        ).one()


def results(engine: sa.Engine) -> dict[int, Any]:
    with Session(engine) as session:
        return {r.job_id: r.value for r in session.scalars(sa.select(EmailJobResult))}


def until(condition: Any) -> None:
    wait_until(condition, timeout=PATIENCE, message="the job control test's condition")


# -- time limits ---------------------------------------------------------------------------


def test_a_thread_handler_past_its_limit_fails_at_the_limit_and_keeps_its_slot(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob, result_model=EmailJobResult)
    release = threading.Event()
    started = threading.Event()

    @registry.task(time_limit=0.5, max_attempts=1)
    def stubborn(ctx: JobContext) -> str:
        started.set()
        release.wait(PATIENCE)  # ignores ctx.cancelled: a thread cannot be stopped
        return "too late"

    (job_id,) = enqueue(queue_engine, stubborn.job())
    with running(registry, queue_engine, concurrency=1) as worker:
        assert started.wait(PATIENCE)
        # At the limit, while the handler still runs: dead (one attempt), from SQL.
        until(lambda: row(queue_engine, job_id).status == "dead")
        dead = row(queue_engine, job_id)
        assert "ran past its time limit of 0.5 seconds" in dead.last_error
        assert "JobTimeoutError" in dead.last_error
        # Its thread keeps its slot, and health says which job and for how long.
        (overrun,) = worker.health().overrunning
        assert overrun[0] == job_id
        assert overrun[1] >= 0
        assert worker.health().healthy
        release.set()
        until(lambda: not worker.health().overrunning)
    # What the handler returned after its limit changed nothing.
    assert row(queue_engine, job_id).status == "dead"
    assert results(queue_engine) == {}


def test_a_thread_handler_that_watches_ctx_stops_and_is_retried(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)
    told: list[int] = []

    @registry.task(time_limit=timedelta(milliseconds=300), max_attempts=2)
    def polite(ctx: JobContext) -> None:
        if ctx.attempt == 2:
            return
        while not ctx.cancelled:
            threading.Event().wait(0.01)
        told.append(ctx.attempt)
        ctx.raise_if_cancelled()  # JobTimeoutError: the same outcome, already settled

    (job_id,) = enqueue(queue_engine, polite.job())
    with running(registry, queue_engine):
        # The failure retries after the backoff; move the job's clock instead of waiting.
        until(lambda: row(queue_engine, job_id).attempts == 1)
        until(lambda: row(queue_engine, job_id).status == "pending")
        with queue_engine.begin() as connection:
            connection.execute(
                sa.text("UPDATE email_jobs SET run_at = now() WHERE id = :id"), {"id": job_id}
            )
        until(lambda: row(queue_engine, job_id).status == "succeeded")
    assert told == [1]
    assert "time limit" in row(queue_engine, job_id).last_error


def test_a_coroutine_handler_is_cancelled_at_its_limit(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)
    cancelled = threading.Event()

    @registry.task(time_limit=0.3, max_attempts=1)
    async def sleepy(ctx: JobContext) -> None:
        try:
            await asyncio.sleep(PATIENCE)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    (job_id,) = enqueue(queue_engine, sleepy.job())
    with running(registry, queue_engine) as worker:
        until(lambda: row(queue_engine, job_id).status == "dead")
        assert cancelled.wait(PATIENCE)
        until(lambda: not worker.health().overrunning)
    assert "time limit of 0.3 seconds" in row(queue_engine, job_id).last_error


def test_a_jobs_own_limit_takes_the_place_of_its_tasks(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)
    release = threading.Event()

    @registry.task(max_attempts=1)  # no limit of its own: only the job's applies
    def slow(ctx: JobContext) -> None:
        release.wait(PATIENCE)

    limited, free = enqueue(queue_engine, slow.job(time_limit=timedelta(seconds=0.3)), slow.job())
    try:
        with running(registry, queue_engine, concurrency=2):
            until(lambda: row(queue_engine, limited).status == "dead")
            assert row(queue_engine, free).status == "running"  # no limit: still running
            release.set()
            until(lambda: row(queue_engine, free).status == "succeeded")
    finally:
        release.set()


def test_a_lock_mode_handler_past_its_limit_fails_and_its_writes_roll_back(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob)

    @registry.task(mode="lock", time_limit=0.3, max_attempts=1)
    def writer(ctx: JobContext) -> None:
        ctx.session.add(Order(id=7, customer="ada"))
        ctx.session.flush()
        while not ctx.cancelled:  # told at the limit; its transaction holds the row
            threading.Event().wait(0.01)

    (job_id,) = enqueue(queue_engine, writer.job())
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, job_id).status == "dead")
    assert "time limit" in row(queue_engine, job_id).last_error
    with Session(queue_engine) as session:
        assert session.scalars(sa.select(Order)).all() == []


def clock(engine: sa.Engine) -> datetime:
    with engine.connect() as connection:
        now: datetime = connection.execute(sa.select(sa.func.clock_timestamp())).scalar_one()
        return now


def attempted_at(engine: sa.Engine, job_id: int) -> datetime | None:
    with engine.connect() as connection:
        return connection.scalar(  # type: ignore[no-any-return]
            sa.text("SELECT attempted_at FROM email_jobs WHERE id = :id"), {"id": job_id}
        )


@pytest.mark.parametrize("keys", [False, True], ids=["plain", "keyed"])
@pytest.mark.parametrize("hold", [False, True], ids=["lease", "lock"])
def test_each_claim_stamps_its_attempts_start_in_database_time(
    queue_engine: sa.Engine, keys: bool, hold: bool
) -> None:
    key = "k" if keys else None
    (job_id,) = enqueue(queue_engine, EmailJob(task="t", max_attempts=2, ordering_key=key))
    assert attempted_at(queue_engine, job_id) is None  # never claimed
    starts = []
    for _attempt in (1, 2):
        before = clock(queue_engine)
        with Session(queue_engine) as session, session.begin():
            (job,) = sqla_jobs.claim(session, EmailJob, lease=60, keys=keys, hold=hold)
        after = clock(queue_engine)
        start = attempted_at(queue_engine, job.id)
        assert start is not None
        assert before <= start <= after
        starts.append(start)
        advance_clock(queue_engine, EmailJob, 120)  # the lease runs out: taken over next
    assert starts[1] > starts[0]  # the second attempt's own start
    # Its last attempt's lease ran out: the next claim makes it dead, not a new attempt,
    # and the time its last attempt started stays.
    last = attempted_at(queue_engine, job_id)
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, EmailJob, lease=60, keys=keys, hold=hold) == []
    assert row(queue_engine, job_id).status == "dead"
    assert attempted_at(queue_engine, job_id) == last


# -- snooze --------------------------------------------------------------------------------


def test_a_snooze_makes_the_job_pending_later_without_spending_an_attempt(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob)

    @registry.task(max_attempts=3)
    def later(ctx: JobContext) -> None:
        raise Snooze(timedelta(hours=1))

    (job_id,) = enqueue(queue_engine, later.job())
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, job_id).snoozes == 1)
    snoozed = row(queue_engine, job_id)
    assert (snoozed.status, snoozed.attempts, snoozed.max_attempts) == ("pending", 1, 4)
    # Database time: an hour from the snooze (give or take the test's own seconds).
    assert timedelta(minutes=59) < snoozed.wait <= timedelta(hours=1)
    assert snoozed.last_error is None  # not a failure


@pytest.mark.parametrize("how", ["raise", "return", "coroutine"])
def test_a_snoozed_job_runs_again_after_its_delay(queue_engine: sa.Engine, how: str) -> None:
    registry = Registry(EmailJob, result_model=EmailJobResult)

    if how == "coroutine":

        @registry.task(name="again", max_attempts=1)
        async def again_async(ctx: JobContext) -> Any:
            if ctx.attempt == 1:
                raise Snooze(0.2)
            return {"attempt": ctx.attempt}

    else:

        @registry.task(name="again", max_attempts=1)
        def again(ctx: JobContext) -> Any:
            if ctx.attempt == 1:
                if how == "raise":
                    raise Snooze(0.2)
                return Snooze(0.2)
            return {"attempt": ctx.attempt}

    task = registry.get("again")
    assert task is not None
    (job_id,) = enqueue(queue_engine, task.job())
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, job_id).status == "succeeded")
    done = row(queue_engine, job_id)
    # One attempt allowed, and it still ran twice: the snooze spent none.
    assert (done.attempts, done.max_attempts, done.snoozes) == (2, 2, 1)
    assert results(queue_engine) == {job_id: {"attempt": 2}}


def test_a_job_that_snoozed_too_often_fails_instead(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)

    @registry.task(max_attempts=1)
    def forever(ctx: JobContext) -> None:
        raise Snooze(1)

    (job_id,) = enqueue(queue_engine, forever.job())
    with queue_engine.begin() as connection:  # as if it had snoozed the most already
        connection.execute(sa.text("UPDATE email_jobs SET snoozes = :n"), {"n": MAX_SNOOZES})
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, job_id).status == "dead")
    dead = row(queue_engine, job_id)
    assert dead.snoozes == MAX_SNOOZES
    assert f"after {MAX_SNOOZES} snoozes" in dead.last_error


def test_a_lock_mode_snooze_rolls_back_the_handlers_writes(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)

    @registry.task(mode="lock")
    def wrote(ctx: JobContext) -> None:
        ctx.session.add(Order(id=8, customer="ada"))
        ctx.session.flush()
        raise Snooze(3600)

    (job_id,) = enqueue(queue_engine, wrote.job())
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, job_id).snoozes == 1)
    assert row(queue_engine, job_id).status == "pending"
    with Session(queue_engine) as session:
        assert session.scalars(sa.select(Order)).all() == []


def test_snooze_is_fenced_by_the_attempt(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    with Session(queue_engine) as session, session.begin():
        (first,) = sqla_jobs.claim(session, EmailJob, lease=0.001)
    with queue_engine.begin() as connection:  # its lease ran out: another attempt takes it
        connection.execute(
            sa.text("UPDATE email_jobs SET lease_expires_at = now() - interval '1 s'")
        )
    with Session(queue_engine) as session, session.begin():
        (second,) = sqla_jobs.claim(session, EmailJob)
    assert second.attempt == first.attempt + 1
    with Session(queue_engine) as session, session.begin(), pytest.raises(LeaseLostError):
        snooze(session, first, 60)
    assert row(queue_engine, job_id).status == "running"  # the second attempt's, untouched
    with Session(queue_engine) as session, session.begin():
        assert snooze(session, second, 60) is sqla_jobs.JobStatus.PENDING
    assert row(queue_engine, job_id).snoozes == 1


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 8 * 86_400, float("nan"), True, "5", timedelta(0)])
def test_a_bad_time_limit_is_refused_before_any_sql(queue_engine: sa.Engine, bad: Any) -> None:
    registry = Registry(EmailJob)
    with pytest.raises(ConfigurationError, match="time_limit"):
        registry.add(lambda ctx: None, name="t", time_limit=bad)
    assert registry.get("t") is None
    with pytest.raises(InvalidJobError, match="time_limit"):
        EmailJob(task="t", time_limit=bad)
    unbound = Session()  # any SQL would raise UnboundExecutionError
    with pytest.raises(InvalidJobError, match="time_limit"):
        sqla_jobs.enqueue_many(unbound, EmailJob, [{"task": "t", "time_limit": bad}])


@pytest.mark.parametrize("bad", [0, -5, 367 * 86_400, float("inf"), None, "1", False])
def test_a_bad_snooze_delay_is_refused_before_any_sql(queue_engine: sa.Engine, bad: Any) -> None:
    with pytest.raises(InvalidJobError, match="delay"):
        Snooze(bad)
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    with Session(queue_engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, EmailJob)
    unbound = Session()
    with pytest.raises(InvalidJobError, match="delay"):
        snooze(unbound, job, bad)
    assert row(queue_engine, job_id).status == "running"


# -- progress ------------------------------------------------------------------------------


def progress_of(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as connection:
        return connection.execute(
            sa.text("SELECT progress FROM email_jobs WHERE id = :id"), {"id": job_id}
        ).scalar_one()


def test_progress_is_stored_with_the_heartbeat_and_kept_with_the_outcome(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob)
    go_on = threading.Event()

    @registry.task(lease=0.6)  # a heartbeat every 0.2 s
    def long(ctx: JobContext) -> None:
        for step in range(1000):  # many reports, few writes
            ctx.report_progress(step / 2000, "first half")
        go_on.wait(PATIENCE)
        ctx.report_progress(1, "done")

    (job_id,) = enqueue(queue_engine, long.job())
    try:
        with running(registry, queue_engine):
            until(lambda: progress_of(queue_engine, job_id) is not None)
            seen = progress_of(queue_engine, job_id)
            assert (seen["value"], seen["message"]) == (999 / 2000, "first half")
            assert row(queue_engine, job_id).status == "running"
            go_on.set()
            until(lambda: row(queue_engine, job_id).status == "succeeded")
    finally:
        go_on.set()
    kept = progress_of(queue_engine, job_id)
    assert (kept["value"], kept["message"]) == (1.0, "done")
    assert kept["at"] >= seen["at"]  # database time, as JSON text


def test_a_lock_mode_handlers_progress_is_kept_with_its_job(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)

    @registry.task(mode="lock")
    def counted(ctx: JobContext) -> None:
        ctx.report_progress(3, "three of three")

    (job_id,) = enqueue(queue_engine, counted.job())
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, job_id).status == "succeeded")
    assert progress_of(queue_engine, job_id)["message"] == "three of three"


def test_progress_survives_an_outcome_write_tried_again(
    queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The outcome writer's first try fails as a lost connection would (a transient error):
    # the batch is written again, and the handler's last progress with it.
    import psycopg

    from sqla_jobs.queue import complete_attempts
    from sqla_jobs.worker import writer

    failed: list[int] = []

    def fail_once(session: Any, jobs: Any, **kwargs: Any) -> Any:
        if not failed and jobs:
            failed.append(jobs[0].id)
            raise sa.exc.OperationalError("UPDATE", {}, psycopg.OperationalError("gone"))
        return complete_attempts(session, jobs, **kwargs)

    monkeypatch.setattr(writer, "complete_attempts", fail_once)
    registry = Registry(EmailJob)

    @registry.task(lease=30)  # no heartbeat before the outcome: only the writer stores it
    def quick(ctx: JobContext) -> None:
        ctx.report_progress(1, "all of it")

    (job_id,) = enqueue(queue_engine, quick.job())
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, job_id).status == "succeeded")
    assert failed == [job_id]
    assert progress_of(queue_engine, job_id)["message"] == "all of it"


@pytest.mark.parametrize(
    ("value", "message", "field"),
    [
        ("1", "", "value"),
        (float("nan"), "", "value"),
        (True, "", "value"),
        (1, "x" * 201, "message"),
        (1, "a\x00b", "message"),
        (1, None, "message"),
    ],
)
def test_bad_progress_is_refused_before_any_sql(
    queue_engine: sa.Engine, value: Any, message: Any, field: str
) -> None:
    (job_id,) = enqueue(queue_engine, EmailJob(task="t"))
    with Session(queue_engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, EmailJob)
    with pytest.raises(InvalidJobError, match=field):
        JobContext(job, "w").report_progress(value, message)
    unbound = Session()  # any SQL would raise UnboundExecutionError
    with pytest.raises(InvalidJobError, match=field):
        report_progress(unbound, job, value, message)
    assert progress_of(queue_engine, job_id) is None
    with Session(queue_engine) as session, session.begin():
        assert report_progress(session, job, 0.25, "a quarter")
    assert progress_of(queue_engine, job_id)["value"] == 0.25


def test_the_time_limit_bookkeeping_holds_only_the_running_attempts() -> None:
    # A worker with a long limit and many quick jobs: each settled attempt leaves the
    # watcher's table at once, so it never grows past the attempts running.
    state = State(concurrency=1000)
    now = datetime.now(timezone.utc)
    hour = timedelta(hours=1)
    attempts = [
        Attempt(ClaimedJob(EmailJob, n, "q", "t", {}, 0, 1, 3, now, now, None, hour), None, 0, 1e9)
        for n in range(1000)
    ]
    assert state.admit(attempts)
    for attempt in attempts:
        assert state.start(attempt)
    assert len(state.limited) == 1000
    assert state.next_deadline == min(a.deadline for a in attempts)
    for attempt in attempts:
        assert state.settle(attempt, Outcome(Kind.COMPLETE))
    assert state.limited == {}
    assert state.time_out(time.monotonic() + 2 * 3600) == []  # nothing left to time out


def test_a_job_dead_at_its_time_limit_is_logged_like_any_death(
    queue_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by the fault harness: the failure settled at the limit was logged only as the
    # limit passed (job_timed_out), never as job_dead, which is what alerting listens to.
    registry = Registry(EmailJob)
    release = threading.Event()

    @registry.task(time_limit=0.3, max_attempts=1)
    def slow(ctx: JobContext) -> None:
        release.wait(PATIENCE)

    (job_id,) = enqueue(queue_engine, slow.job())
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    try:
        with running(registry, queue_engine):
            until(lambda: row(queue_engine, job_id).status == "dead")
            until(lambda: any(getattr(r, "action", None) == "job_dead" for r in caplog.records))
    finally:
        release.set()
    actions = [
        getattr(r, "action", None) for r in caplog.records if getattr(r, "job_id", 0) == job_id
    ]
    assert actions.count("job_timed_out") == 1
    assert actions.count("job_dead") == 1
