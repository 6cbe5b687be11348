"""Regression tests for the worker defects fixed by its rebuild (one outcome per attempt).

Each test names the defect it pins down. Every one of them failed on the worker before the
rebuild: a job held forever, a job marked succeeded without running, a claim that raised or
returned nothing, a death nobody logged, a restart that cost a spurious error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Final

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from worker_harness import JobDatabase, running, wait_until
from worker_tasks import WorkerJob, registry

import sqla_jobs
from sqla_jobs import ConfigurationError, RetryPolicy
from sqla_jobs import _queries as statements
from sqla_jobs.backoff import Backoff
from sqla_jobs.embedded import EmbeddedPostgres
from sqla_jobs.worker import Worker, listener
from sqla_jobs.worker.heartbeat import Heartbeat
from sqla_jobs.worker.runner import Runner
from sqla_jobs.worker.state import Attempt
from sqla_jobs.worker.writer import OutcomeWriter


@pytest.fixture
def db(worker_tasks_db: JobDatabase) -> JobDatabase:
    return worker_tasks_db


def _actions(caplog: pytest.LogCaptureFixture) -> list[tuple[str | None, int | None]]:
    return [(r.__dict__.get("action"), r.__dict__.get("job_id")) for r in caplog.records]


def _succeeded_with(db: JobDatabase, job_id: int, result: Any) -> bool:
    return db.status(job_id) == "succeeded" and db.result(job_id) == result


# -- 1. attempts that never reached an outcome ------------------------------------------------


def test_coroutine_of_a_queue_the_worker_does_not_serve_runs(db: JobDatabase) -> None:
    # Defect 1a: no event loop existed for it, the fetch thread died on an assert and the
    # rest of the batch was held, heartbeated, forever.
    job_id = db.enqueue("async_elsewhere", queue="work")
    others = db.enqueue_many([("sleepy", None)] * 3)
    with running(db, queues=["work"]) as worker:
        wait_until(lambda: _succeeded_with(db, job_id, 1), timeout=10, message="the coroutine runs")
        wait_until(lambda: db.all_succeeded(4), timeout=10, message="the batch succeeds")
        assert worker.is_healthy()
    assert len(others) == 3


def test_async_result_that_cannot_be_encoded_fails_its_job(db: JobDatabase) -> None:
    # Defect 1b: a ValueError from encoding the result escaped the done-callback; the
    # attempt never reached an outcome.
    job_id = db.enqueue("huge_result")
    with running(db) as worker:
        wait_until(lambda: db.status(job_id) == "dead", timeout=10, message="dead")
        # The attempt is let go once its outcome's commit has returned, just after the row
        # reads dead.
        wait_until(lambda: worker.health().in_flight == 0, timeout=10, message="let go")
    last_error = db.job(job_id).last_error
    assert last_error is not None
    assert "ValueError" in last_error


def test_error_text_with_a_lone_surrogate_is_stored_and_blocks_nothing(db: JobDatabase) -> None:
    # Defect 1c: psycopg could not encode the error text; the outcome writer retried the
    # same batch forever and every outcome behind it was stuck.
    bad = db.enqueue("surrogate_error")
    good = db.enqueue_many([("sleepy", None)] * 5)
    with running(db):
        wait_until(lambda: db.status(bad) == "dead", timeout=10, message="dead")
        wait_until(lambda: db.all_succeeded(5), timeout=10, message="the others succeed")
    last_error = db.job(bad).last_error
    assert last_error is not None
    assert "cannot open report-\\udcff.csv" in last_error
    assert len(good) == 5


def test_an_outcome_the_database_refuses_is_isolated(
    db: JobDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    # A poison outcome: the user's results table refuses one value. The batch is split, the
    # others are written, and that job is failed with a readable error instead.
    with db.engine.begin() as connection:
        connection.execute(
            sa.text(
                "ALTER TABLE worker_job_results ADD CONSTRAINT no_poison "
                "CHECK (NOT (value ? 'poison'))"
            )
        )
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    poison = db.enqueue("result_of", {"result": {"poison": 1}}, max_attempts=2)
    fine = db.enqueue_many([("result_of", {"result": {"n": n}}) for n in range(8)])
    with running(db, concurrency=8):
        wait_until(lambda: db.status(poison) == "dead", timeout=15, message="dead")
        wait_until(
            lambda: all(_succeeded_with(db, i, {"n": n}) for n, i in enumerate(fine)),
            timeout=15,
            message="the others succeed with their results",
        )
    job = db.job(poison)
    assert (job.attempts, job.max_attempts) == (2, 2)
    assert job.last_error is not None
    assert "could not be stored" in job.last_error
    assert "no_poison" in job.last_error
    assert ("outcome_refused", poison) in _actions(caplog)


def test_an_outcome_that_cannot_be_written_at_all_is_given_up(
    db: JobDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Neither the outcome nor the failure in its place can be written: the attempt stops
    # being held (and heartbeated), so its lease runs out and the job runs again.
    from sqla_jobs.worker import writer

    refused: list[int] = []

    def refuse_first(session: Any, jobs: Sequence[Any], **kwargs: Any) -> Any:
        if not refused and jobs:
            refused.append(jobs[0].id)
            raise ValueError("refused, whatever it is")
        return sqla_jobs.queue.complete_attempts(session, jobs, **kwargs)

    def refuse_fail(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("refused too")

    monkeypatch.setattr(writer, "complete_attempts", refuse_first)
    monkeypatch.setattr(writer, "fail", refuse_fail)
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    job_id = db.enqueue("sleepy")
    with running(db) as worker:
        wait_until(lambda: db.status(job_id) == "succeeded", timeout=15, message="run again")
        wait_until(lambda: worker.health().in_flight == 0, timeout=10, message="let go")
    assert refused == [job_id]
    assert ("outcome_dropped", job_id) in _actions(caplog)
    job = db.job(job_id)
    assert job.attempts == 2  # the given-up attempt's lease ran out; the next one succeeded


def test_backoff_past_attempt_1024_does_not_overflow(queue_engine: sa.Engine) -> None:
    # Defect 1c: power(2.0, attempts - 1) overflowed float8 past attempt 1024.
    from models import EmailJob

    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t", queue="q"))
    with queue_engine.begin() as connection:
        connection.execute(sa.update(EmailJob).values(attempts=1100, max_attempts=1200))
    with Session(queue_engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, EmailJob, queues="q")
        outcome = sqla_jobs.fail(
            session, job, "again", policy=RetryPolicy(cap=timedelta(seconds=10))
        )
    assert outcome.will_retry
    assert job.attempt == 1101


# -- 2. a handler that returns a coroutine without being async def -------------------------


@pytest.mark.parametrize(
    ("task", "result"), [("wrapped_async", "wrapped"), ("async_callable", "called")]
)
def test_a_returned_coroutine_is_awaited(db: JobDatabase, task: str, result: str) -> None:
    # Defect 2: is_async was decided once at registration; these were marked succeeded and
    # their bodies never ran.
    job_id = db.enqueue(task)
    with running(db):
        wait_until(lambda: _succeeded_with(db, job_id, result), timeout=10, message="runs")
    assert [e.attempt for e in db.effects(job_id, "effect")] == [1]


# -- 3. isolation -----------------------------------------------------------------------------


def test_worker_on_a_repeatable_read_engine_claims_at_read_committed(
    db: JobDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    # Defect 3: with a REPEATABLE READ engine, concurrent claims raised SerializationFailure
    # instead of skipping.
    caplog.set_level(logging.WARNING, logger="sqla_jobs")
    db.enqueue_many([("sleepy", None)] * 60)
    rr = {"isolation_level": "REPEATABLE READ"}
    with (
        running(db, engine_options=rr, concurrency=2, batch_size=2, name="a"),
        running(db, engine_options=rr, concurrency=2, batch_size=2, name="b"),
    ):
        wait_until(lambda: db.all_succeeded(60), timeout=30, message="all succeed")
    # Nothing went wrong but, on a machine too busy to renew a 1 s lease in time, a lease
    # taken over (which the fencing handles, and other tests prove).
    assert [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "lost its lease" not in r.getMessage()
    ] == []


def test_hold_claim_refuses_a_repeatable_read_transaction(queue_engine: sa.Engine) -> None:
    # Defect 3: after an earlier statement in a REPEATABLE READ transaction, claim(hold=True)
    # returned [] and left the job running with an attempt used up.
    from models import EmailJob

    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t", queue="q"))
    rr_engine = queue_engine.execution_options(isolation_level="REPEATABLE READ")
    with Session(rr_engine) as session, session.begin():
        session.execute(sa.select(sa.func.count()).select_from(EmailJob))
        with pytest.raises(ConfigurationError, match="READ COMMITTED"):
            sqla_jobs.claim(session, EmailJob, queues="q", hold=True)
    with Session(queue_engine) as session:
        job = session.scalars(sa.select(EmailJob)).one()
        assert (job.status, job.attempts) == ("pending", 0)


# -- 4. the heartbeat never waits on a row lock ---------------------------------------------------


def test_heartbeat_skips_a_locked_row_instead_of_waiting(queue_engine: sa.Engine) -> None:
    # Defect 4: the heartbeat and the outcome writer could deadlock. The heartbeat is now one
    # statement that locks in id order with SKIP LOCKED: it never waits, so it cannot.
    from models import EmailJob

    with Session(queue_engine) as session, session.begin():
        session.add_all([EmailJob(task="t", queue="q") for _ in range(3)])
    with Session(queue_engine) as session, session.begin():
        jobs = sqla_jobs.claim(session, EmailJob, queues="q", limit=3)
    with queue_engine.connect() as holder:
        holder.execute(sa.select(EmailJob.id).where(EmailJob.id == jobs[1].id).with_for_update())
        with Session(queue_engine) as session, session.begin():
            session.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
            refused = sqla_jobs.heartbeat(session, jobs, lease=[60, 60, 60])
        holder.rollback()
    assert [job.id for job in refused] == [jobs[1].id]


# -- 5. a lease is checked before a handler starts ---------------------------------------------


def test_an_attempt_whose_lease_ran_out_before_it_started_is_not_run(
    db: JobDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Defect 5: a worker stopped (SIGSTOP) between its claim and the handler's start ran the
    # handler after resuming, although its lease had long run out. Here the hand-off to the
    # handler threads, and the heartbeat, are held back past the one-second lease instead
    # (what a SIGSTOP does to the whole process).
    original_submit, original_beat = Runner.submit, Heartbeat.beat
    delayed: list[int] = []
    paused = threading.Event()

    def late_submit(self: Runner, attempts: Sequence[Attempt]) -> None:
        if not delayed:
            delayed.extend(a.job.id for a in attempts)
            paused.set()
            time.sleep(1.5)
            paused.clear()
        original_submit(self, attempts)

    def beat(self: Heartbeat) -> None:
        if not paused.is_set():
            original_beat(self)

    monkeypatch.setattr(Runner, "submit", late_submit)
    monkeypatch.setattr(Heartbeat, "beat", beat)
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    job_id = db.enqueue("sleepy")
    with running(db):
        wait_until(lambda: db.status(job_id) == "succeeded", timeout=15, message="succeeds")
    assert delayed == [job_id]
    # The late attempt 1 never started its handler; attempt 2 ran.
    assert [e.attempt for e in db.effects(job_id, "start")] == [2]
    # Its outcome: given back, or (when the next claim took the expired lease over first)
    # fenced out. Either way it is logged.
    logged = [
        r.__dict__
        for r in caplog.records
        if r.__dict__.get("action") in {"jobs_released", "lease_lost"}
        and "before it started" in r.getMessage()
    ]
    assert logged


# -- 6. a job made dead by the claim is logged ---------------------------------------------------


def test_a_job_the_claim_makes_dead_is_logged(
    queue_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    from models import EmailJob

    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t", queue="q", max_attempts=1))
    with Session(queue_engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, EmailJob, queues="q", lease=0.01)
    time.sleep(0.05)  # the attempt's worker "died": its lease runs out
    caplog.set_level(logging.ERROR, logger="sqla_jobs")
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, EmailJob, queues="q") == []
    records = [r for r in caplog.records if r.__dict__.get("action") == "attempts_exhausted"]
    assert [r.__dict__["job_id"] for r in records] == [job.id]
    assert records[0].levelno == logging.ERROR


# -- 7. shutdown races --------------------------------------------------------------------------


def test_terminate_ends_only_the_transaction_it_was_given(queue_engine: sa.Engine) -> None:
    # Defect 7: shutdown could pg_terminate_backend a pid whose connection had gone back to
    # the pool and was serving someone else. It now names the transaction, not the backend.
    with queue_engine.connect() as victim:
        pid, started = victim.execute(statements.backend_transaction()).one()
        victim.commit()
        victim.execute(sa.text("SELECT 1"))  # a new transaction on the same backend
        with queue_engine.connect() as admin:
            ended = admin.execute(
                statements.terminate_transactions(),
                {"pids": str(pid), "xact_starts": repr(float(started))},
            ).all()
            admin.commit()
        assert ended == []
        assert victim.execute(sa.text("SELECT 1")).scalar() == 1  # still alive


def test_jobs_of_a_claim_that_returns_during_shutdown_are_given_back(db: JobDatabase) -> None:
    # Defect 7: a claim still blocked when the fetch thread's join timed out returned jobs
    # that were neither run nor released. They are now given back by the fetch loop.
    with db.engine.connect() as blocker, running(db, listen=False, lock_timeout=30.0) as worker:
        # A migration's table lock: the fetch loop's next claim waits behind it. The jobs
        # are enqueued in that same transaction, so they appear when the lock goes.
        blocker.execute(sa.text("LOCK TABLE worker_jobs IN ACCESS EXCLUSIVE MODE"))
        ids = (
            blocker.execute(
                sa.insert(WorkerJob)
                .values([{"task": "sleepy", "queue": "work"}] * 3)
                .returning(WorkerJob.id)
            )
            .scalars()
            .all()
        )
        time.sleep(0.5)  # the claim is waiting now
        worker.stop(graceful=False)
        wait_until(lambda: not worker._state.accepting, timeout=10, message="shutdown took over")
        blocker.commit()
    for job_id in ids:
        job = db.job(job_id)
        assert (job.status, job.attempts, job.max_attempts) == ("pending", 1, 21)
        assert db.effects(job_id, "start") == []


# -- 8. smaller ones ----------------------------------------------------------------------------


def test_lock_mode_jobs_get_their_own_tasks_lease(db: JobDatabase) -> None:
    # Defect 8: lock-held jobs got the worker's shortest lease (1 s), not their task's (30 s).
    job_id = db.enqueue("long_locked", {"sleep": 1.0})
    with running(db):
        wait_until(lambda: db.started(job_id), timeout=10, message="started")
        with db.engine.connect() as connection:
            left = connection.execute(
                sa.select(
                    sa.func.extract("epoch", WorkerJob.lease_expires_at - sa.func.now())
                ).where(WorkerJob.id == job_id)
            ).scalar_one()
        assert left > 20
        wait_until(lambda: db.status(job_id) == "succeeded", timeout=10, message="succeeds")


def test_a_worker_for_a_missing_database_fails_at_start(db: JobDatabase) -> None:
    # Defect 8: it retried forever instead of failing at start.
    url = sa.make_url(db.url).set(database="sqla_jobs_no_such_database")
    engine = sa.create_engine(url)
    try:
        worker = Worker(registry, engine, handle_signals=False)
        started = time.monotonic()
        with pytest.raises(ConfigurationError, match="does not exist"):
            worker.run()
        assert time.monotonic() - started < 10
    finally:
        engine.dispose()


def test_a_table_without_the_wakeup_trigger_is_warned_about(
    db: JobDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    with db.engine.begin() as connection:
        connection.execute(sa.text("DROP TRIGGER worker_jobs_notify_tg ON worker_jobs"))
    caplog.set_level(logging.WARNING, logger="sqla_jobs")
    with running(db):
        pass
    warnings = [r for r in caplog.records if r.__dict__.get("action") == "wakeup_trigger_missing"]
    assert len(warnings) == 1
    assert "create_notify_trigger" in warnings[0].getMessage()


# -- health -------------------------------------------------------------------------------------


def test_a_stuck_outcome_writer_makes_the_worker_unhealthy(
    db: JobDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    original = OutcomeWriter._write

    def stuck(self: OutcomeWriter, batch: Sequence[Attempt]) -> None:
        release.wait(30)
        original(self, batch)

    monkeypatch.setattr(OutcomeWriter, "_write", stuck)
    job_id = db.enqueue("sleepy")
    with running(db, stuck_after=1.0) as worker:
        report = wait_until(
            lambda: (h := worker.health()).outcomes_waiting and not h.healthy and h,
            timeout=10,
            message="unhealthy",
        )
        assert any("to be written" in problem for problem in report.problems)
        assert report.oldest_outcome_age is not None
        assert report.oldest_outcome_age >= 1.0
        assert report.oldest_attempt_age is not None
        release.set()
        wait_until(lambda: db.status(job_id) == "succeeded", timeout=10, message="written")
        wait_until(worker.is_healthy, timeout=10, message="healthy again")


# -- 9. reconnects ---------------------------------------------------------------------------------


@pytest.mark.embedded_only
def test_a_server_restart_costs_no_spurious_error_after_it_is_back(
    db: JobDatabase, embedded_server: EmbeddedPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    # Defect 9: the kept connections never saw the pool's pre-ping; each failed once after
    # a restart (the outcome writer and the heartbeat logged database_error seconds later).
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    first = db.enqueue("sleepy", {"sleep": 0.2})
    with running(db, poll_interval=5.0) as worker:
        wait_until(lambda: db.status(first) == "succeeded", timeout=10, message="first")
        embedded_server.restart()
        back = len(caplog.records)
        wait_until(lambda: worker.health().listening, timeout=20, message="listening again")
        job_id = db.enqueue("sleepy", {"sleep": 1.5})  # heartbeated, then written
        wait_until(lambda: db.status(job_id) == "succeeded", timeout=10, message="second")
        after = caplog.records[back:]
    errors = [r for r in after if r.__dict__.get("action") == "database_error"]
    assert [r.__dict__.get("operation") for r in errors] == []


def test_the_first_claim_after_lost_connections_comes_within_one_connect(
    db: JobDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 29, 15: a lost LISTEN connection waited a backoff step before reconnecting, and
    # an idle fetch loop waits for the listener (or its poll). With a backoff and a poll far
    # longer than the deadline, the job enqueued right after every backend of the worker is
    # ended must be claimed within one reconnect.
    _slow_listener_backoff(monkeypatch)
    with running(db, poll_interval=2 * _SLOW) as worker:
        wait_until(lambda: worker.health().listening, timeout=10, message="listening")
        with db.engine.connect() as connection:
            ended = connection.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND backend_type = 'client backend'"
                )
            ).scalar_one()
        assert ended >= 2  # the listener's and the fetch loop's, at least
        _claimed_within_one_connect(db)


#: The listener's backoff and the poll in the reconnect tests: far longer than their deadline.
_SLOW: Final = 30.0


def _slow_listener_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        listener, "Backoff", lambda **_: Backoff(initial=_SLOW, cap=_SLOW, jitter=0.0)
    )


def _claimed_within_one_connect(db: JobDatabase) -> None:
    job_id = db.enqueue("sleepy")
    wait_until(
        lambda: db.status(job_id) == "succeeded",
        timeout=_SLOW / 3,
        message="the job is claimed and runs",
    )


def test_a_lock_mode_write_refused_at_flush_fails_the_job(db: JobDatabase) -> None:
    # It used to surface after the handler, as a database error: the job was given back
    # (not charged) and ran again without end.
    job_id = db.enqueue("bad_write_locked")
    with running(db):
        wait_until(lambda: db.status(job_id) == "dead", timeout=15, message="dead")
    job = db.job(job_id)
    assert (job.attempts, job.max_attempts) == (2, 2)
    assert job.last_error is not None
    assert "IntegrityError" in job.last_error
    assert db.effects(job_id) == []


@pytest.mark.embedded_only
def test_the_first_claim_after_an_outage_comes_within_one_connect(
    db: JobDatabase, embedded_server: EmbeddedPostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 29, 15: during an outage the listener's tries grew to a backoff step (5 s), and
    # the first claim after PostgreSQL was back waited for it. With a backoff and a poll far
    # longer than the deadline, only a try every PROBE_EVERY seconds meets it.
    _slow_listener_backoff(monkeypatch)
    with running(db, poll_interval=2 * _SLOW) as worker:
        wait_until(lambda: worker.health().listening, timeout=10, message="listening")
        embedded_server.kill()  # down (its data kept); start() recovers it
        wait_until(lambda: not worker.health().listening, timeout=10, message="down")
        embedded_server.start()
        _claimed_within_one_connect(db)
