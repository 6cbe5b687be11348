"""A claiming process for the concurrency test (imported by spawned children)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from models import EmailJob
from sqlalchemy.orm import Session

import sqla_jobs


def claim_until_empty(
    url: str, batch: int, connect_args: dict[str, Any] | None = None
) -> list[tuple[int, int]]:
    """Claim and complete until nothing is left; return the (id, attempt) of each claim."""
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args=connect_args or {})
    claimed: list[tuple[int, int]] = []
    empty_rounds = 0
    try:
        with Session(engine) as session:
            while empty_rounds < 3:
                with session.begin():
                    # A claim that blocked on another worker's locked rows would fail here
                    # (a claim without SKIP LOCKED would wait for as long as they are held).
                    session.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
                    jobs = sqla_jobs.claim(session, EmailJob, limit=batch, lease=300)
                if not jobs:
                    empty_rounds += 1
                    continue
                empty_rounds = 0
                with session.begin():
                    lost = sqla_jobs.complete_many(session, jobs)
                    assert lost == []
                claimed.extend((job.id, job.attempt) for job in jobs)
    finally:
        engine.dispose()
    return claimed
