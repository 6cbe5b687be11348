"""Eight processes claim the same 10k jobs: each job is claimed exactly once, nobody waits."""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor

import sqlalchemy as sa
from claimer import claim_until_empty
from models import EmailJob

JOBS = 10_000
PROCESSES = 8


def test_eight_processes_claim_each_job_exactly_once(queue_engine: sa.Engine) -> None:
    with queue_engine.begin() as connection:
        connection.execute(
            sa.insert(EmailJob),
            [{"task": "t", "args": {"i": i}} for i in range(JOBS)],
        )

    # Watch for anyone waiting on a lock while the claimers run.
    waiting: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        with queue_engine.connect() as connection:
            while not stop.is_set():
                waiting.append(
                    int(
                        connection.execute(
                            sa.text(
                                # Claim statements waiting on a lock: a row, a tuple,
                                # a transaction, a table. Not 'extend', the moment a
                                # backend waits for another to add a page to the growing
                                # table, which every writer may do. (A completion may wait
                                # a moment: a claimer that read a row just before another
                                # worker claimed it locks it, rechecks and skips it, and
                                # keeps that row lock until its claim commits.)
                                "SELECT count(*) FROM pg_stat_activity "
                                "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                                "AND wait_event <> 'extend' AND query LIKE 'WITH claimable%'"
                            )
                        ).scalar_one()
                    )
                )
                connection.rollback()
                stop.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    url = queue_engine.url.render_as_string(hide_password=False)
    try:
        with ProcessPoolExecutor(
            PROCESSES, mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            futures = [
                pool.submit(claim_until_empty, url, batch)
                for batch in (1, 5, 10, 10, 25, 50, 50, 100)
            ]
            results = [future.result(timeout=240) for future in futures]
    finally:
        stop.set()
        watcher.join()

    claimed = [pair for pairs in results for pair in pairs]
    ids = [job_id for job_id, _ in claimed]
    assert len(ids) == JOBS
    assert len(set(ids)) == JOBS
    assert {attempt for _, attempt in claimed} == {1}
    assert sum(1 for pairs in results if pairs) >= 2  # the work was actually shared
    assert waiting
    assert max(waiting) == 0
    with queue_engine.connect() as connection:
        rows = connection.execute(
            sa.text("SELECT status, attempts, count(*) FROM email_jobs GROUP BY 1, 2")
        ).all()
    assert [tuple(r) for r in rows] == [("succeeded", 1, JOBS)]
