"""An enqueuing process for the unique-jobs concurrency test (imported by spawned children)."""

from __future__ import annotations

import random
from typing import Any

import sqlalchemy as sa
from models import EmailJob
from sqlalchemy.orm import Session

import sqla_jobs

KEYS = 50
#: Keys only ever enqueued in transactions that roll back: they must end with no job.
DOOMED = range(45, 50)


def enqueue_randomly(
    url: str, seed: int, transactions: int, connect_args: dict[str, Any] | None = None
) -> list[dict[str, int]]:
    """Run ``transactions`` transactions that each enqueue 1 to 5 unique keys (one key with
    ``enqueue_unique``, several with ``enqueue_unique_many``, duplicates included) and roll
    back about 30% of them at random; return, for each committed transaction, the job id
    it was told for each key."""
    rng = random.Random(seed)
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args=connect_args or {})
    committed: list[dict[str, int]] = []
    try:
        with Session(engine) as session:
            for _ in range(transactions):
                roll_back = rng.random() < 0.3
                pool = range(KEYS) if roll_back else range(DOOMED.start)
                keys = [f"key-{rng.choice(pool)}" for _ in range(rng.randint(1, 5))]
                told: dict[str, int] = {}
                with session.begin() as transaction:
                    if len(keys) == 1:
                        job = EmailJob(task="unique", args={"seed": seed})
                        result = sqla_jobs.enqueue_unique(session, job, key=keys[0])
                        told[keys[0]] = result.id
                    else:
                        rows = [{"task": "unique", "unique_key": key} for key in keys]
                        results = sqla_jobs.enqueue_unique_many(session, EmailJob, rows)
                        for key, result in zip(keys, results, strict=True):
                            assert told.setdefault(key, result.id) == result.id
                    if roll_back:
                        transaction.rollback()
                if not roll_back:
                    committed.append(told)
    finally:
        engine.dispose()
    return committed
