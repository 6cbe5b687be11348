"""The registry, and the worker run in-process (in a thread) against a real server."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from worker_harness import JobDatabase, running, wait_until
from worker_tasks import WorkerJob, registry

from sqla_jobs import ClaimedJob, ConfigurationError, JobMixin, RetryPolicy
from sqla_jobs.registry import JobContext, Registry
from sqla_jobs.worker import Worker
from sqla_jobs.worker.state import Attempt
from sqla_jobs.worker.writer import OutcomeWriter

# -- the registry (no database) -----------------------------------------------------------


def test_decorator_registers_tasks_with_their_options() -> None:
    reg = Registry(WorkerJob, default_queue="q", default_lease=10)

    @reg.task
    def plain(ctx: JobContext) -> None:
        pass

    @reg.task(name="billing.charge", queue="billing", max_attempts=3, mode="lock", lease=5)
    async def charge(ctx: JobContext) -> int:
        return 1

    assert reg["plain"].queue == "q"
    assert reg["plain"].lease == timedelta(seconds=10)
    assert reg["plain"].mode == "lease"
    task = reg["billing.charge"]
    assert task is charge
    assert (task.queue, task.max_attempts, task.mode, task.lease) == (
        "billing",
        3,
        "lock",
        timedelta(seconds=5),
    )
    assert reg.queues == ["q", "billing"]
    assert "plain" in reg
    assert reg.get("nope") is None


def test_task_job_stamps_the_task_options() -> None:
    job = registry["poison"].job({"a": 1}, priority=5)
    assert isinstance(job, WorkerJob)
    assert (job.task, job.queue, job.max_attempts, job.priority, job.args) == (
        "poison",
        "work",
        3,
        5,
        {"a": 1},
    )
    assert registry["sleepy"].job(queue="elsewhere").queue == "elsewhere"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "sometimes"}, "mode must be 'lease' or 'lock'"),
        ({"lease": 0}, "lease must be positive"),
        ({"queue": "bad queue"}, "malformed"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_bad_task_options_are_refused(options: dict[str, Any], message: str) -> None:
    reg = Registry(WorkerJob)
    with pytest.raises((ConfigurationError, ValueError), match=message):
        reg.add(lambda ctx: None, name="t", **options)


def test_a_task_name_is_registered_once() -> None:
    reg = Registry(WorkerJob)
    reg.add(lambda ctx: None, name="t")
    with pytest.raises(ConfigurationError, match="already registered"):
        reg.add(lambda ctx: None, name="t")


def test_registry_needs_a_job_model() -> None:
    with pytest.raises(ConfigurationError, match="JobMixin"):
        Registry(int)  # type: ignore[arg-type]


def test_lease_mode_context_has_no_session() -> None:
    job = ClaimedJob(
        model=WorkerJob,
        id=1,
        queue="q",
        task="t",
        args={},
        priority=0,
        attempt=1,
        max_attempts=1,
        run_at=None,  # type: ignore[arg-type]
        lease_expires_at=None,  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigurationError, match="lease mode"):
        _ = JobContext(job, "w").session


def test_default_model_is_the_library_job_table() -> None:
    from sqla_jobs.models import Job

    model: type[JobMixin] = Registry().model
    assert model is Job


# -- the worker, in a thread ----------------------------------------------------------------


@pytest.fixture
def db(worker_tasks_db: JobDatabase) -> JobDatabase:
    return worker_tasks_db


def test_unknown_task_is_made_dead_and_kept(db: JobDatabase) -> None:
    with db.engine.begin() as connection:
        job_id = connection.execute(
            sa.insert(WorkerJob).values(task="no_such_task", queue="work").returning(WorkerJob.id)
        ).scalar_one()
    with running(db) as worker:
        wait_until(lambda: db.status(job_id) == "dead", timeout=10, message="dead")
        assert worker.is_healthy()
    job = db.job(job_id)
    assert job.last_error is not None
    assert "unknown task 'no_such_task'" in job.last_error
    assert job.attempts == 1


def test_sync_and_async_handlers_store_their_results(db: JobDatabase) -> None:
    ids = db.enqueue_many([("sleepy", {"sleep": 0.1}), ("async_sleepy", {"sleep": 0.1})])
    with running(db):
        wait_until(lambda: db.all_succeeded(2), timeout=10, message="both succeed")
    assert db.result(ids[0]) == {"attempt": 1}
    assert db.result(ids[1]) == 1


def test_many_coroutines_run_concurrently(db: JobDatabase) -> None:
    ids = db.enqueue_many([("async_sleepy", {"sleep": 1.0})] * 8)
    started = time.monotonic()
    with running(db, concurrency=8):
        wait_until(lambda: db.all_succeeded(8), timeout=15, message="all succeed")
    assert time.monotonic() - started < 6  # not 8 s one after another
    assert len(ids) == 8


def test_delayed_job_starts_within_a_poll_interval_of_run_at(db: JobDatabase) -> None:
    poll_interval = 0.3
    with running(db, poll_interval=poll_interval, listen=False):
        job_id = db.enqueue("sleepy", run_at=sa.func.now() + sa.text("interval '1 second'"))
        wait_until(lambda: db.started(job_id), timeout=10, message="the delayed job starts")
    job = db.job(job_id)
    start = db.effects(job_id, "start")[0].at
    lateness = (start - job.run_at).total_seconds()
    assert 0 <= lateness < poll_interval + 0.5


def test_lock_mode_handler_must_not_end_the_transaction(db: JobDatabase) -> None:
    job_id = db.enqueue("commits_itself", max_attempts=1)
    with running(db):
        wait_until(lambda: db.status(job_id) == "dead", timeout=10, message="dead")
    last_error = db.job(job_id).last_error
    assert last_error is not None
    assert "ended the claim's transaction" in last_error


def test_result_that_jsonb_cannot_store_fails_the_job(db: JobDatabase) -> None:
    job_id = db.enqueue("bad_result", max_attempts=1)
    other = db.enqueue("sleepy")
    with running(db):
        wait_until(lambda: db.status(job_id) == "dead", timeout=10, message="dead")
        wait_until(lambda: db.status(other) == "succeeded", timeout=10, message="other ok")
    last_error = db.job(job_id).last_error
    assert last_error is not None
    assert "result" in last_error


def test_stop_without_grace_releases_running_jobs(db: JobDatabase) -> None:
    job_id = db.enqueue("sleepy", {"sleep": 30})
    with running(db) as worker:
        wait_until(lambda: db.started(job_id), timeout=10, message="started")
        worker.stop(graceful=False)
    job = db.job(job_id)
    assert (job.status, job.attempts, job.max_attempts) == ("pending", 1, 21)


def test_health_file_is_written_while_healthy(db: JobDatabase, tmp_path: Path) -> None:
    health = tmp_path / "health"
    with running(db, health_file=health) as worker:
        wait_until(health.exists, timeout=5, message="the health file exists")
        report = worker.health()
        assert report.healthy
        assert report.database_ok
        assert report.dead_threads == ()
        assert report.fetch_loop_age < 5


def test_worker_refuses_bad_settings(db: JobDatabase) -> None:
    with pytest.raises(ConfigurationError, match="concurrency"):
        Worker(registry, db.engine, concurrency=0)
    with pytest.raises(ConfigurationError, match="Registry"):
        Worker(object(), db.engine)  # type: ignore[arg-type]


def test_fast_retry_policy_is_used() -> None:
    assert registry["poison"].retry == RetryPolicy(
        base=timedelta(milliseconds=50), cap=timedelta(milliseconds=100)
    )


def test_a_stuck_fetch_loop_is_logged_and_unhealthy(
    db: JobDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    with running(db, stuck_after=1.0, listen=False) as worker:
        # A migration's ACCESS EXCLUSIVE lock: SKIP LOCKED does not skip it, the claim waits.
        with db.engine.connect() as blocker:
            blocker.execute(sa.text("LOCK TABLE worker_jobs IN ACCESS EXCLUSIVE MODE"))
            wait_until(lambda: not worker.is_healthy(), timeout=10, message="unhealthy")
            wait_until(
                lambda: any(r.__dict__.get("action") == "fetch_loop_stuck" for r in caplog.records),
                timeout=10,
                message="the stuck loop is logged",
            )
            blocker.rollback()
        wait_until(worker.is_healthy, timeout=10, message="healthy again")


def test_a_crashed_thread_is_logged_and_restarted(
    db: JobDatabase, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = OutcomeWriter.loop
    crashes: list[int] = []

    def crash_once(self: OutcomeWriter) -> None:
        if not crashes:
            crashes.append(1)
            raise RuntimeError("a bug in the outcome writer")
        original(self)

    monkeypatch.setattr(OutcomeWriter, "loop", crash_once)
    with running(db):
        job_id = db.enqueue("sleepy")
        wait_until(lambda: db.status(job_id) == "succeeded", timeout=10, message="succeeded")
    actions = [r.__dict__.get("action") for r in caplog.records]
    assert actions.count("thread_crashed") >= 2  # the crash with its traceback, the restart
    crash = next(r for r in caplog.records if r.levelno == logging.CRITICAL)
    assert crash.exc_info is not None
    assert "a bug in the outcome writer" in str(crash.exc_info[1])


def test_quick_jobs_do_not_wait_behind_a_slow_one(db: JobDatabase) -> None:
    # One claimed batch wakes one handler thread; the jobs queued behind a slow job it runs
    # are handed to other threads within milliseconds, not after the slow job.
    slow = db.enqueue("sleepy", {"sleep": 5}, priority=-1)  # claimed and queued first
    quick = db.enqueue_many([("sleepy", None)] * 3)
    with running(db, concurrency=4):
        wait_until(
            lambda: all(db.status(job_id) == "succeeded" for job_id in quick),
            timeout=4,
            message="the quick jobs succeed while the slow one runs",
        )
        assert db.status(slow) == "running"


def test_a_busy_worker_writes_completions_in_batches(
    db: JobDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Outcomes that settle while the last commit runs are written together: fewer commits
    # than jobs. The results are stored all the same.
    sizes: list[int] = []
    original = OutcomeWriter._write

    def spy(self: OutcomeWriter, batch: Sequence[Attempt]) -> None:
        sizes.append(len(batch))
        original(self, batch)

    monkeypatch.setattr(OutcomeWriter, "_write", spy)
    ids = db.enqueue_many([("sleepy", {"sleep": 0.01})] * 40)
    with running(db, concurrency=8, batch_size=8):
        wait_until(lambda: db.all_succeeded(40), timeout=20, message="all succeed")
    assert sum(sizes) == 40
    assert max(sizes) > 1
    assert all(db.result(job_id) == {"attempt": 1} for job_id in ids)


def test_outcomes_of_a_failed_write_are_written_again(
    db: JobDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The connection fails under the outcome writer's transaction: nothing of it happened,
    # and the whole batch is written again after a backoff, not dropped (and the jobs do not
    # run twice).
    import psycopg
    from sqlalchemy.exc import OperationalError

    import sqla_jobs.queue
    from sqla_jobs.worker import writer

    raised: list[int] = []
    original = sqla_jobs.queue.complete_attempts

    def failing_once(*args: Any, **kwargs: Any) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
        if not raised:
            raised.append(1)
            raise OperationalError("complete", {}, psycopg.OperationalError("server gone"))
        return original(*args, **kwargs)

    monkeypatch.setattr(writer, "complete_attempts", failing_once)
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    ids = db.enqueue_many([("sleepy", {"sleep": 0.01})] * 20)
    with running(db, concurrency=4, batch_size=4):
        wait_until(lambda: db.all_succeeded(20), timeout=20, message="all succeed")
    assert raised
    assert any(r.__dict__.get("operation") == "recording outcomes" for r in caplog.records)
    for job_id in ids:
        assert db.job(job_id).attempts == 1
        assert len(db.effects(job_id, "start")) == 1


def test_kept_connections_get_their_settings_and_give_them_back(db: JobDatabase) -> None:
    from sqla_jobs.worker.link import Link

    engine = sa.create_engine(db.url, pool_size=1, max_overflow=0)
    show = (
        "SELECT current_setting('lock_timeout'), current_setting('synchronous_commit'), "
        "current_setting('plan_cache_mode'), pg_backend_pid()"
    )
    try:
        link = Link(engine, lock_timeout=2.5, synchronous_commit=False)
        inside = link.transaction(lambda c: tuple(c.execute(sa.text(show)).one()))
        isolation = link.transaction(lambda c: c.get_isolation_level())
        link.close()
        with engine.connect() as connection:  # the same pooled connection, given back
            after = tuple(connection.execute(sa.text(show)).one())
    finally:
        engine.dispose()
    assert inside[:3] == ("2500ms", "off", "force_generic_plan")
    assert isolation == "READ COMMITTED"
    # Given back with its settings reset, not discarded (RESET plan_cache_mode was refused
    # once, and the pool opened a new connection instead).
    assert after == ("0", "on", "auto", inside[3])


def test_a_worker_with_async_commit_runs_jobs(db: JobDatabase) -> None:
    ids = db.enqueue_many([("sleepy", None), ("sleepy_locked", None)])
    with running(db, synchronous_commit=False):
        wait_until(lambda: db.all_succeeded(2), timeout=10, message="both succeed")
    assert [db.job(i).attempts for i in ids] == [1, 1]


def test_the_worker_vacuums_its_table_as_it_claims(
    db: JobDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Claimed jobs leave dead entries at the head of the pending index until a vacuum; the
    # worker looks every VACUUM_EVERY claimed jobs (here 5, and any dead row is enough).
    import sqla_jobs.worker.fetcher
    import sqla_jobs.worker.lifecycle
    from sqla_jobs import vacuum

    calls: list[bool] = []

    def eager(engine: sa.Engine, model: type[JobMixin]) -> bool:
        calls.append(vacuum(engine, model, min_dead_rows=0))
        return calls[-1]

    monkeypatch.setattr(sqla_jobs.worker.fetcher, "VACUUM_EVERY", 5)
    monkeypatch.setattr(sqla_jobs.worker.lifecycle, "vacuum", eager)
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    db.enqueue_many([("sleepy", None)] * 20)
    with running(db, batch_size=4):
        wait_until(lambda: db.all_succeeded(20), timeout=20, message="all succeed")
        wait_until(lambda: calls, timeout=10, message="a vacuum")
    assert calls[0] is True
    assert any(r.__dict__.get("action") == "table_vacuumed" for r in caplog.records)
