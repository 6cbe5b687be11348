"""The fetch loop's prefetch: jobs claimed beyond the free slots, waiting for a handler."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
import worker_tasks
from worker_harness import JobDatabase, running, wait_until

from sqla_jobs import ConfigurationError
from sqla_jobs.models import Job
from sqla_jobs.queue import ClaimedJob
from sqla_jobs.worker import Worker
from sqla_jobs.worker.fetcher import default_prefetch
from sqla_jobs.worker.heartbeat import Heartbeat
from sqla_jobs.worker.state import UNWRITTEN_MAX, Attempt, Kind, Outcome, State


@pytest.fixture
def db(worker_tasks_db: JobDatabase) -> JobDatabase:
    return worker_tasks_db


def _running_count(db: JobDatabase) -> int:
    return db.count_by_status().get("running", 0)


def _let_handlers_finish(db: JobDatabase) -> None:
    # Handlers still sleeping when the worker stopped write their effect rows later: let
    # them, so that they do not write into the next test's database.
    wait_until(
        lambda: len(db.effects(kind="effect")) == len(db.effects(kind="start")),
        timeout=20,
        message="the handlers left running finished",
    )


def test_a_worker_holds_at_most_concurrency_plus_prefetch(db: JobDatabase) -> None:
    db.enqueue_many([("sleepy", {"sleep": 3})] * 20)
    with running(db, concurrency=2, prefetch=3, grace=0.1) as worker:
        wait_until(lambda: _running_count(db) == 5, timeout=10, message="5 jobs leased")
        wait_until(
            lambda: len(db.effects(kind="start")) == 2, timeout=10, message="2 handlers started"
        )
        # The two slots are busy and the prefetch is full: no more claims until one settles.
        assert db.count_by_status() == {"running": 5, "pending": 15}
        health = worker.health()
        assert health.in_flight == 5
        assert health.healthy, health.problems
    _let_handlers_finish(db)


def test_prefetched_jobs_are_given_back_at_shutdown_and_not_charged(db: JobDatabase) -> None:
    first = db.enqueue("sleepy", {"sleep": 3}, priority=-1)
    waiting = db.enqueue_many([("sleepy", {"sleep": 3})] * 2)
    with running(db, concurrency=1, prefetch=2, grace=0.1) as worker:
        wait_until(lambda: db.started(first), timeout=10, message="the first job started")
        wait_until(lambda: worker.health().in_flight == 3, timeout=10, message="3 held")
    for job_id in waiting:
        job = db.job(job_id)
        # Released like any attempt not run to the end: pending, the attempt not charged
        # (its max_attempts grew by one, as for a running job given back).
        assert (job.status, job.attempts, job.max_attempts) == ("pending", 1, 21)
        assert not db.effects(job_id)  # never started
    _let_handlers_finish(db)


def test_a_prefetched_job_whose_lease_ran_out_is_given_back_not_started(
    db: JobDatabase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # No heartbeat: the leases (1 s) are not extended, so the prefetched job's lease runs
    # out while it waits behind a job of 2 s on the one slot.
    monkeypatch.setattr(Heartbeat, "beat", lambda self: None)
    caplog.set_level(logging.INFO, logger="sqla_jobs.worker")
    db.enqueue("sleepy", {"sleep": 2}, priority=-1)
    behind = db.enqueue("sleepy")
    with running(db, concurrency=1, prefetch=1):
        wait_until(
            lambda: db.status(behind) == "succeeded", timeout=20, message="it ran afterwards"
        )
    assert not db.started(behind, attempt=1)  # given back unstarted
    # It ran on a later attempt (the release, or a claim that found its lease expired).
    starts = [effect.attempt for effect in db.effects(behind, "start")]
    assert starts
    assert min(starts) > 1
    # Given back (or, when a claim took the expired job over first, fenced out), with why.
    assert any("lease may have run out" in record.getMessage() for record in caplog.records)


def test_concurrency_one_runs_jobs_one_at_a_time_with_a_prefetch(db: JobDatabase) -> None:
    ids = db.enqueue_many([("sleepy", {"sleep": 0.02})] * 6)
    with running(db, concurrency=1, prefetch=5):
        wait_until(lambda: db.all_succeeded(6), timeout=20, message="all succeed")
    # Each handler commits a start row, then an effect row: one at a time, they alternate.
    kinds = [effect.kind for effect in db.effects()]
    assert kinds == ["start", "effect"] * 6
    assert sorted({effect.job_id for effect in db.effects()}) == sorted(ids)


def test_the_default_prefetch_is_bounded_by_a_batch(db: JobDatabase) -> None:
    db.enqueue_many([("sleepy", {"sleep": 3})] * 12)
    with running(db, concurrency=2, batch_size=4, grace=0.1) as worker:
        wait_until(lambda: _running_count(db) >= 2, timeout=10, message="jobs leased")
        fetcher = worker._fetcher
        assert fetcher is not None
        # Slow handlers settle nothing: the prefetch follows their rate, so stays at 0.
        assert fetcher.prefetch() == 0
        assert db.count_by_status() == {"running": 2, "pending": 10}
    _let_handlers_finish(db)


def test_the_default_prefetch_holds_what_the_handlers_settle_in_50_ms() -> None:
    # Quick jobs: a batch, whatever the concurrency (20,000 jobs/s settle 1,000 in 50 ms).
    assert default_prefetch(20_000, 0.003, 500) == 500
    assert default_prefetch(2_000, 0.003, 500) == 100
    # Slow ones are not hoarded: 10 jobs/s settle none in 50 ms.
    assert default_prefetch(10, 0.005, 500) == 0
    assert default_prefetch(0, 0.005, 500) == 0
    # A slow claim: two of its round trips' worth (80 jobs/s x 2 x 0.5 s).
    assert default_prefetch(80, 0.5, 500) == 80


def test_room_counts_the_prefetch() -> None:
    state = State(concurrency=2)
    assert state.wait_for_room(5, 1, 0.0, 0.0) == 5
    assert state.wait_for_room(2, 1, 0.0, 0.0) == 2


@pytest.mark.parametrize("prefetch", [-1, 10_001, 1.5, True, "2"])
def test_bad_prefetch_is_refused(prefetch: object) -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    try:
        with pytest.raises(ConfigurationError, match="prefetch"):
            Worker(worker_tasks.registry, engine, prefetch=prefetch)  # type: ignore[arg-type]
    finally:
        engine.dispose()


def test_the_fetch_loop_waits_while_the_outcome_writer_is_behind() -> None:
    # Settled outcomes that wait for the writer count against the claims: a writer that
    # falls behind slows the claims down to its pace instead of letting attempts pile up.
    state = State(concurrency=10)
    now = datetime.now(timezone.utc)
    attempts = [
        Attempt(ClaimedJob(Job, n, "q", "t", {}, 0, 1, 3, now, now), None, 0.0, 1e9)
        for n in range(UNWRITTEN_MAX)
    ]
    assert state.admit(attempts)
    done = Outcome(Kind.COMPLETE)
    for attempt in attempts:
        assert state.settle(attempt, done)
    assert state.wait_for_room(10, 1, 0.0, 0.01) == 0  # every slot free, the writer behind
    taken = state.take_outcomes(len(attempts), 0.0, 0.0)
    assert state.wait_for_room(10, 1, 0.0, 0.01) == 0  # taken is not written yet
    state.written(taken[:1])
    assert state.wait_for_room(10, 1, 0.0, 0.01) == 10
