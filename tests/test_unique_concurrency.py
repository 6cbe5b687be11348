"""Eight processes enqueue the same 50 unique keys, rolling back about 30% of their
transactions at random: afterwards exactly one job per key that some committed transaction
enqueued, and none for the keys that only rolled-back transactions enqueued.

Each process runs 300 transactions of 1 to 5 keys each (about 900 enqueues per
process, 7,200 in all), one call per transaction: ``enqueue_unique`` for one key,
``enqueue_unique_many`` for several (with duplicates within the batch). Keys 45-49 are only
ever drawn by transactions that are going to roll back. The jobs stay pending, so every
key's holder is live for the whole run and every enqueue after the first is a duplicate
that must be skipped without error, including those that wait on an uncommitted holder
that then rolls back (the waiter must insert then, not lose the job).
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import sqlalchemy as sa
from conftest import pooled_connect_args
from models import EmailJob
from unique_enqueuer import DOOMED, KEYS, enqueue_randomly

PROCESSES = 8
TRANSACTIONS = 300


@pytest.mark.slow
def test_eight_processes_enqueue_each_key_once_through_random_rollbacks(
    queue_engine: sa.Engine,
) -> None:
    url = queue_engine.url.render_as_string(hide_password=False)
    with ProcessPoolExecutor(PROCESSES, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            pool.submit(enqueue_randomly, url, seed, TRANSACTIONS, pooled_connect_args())
            for seed in range(PROCESSES)
        ]
        committed = [told for future in futures for told in future.result(timeout=600)]

    with queue_engine.connect() as connection:
        rows = connection.execute(
            sa.select(EmailJob.unique_key, EmailJob.id).order_by(EmailJob.id)
        ).all()
    jobs: dict[str | None, int] = {row[0]: row[1] for row in rows}
    assert len(jobs) == len(rows)  # exactly one job per key
    committed_keys = {key for told in committed for key in told}
    assert set(jobs) == committed_keys  # none lost, none from a rolled-back transaction
    assert not committed_keys & {f"key-{k}" for k in DOOMED}
    assert len(committed_keys) == KEYS - len(DOOMED)
    # Every committed enqueue was told the id of the job that holds its key.
    assert all(jobs[key] == job_id for told in committed for key, job_id in told.items())
    # About 30% rolled back (each process: TRANSACTIONS transactions).
    assert 0.6 * PROCESSES * TRANSACTIONS < len(committed) < 0.8 * PROCESSES * TRANSACTIONS
