"""An enqueuing process for the debounce concurrency test (imported by spawned children)."""

from __future__ import annotations

import random
from typing import Any

import sqlalchemy as sa
from models import EmailJob
from sqlalchemy.orm import Session

import sqla_jobs

KEYS = 20
#: Keys only ever enqueued in transactions that roll back: they must end with no job.
DOOMED = range(17, 20)
#: Long enough that nothing comes due while the processes enqueue (no worker runs then).
WINDOW = 3600


def enqueue_randomly(
    url: str, seed: int, burst: int, transactions: int, connect_args: dict[str, Any] | None = None
) -> list[tuple[str, int, dict[str, int]]]:
    """Run ``transactions`` transactions that each enqueue one debounced job under a random
    key, with arguments naming this process, the burst and the transaction, and roll back
    about 30% of them at random; return, for each committed one, its key, the job id it was
    told and its arguments."""
    rng = random.Random(seed * 1000 + burst)
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args=connect_args or {})
    committed: list[tuple[str, int, dict[str, int]]] = []
    try:
        with Session(engine) as session:
            for n in range(transactions):
                roll_back = rng.random() < 0.3
                pool = range(KEYS) if roll_back else range(DOOMED.start)
                key = f"key-{rng.choice(pool)}"
                args = {"seed": seed, "burst": burst, "n": n}
                with session.begin() as transaction:
                    job = EmailJob(task="debounced", args=args)
                    told = sqla_jobs.enqueue_debounced(session, job, key=key, window=WINDOW)
                    if roll_back:
                        transaction.rollback()
                if not roll_back:
                    committed.append((key, told.id, args))
    finally:
        engine.dispose()
    return committed
