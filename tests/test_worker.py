"""Real worker processes against a real server: killed, signalled, paused, restarted under.

Every test has a fresh database of its own and leases of one second, and reads the outcome
back from the database.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from worker_harness import JobDatabase, WorkerProcess, Workers, subprocess_env, wait_until

from sqla_jobs.embedded import EmbeddedPostgres

pytestmark = pytest.mark.slow


@pytest.fixture
def db(worker_db: JobDatabase) -> JobDatabase:
    return worker_db


@pytest.fixture
def workers(worker_processes: Workers) -> Workers:
    return worker_processes


def test_sigkill_mid_job_runs_again_and_lock_work_commits_once(
    db: JobDatabase, workers: Workers
) -> None:
    slow = {"sleep": 30, "sleep_attempts": [1]}  # only the first attempt hangs
    leased = db.enqueue("sleepy", slow)
    locked = db.enqueue("sleepy_locked", slow)
    first = workers.start()
    wait_until(
        lambda: db.started(leased) and db.started(locked), timeout=15, message="both started"
    )
    first.send(signal.SIGKILL)
    assert first.wait(5) == -signal.SIGKILL
    assert db.status(leased) == db.status(locked) == "running"

    second = workers.start()
    wait_until(lambda: db.all_succeeded(2), timeout=15, message="both jobs succeed")
    for job_id in (leased, locked):
        job = db.job(job_id)
        assert (job.status, job.attempts) == ("succeeded", 2)
        assert [e.attempt for e in db.effects(job_id, "start")] == [1, 2]
    # Lease mode is at-least-once: the killed attempt never reached its effect; the second did.
    assert [e.attempt for e in db.effects(leased, "effect")] == [2]
    assert db.result(leased) == {"attempt": 2}
    # Lock mode: the first attempt's effect was written in its transaction, which died with
    # the worker; only the second attempt's effect is committed.
    assert [e.attempt for e in db.effects(locked, "effect")] == [2]
    assert second.stop(10) == 0


def test_sigterm_finishes_short_jobs_releases_long_ones_and_loses_nothing(
    db: JobDatabase, workers: Workers
) -> None:
    short = {"sleep": 0.5}
    long = {"sleep": 60, "sleep_attempts": [1]}
    ids = db.enqueue_many(
        [
            ("sleepy", short),
            ("sleepy_locked", short),
            ("sleepy", long),
            ("sleepy_locked", long),
        ]
    )
    short_ids, long_ids = ids[:2], ids[2:]
    worker = workers.start(concurrency=4, grace="2s")
    wait_until(lambda: all(db.started(i) for i in ids), timeout=15, message="all four started")
    stopped_at = time.monotonic()
    assert worker.stop(15) == 0
    assert time.monotonic() - stopped_at < 10
    log = worker.log_text()
    assert "action=worker_stopping" in log
    assert "action=jobs_released" in log
    for job_id in short_ids:
        assert db.status(job_id) == "succeeded"
        assert len(db.effects(job_id, "effect")) == 1
    for job_id in long_ids:
        job = db.job(job_id)
        # Given back: runnable now, and the unfinished attempt is not charged.
        assert (job.status, job.attempts, job.max_attempts) == ("pending", 1, 21)
        assert job.lease_expires_at is None
    assert db.effects(long_ids[1], "effect") == []  # the lock-mode work rolled back

    # Nothing is lost: the next worker runs the released jobs at once (no lease to wait for).
    again = workers.start()
    wait_until(lambda: db.all_succeeded(4), timeout=15, message="all four succeed")
    assert Counter(e.job_id for e in db.effects(kind="effect") if e.job_id == long_ids[1]) == {
        long_ids[1]: 1
    }
    again.send(signal.SIGINT)
    assert again.wait(10) == 0


def test_second_signal_exits_at_once(db: JobDatabase, workers: Workers) -> None:
    job_id = db.enqueue("sleepy", {"sleep": 60})
    worker = workers.start(grace="60s")
    wait_until(lambda: db.started(job_id), timeout=15, message="the job started")
    worker.send(signal.SIGTERM)
    worker.wait_log("action=worker_stopping")
    started = time.monotonic()
    worker.send(signal.SIGTERM)
    assert worker.wait(5) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 3
    assert "exiting at once" in worker.log_text()


@pytest.mark.slow
def test_paused_worker_completes_late_and_changes_nothing(
    db: JobDatabase, workers: Workers
) -> None:
    job_id = db.enqueue("sleepy", {"sleep": 2.5, "sleep_attempts": [1]})
    paused = workers.start(concurrency=1)
    wait_until(lambda: db.started(job_id), timeout=15, message="attempt 1 started")
    paused.send(signal.SIGSTOP)
    try:
        # Its one-second lease runs out; another worker takes the job over and finishes it.
        other = workers.start(concurrency=1)
        wait_until(lambda: db.all_succeeded(1), timeout=15, message="attempt 2 succeeds")
        before = db.job(job_id)
        assert (before.status, before.attempts) == ("succeeded", 2)
    finally:
        paused.send(signal.SIGCONT)
    # The paused attempt wakes up, finds (by its heartbeat, or by its fenced completion)
    # that it lost the job, finishes its sleep and tries to complete: fenced out.
    paused.wait_log("action=lease_lost", timeout=15)
    # Lease mode is at-least-once: the late attempt did run its handler to the end.
    wait_until(
        lambda: sorted(e.attempt for e in db.effects(job_id, "effect")) == [1, 2],
        timeout=15,
        message="the late attempt's handler ends",
    )
    time.sleep(0.5)  # its fenced completion, if it was to change anything, would by now
    after = db.job(job_id)
    assert (after.status, after.attempts, after.finished_at, after.last_error) == (
        before.status,
        before.attempts,
        before.finished_at,
        before.last_error,
    )
    assert db.result(job_id) == {"attempt": 2}
    for process in (paused, other):
        assert process.stop(10) == 0


def test_poison_job_ends_dead_after_max_attempts(db: JobDatabase, workers: Workers) -> None:
    job_id = db.enqueue("poison")
    worker = workers.start()
    wait_until(lambda: db.status(job_id) == "dead", timeout=15, message="the job is dead")
    job = db.job(job_id)
    assert (job.attempts, job.max_attempts) == (3, 3)
    assert job.last_error is not None
    assert "RuntimeError: poisoned on attempt 3" in job.last_error
    assert [e.attempt for e in db.effects(job_id, "start")] == [1, 2, 3]
    assert "action=job_dead" in worker.log_text()
    assert worker.stop(10) == 0


def test_job_that_kills_its_worker_ends_dead(db: JobDatabase, workers: Workers) -> None:
    job_id = db.enqueue("crasher")  # lock mode, max_attempts=2
    for attempt in (1, 2):
        worker = workers.start()
        assert worker.wait(15) == -signal.SIGKILL
        assert db.started(job_id, attempt)
    # The next claim finds the last attempt's lease expired: dead, not run again.
    worker = workers.start()
    wait_until(lambda: db.status(job_id) == "dead", timeout=15, message="the job is dead")
    job = db.job(job_id)
    assert job.attempts == 2
    assert job.last_error is not None
    assert "attempt 2 lost its lease" in job.last_error
    assert len(db.effects(job_id, "start")) == 2
    assert db.effects(job_id, "effect") == []  # both transactions died with their worker
    assert worker.alive()
    assert worker.stop(10) == 0


def test_notify_wakes_an_idle_worker_before_its_poll(db: JobDatabase, workers: Workers) -> None:
    poll_interval = 10.0
    worker = workers.start(poll_interval=f"{poll_interval}s")
    worker.wait_log("action=listener_connected")
    time.sleep(0.5)  # past the worker's first (empty) poll: it now waits up to 10 s
    latencies = []
    for _ in range(3):
        enqueued = time.monotonic()
        job_id = db.enqueue("sleepy")
        wait_until(lambda: db.started(job_id), timeout=poll_interval, message="woken")  # noqa: B023
        latencies.append(time.monotonic() - enqueued)
    assert max(latencies) < poll_interval / 5, latencies
    assert worker.stop(10) == 0


@pytest.mark.embedded_only
def test_workers_survive_a_database_restart(
    db: JobDatabase, workers: Workers, embedded_server: EmbeddedPostgres
) -> None:
    total = 160
    jobs = [("sleepy" if n % 2 else "sleepy_locked", {"sleep": 0.05}) for n in range(total)]
    ids = db.enqueue_many(jobs)
    locked_ids = {job_id for job_id, (task, _) in zip(ids, jobs, strict=True) if "locked" in task}
    pool = [workers.start(concurrency=4), workers.start(concurrency=4)]
    for process in pool:  # both connected before the restart (a slow start may miss it)
        process.wait_log("action=listener_connected")
    wait_until(
        lambda: db.count_by_status().get("succeeded", 0) >= 20,
        timeout=20,
        message="the drain is under way",
    )
    embedded_server.restart()
    wait_until(lambda: db.all_succeeded(total), timeout=60, message="every job succeeds")
    for process in pool:
        assert process.alive()
        assert "action=database_error" in process.log_text() or "listener_error" in (
            process.log_text()
        )
    effects = Counter(e.job_id for e in db.effects(kind="effect"))
    # Lock mode: exactly once, whatever the restart interrupted.
    assert all(effects[job_id] == 1 for job_id in locked_ids)
    # Lease mode: at least once.
    assert all(effects[job_id] >= 1 for job_id in ids)
    for process in pool:
        process.send(signal.SIGTERM)
    for process in pool:
        assert process.wait(15) == 0


_PLAIN_RUN = """
import logging, sys
import sqlalchemy as sa
from worker_tasks import registry
from sqla_jobs import Worker

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
engine = sa.create_engine(sys.argv[1])
# What an application's own entry point does: no handle_signals, no command line.
sys.exit(Worker(registry, engine, queues=["work"], poll_interval=0.2, grace=0.5).run())
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_plain_run_stops_gracefully_on_a_signal_mid_job(
    db: JobDatabase, workers: Workers, tmp_path: Path, signum: int
) -> None:
    script = tmp_path / "plain_run.py"
    script.write_text(_PLAIN_RUN)
    log = tmp_path / "plain_run.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen(
            [sys.executable, str(script), db.url],
            cwd=tmp_path,
            env=subprocess_env(db.url),
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    worker = WorkerProcess(popen, log)
    workers.started.append(worker)  # killed at the end if it is still there
    job_id = db.enqueue("sleepy", {"sleep": 60})
    wait_until(lambda: db.started(job_id), timeout=15, message="the job started")
    worker.send(signum)
    assert worker.wait(15) == 0
    # The shutdown's rules, not a lease expiry: past the grace, given back at once.
    job = db.job(job_id)
    assert (job.status, job.attempts, job.max_attempts) == ("pending", 1, 21)
    assert job.lease_expires_at is None
    assert job.leased_by is None
    assert "stopping: no more claims" in worker.log_text()
