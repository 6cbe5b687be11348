"""Ordering keys and key limits with real worker processes: several workers, one key's jobs
never more at once than its limit, in order, and a key freed by a killed worker's lease.

Handlers commit a ``start`` and an ``end`` row with the database's clock; overlap is
measured from those rows (a job's handler interval lies inside the time its job was
running, so the measured overlap can only understate, never overstate, what the claim let
run at once... and the claim is what the key limit bounds).
"""

from __future__ import annotations

import signal
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from conftest import FreshDatabase
from worker_harness import JobDatabase, Workers, wait_until

from sqla_jobs.registry import Registry

pytestmark = pytest.mark.slow
TARGET = "keyed_tasks:registry"


@pytest.fixture
def db(fresh_database: FreshDatabase) -> Iterator[JobDatabase]:
    database = JobDatabase(fresh_database("sqla_jobs_keys"))
    try:
        yield database
    finally:
        database.dispose()


@pytest.fixture
def workers(db: JobDatabase, tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(db.url, tmp_path)
    try:
        yield pool
    finally:
        pool.close()


def enqueue(db: JobDatabase, task: str, key: str, **args: object) -> int:
    import keyed_tasks
    from sqlalchemy.orm import Session

    registry: Registry = keyed_tasks.registry
    with Session(db.engine) as session, session.begin():
        job = registry[task].job(dict(args), ordering_key=key)
        session.add(job)
        session.flush()
        return job.id


def intervals(db: JobDatabase) -> dict[str, list[tuple[datetime, datetime, int]]]:
    """Per key: (start, end, job id) of every attempt that ended, by start."""
    keys = {job.id: job.ordering_key for job in db.jobs()}
    starts: dict[tuple[int, int], datetime] = {}
    found: dict[str, list[tuple[datetime, datetime, int]]] = defaultdict(list)
    for effect in db.effects():
        if effect.kind == "start":
            starts[(effect.job_id, effect.attempt)] = effect.at
        elif effect.kind == "end":
            start = starts[(effect.job_id, effect.attempt)]
            found[keys[effect.job_id] or ""].append((start, effect.at, effect.job_id))
    return {key: sorted(spans) for key, spans in found.items()}


def most_at_once(spans: list[tuple[datetime, datetime, int]]) -> int:
    events = sorted([(s, 1) for s, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    running = peak = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start (+1)
        running += step
        peak = max(peak, running)
    return peak


def test_four_workers_of_eight_never_run_more_than_three_of_a_key(
    db: JobDatabase, workers: Workers
) -> None:
    keys = [f"customer:{i}" for i in range(3)]
    total = 0
    for n in range(24):
        for key in keys:
            enqueue(db, "three_at_a_time", key, sleep=0.05 + 0.05 * (n % 3))
            total += 1
    started = [workers.start(target=TARGET, concurrency=8) for _ in range(4)]
    wait_until(lambda: db.all_succeeded(total), timeout=120, message="every job succeeds")
    for process in started:
        process.send(signal.SIGTERM)
        assert process.wait(30) == 0
    spans = intervals(db)
    assert sorted(spans) == keys
    peaks = {key: most_at_once(spans[key]) for key in keys}
    assert all(peak <= 3 for peak in peaks.values()), peaks
    assert max(peaks.values()) >= 2, peaks  # the jobs of a key did run side by side
    assert len({e.pid for e in db.effects(kind="start")}) >= 2  # and on several workers


@pytest.mark.parametrize("task", ["in_order", "in_order_locked"])
def test_same_key_jobs_run_one_at_a_time_in_order_across_workers(
    db: JobDatabase, workers: Workers, task: str
) -> None:
    keys = ["a", "b", "c"]
    # Every worker runs before the jobs exist, so that more than one takes part (a worker
    # that started first on a busy machine could otherwise drain them all alone).
    for worker in [workers.start(target=TARGET, concurrency=4) for _ in range(3)]:
        worker.wait_log("action=worker_started", timeout=60)
    enqueued: dict[str, list[int]] = {key: [] for key in keys}
    for n in range(12):
        for key in keys:
            enqueued[key].append(enqueue(db, task, key, sleep=0.02 * (n % 3)))
    total = 12 * len(keys)
    wait_until(lambda: db.all_succeeded(total), timeout=120, message="every job succeeds")
    spans = intervals(db)
    for key in keys:
        assert [job_id for _, _, job_id in spans[key]] == enqueued[key]  # in order
        for (_, end, _), (start, _, _) in zip(spans[key], spans[key][1:], strict=False):
            assert end <= start  # one at a time
    assert len({e.pid for e in db.effects(kind="start")}) >= 2


@pytest.mark.parametrize("task", ["in_order", "in_order_locked"])
def test_a_key_held_by_a_killed_worker_is_free_again_after_its_lease(
    db: JobDatabase, workers: Workers, task: str
) -> None:
    first = enqueue(db, task, "k", sleep=60, sleep_attempts=[1])
    second = enqueue(db, task, "k")
    other = enqueue(db, task, "other")
    holder = workers.start(target=TARGET, concurrency=4)
    wait_until(lambda: db.started(first), timeout=15, message="the first job started")
    wait_until(lambda: db.all_succeeded(1), timeout=15, message="the other key's job ran")
    assert not db.started(second)  # its key is held
    holder.send(signal.SIGKILL)
    assert holder.wait(5) == -signal.SIGKILL

    workers.start(target=TARGET, concurrency=4)
    wait_until(lambda: db.all_succeeded(3), timeout=30, message="all three succeed")
    assert (db.job(first).attempts, db.job(second).attempts) == (2, 1)
    ((_, first_end, _), (second_start, _, second_id)) = intervals(db)["k"]
    assert second_id == second
    assert first_end <= second_start
    assert db.status(other) == "succeeded"
