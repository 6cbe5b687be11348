"""Per-queue limits with real worker processes: 4 workers of 8 never run more than the
queue's limit at once (and do reach it), lease and lock-mode tasks alike, and the slots of a
worker killed with SIGKILL come back after their leases.

Handlers commit a ``start`` and an ``end`` row with the database's clock; overlap is
measured from those rows (a handler's interval lies inside the time its job was running, so
the measured overlap can only understate what the claims let run at once, never overstate
it: a peak of the limit shows the limit was reached, and no more).
"""

from __future__ import annotations

import signal
from collections import Counter
from typing import Any

import pytest
from limited_tasks import LIMIT
from worker_harness import JobDatabase, Workers, intervals, most_at_once, wait_until

pytestmark = pytest.mark.slow
TARGET = "limited_tasks:registry"


def enqueue(db: JobDatabase, task: str, **args: Any) -> int:
    import limited_tasks
    from sqlalchemy.orm import Session

    with Session(db.engine) as session, session.begin():
        job = limited_tasks.registry[task].job(args)
        session.add(job)
        session.flush()
        return job.id


def whole_queue(db: JobDatabase) -> list[tuple[Any, Any, int]]:
    return intervals(db, group=lambda job: job.queue).get("work", [])


def test_four_workers_of_eight_never_run_more_than_the_queue_limit(
    worker_db: JobDatabase, worker_processes: Workers
) -> None:
    total = 0
    for n in range(48):
        task = "limited_locked" if n % 4 == 3 else "limited"
        enqueue(worker_db, task, sleep=0.05 + 0.05 * (n % 3))
        total += 1
    started = [worker_processes.start(target=TARGET, concurrency=8) for _ in range(4)]
    wait_until(
        lambda: worker_db.count_by_status().get("succeeded", 0) >= total // 4,
        timeout=120,
        message="a quarter of the jobs succeed",
    )
    # A worker's own completions wake its claims at once, while the others learn of a freed
    # slot at their next poll: the worker that took the first slots may keep the queue. Stop
    # it (gracefully: its running jobs finish while the others claim) so that the rest runs
    # on the others, and the limit is held across workers whatever the timing.
    starts = Counter(e.pid for e in worker_db.effects(kind="start"))
    busiest = next(p for p in started if p.pid == starts.most_common(1)[0][0])
    assert busiest.stop(30) == 0
    wait_until(lambda: worker_db.all_succeeded(total), timeout=180, message="every job succeeds")
    for process in started:
        assert process.stop(30) == 0
    spans = whole_queue(worker_db)
    assert len(spans) == total
    assert most_at_once(spans) == LIMIT  # never more, and the limit was reached
    assert len({e.pid for e in worker_db.effects(kind="start")}) >= 2  # on several workers


@pytest.mark.parametrize("task", ["limited", "limited_locked"])
def test_the_slots_of_a_killed_worker_come_back_after_their_leases(
    worker_db: JobDatabase, worker_processes: Workers, task: str
) -> None:
    stuck = [enqueue(worker_db, task, sleep=60, sleep_attempts=[1]) for _ in range(LIMIT)]
    rest = [enqueue(worker_db, task) for _ in range(3)]
    holder = worker_processes.start(target=TARGET, concurrency=8)
    wait_until(
        lambda: all(worker_db.started(job_id) for job_id in stuck),
        timeout=30,
        message="the first jobs hold every slot of the queue",
    )
    assert not any(worker_db.started(job_id) for job_id in rest)  # the queue is full
    holder.send(signal.SIGKILL)
    assert holder.wait(5) == -signal.SIGKILL

    worker_processes.start(target=TARGET, concurrency=8)
    wait_until(
        lambda: worker_db.all_succeeded(len(stuck) + len(rest)),
        timeout=60,
        message="every job succeeds: the killed worker's slots came back",
    )
    assert [worker_db.job(job_id).attempts for job_id in stuck] == [2] * LIMIT
    assert most_at_once(whole_queue(worker_db)) <= LIMIT
