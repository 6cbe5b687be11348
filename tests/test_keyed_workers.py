"""Ordering keys and key limits with real worker processes: several workers, one key's jobs
never more at once than its limit, in order, and a key freed by a killed worker's lease.

Handlers commit a ``start`` and an ``end`` row with the database's clock; overlap is
measured from those rows (a job's handler interval lies inside the time its job was
running, so the measured overlap can only understate, never overstate, what the claim let
run at once... and the claim is what the key limit bounds).
"""

from __future__ import annotations

import signal

import pytest
from worker_harness import JobDatabase, Workers, intervals, most_at_once, wait_until

from sqla_jobs.registry import Registry

pytestmark = pytest.mark.slow
TARGET = "keyed_tasks:registry"


def enqueue(db: JobDatabase, task: str, key: str, **args: object) -> int:
    import keyed_tasks
    from sqlalchemy.orm import Session

    registry: Registry = keyed_tasks.registry
    with Session(db.engine) as session, session.begin():
        job = registry[task].job(dict(args), ordering_key=key)
        session.add(job)
        session.flush()
        return job.id


def test_four_workers_of_eight_never_run_more_than_three_of_a_key(
    worker_db: JobDatabase, worker_processes: Workers
) -> None:
    keys = [f"customer:{i}" for i in range(3)]
    # Every worker is up before the jobs come (a worker started first on a loaded machine
    # could take them all before the others claim: the test is of several workers).
    started = [worker_processes.start(target=TARGET, concurrency=8) for _ in range(4)]
    for process in started:
        process.wait_log("action=worker_started", timeout=60)
    total = 0
    for n in range(24):
        for key in keys:
            enqueue(worker_db, "three_at_a_time", key, sleep=0.05 + 0.05 * (n % 3))
            total += 1
    wait_until(lambda: worker_db.all_succeeded(total), timeout=120, message="every job succeeds")
    for process in started:
        assert process.stop(30) == 0
    spans = intervals(worker_db)
    assert sorted(spans) == keys
    peaks = {key: most_at_once(spans[key]) for key in keys}
    assert all(peak <= 3 for peak in peaks.values()), peaks
    assert max(peaks.values()) >= 2, peaks  # the jobs of a key did run side by side
    assert len({e.pid for e in worker_db.effects(kind="start")}) >= 2  # and on several workers


@pytest.mark.parametrize("task", ["in_order", "in_order_locked"])
def test_same_key_jobs_run_one_at_a_time_in_order_across_workers(
    worker_db: JobDatabase, worker_processes: Workers, task: str
) -> None:
    keys = ["a", "b", "c"]
    # Every worker runs before the jobs exist, so that more than one takes part (a worker
    # that started first on a busy machine could otherwise drain them all alone).
    for worker in [worker_processes.start(target=TARGET, concurrency=4) for _ in range(3)]:
        worker.wait_log("action=worker_started", timeout=60)
    enqueued: dict[str, list[int]] = {key: [] for key in keys}
    for n in range(12):
        for key in keys:
            enqueued[key].append(enqueue(worker_db, task, key, sleep=0.02 * (n % 3)))
    total = 12 * len(keys)
    wait_until(lambda: worker_db.all_succeeded(total), timeout=120, message="every job succeeds")
    spans = intervals(worker_db)
    for key in keys:
        assert [job_id for _, _, job_id in spans[key]] == enqueued[key]  # in order
        for (_, end, _), (start, _, _) in zip(spans[key], spans[key][1:], strict=False):
            assert end <= start  # one at a time
    assert len({e.pid for e in worker_db.effects(kind="start")}) >= 2


@pytest.mark.parametrize("task", ["in_order", "in_order_locked"])
def test_a_key_held_by_a_killed_worker_is_free_again_after_its_lease(
    worker_db: JobDatabase, worker_processes: Workers, task: str
) -> None:
    first = enqueue(worker_db, task, "k", sleep=60, sleep_attempts=[1])
    second = enqueue(worker_db, task, "k")
    other = enqueue(worker_db, task, "other")
    holder = worker_processes.start(target=TARGET, concurrency=4)
    wait_until(lambda: worker_db.started(first), timeout=15, message="the first job started")
    wait_until(lambda: worker_db.all_succeeded(1), timeout=15, message="the other key's job ran")
    assert not worker_db.started(second)  # its key is held
    holder.send(signal.SIGKILL)
    assert holder.wait(5) == -signal.SIGKILL

    worker_processes.start(target=TARGET, concurrency=4)
    wait_until(lambda: worker_db.all_succeeded(3), timeout=30, message="all three succeed")
    assert (worker_db.job(first).attempts, worker_db.job(second).attempts) == (2, 1)
    ((_, first_end, _), (second_start, _, second_id)) = intervals(worker_db)["k"]
    assert second_id == second
    assert first_end <= second_start
    assert worker_db.status(other) == "succeeded"
