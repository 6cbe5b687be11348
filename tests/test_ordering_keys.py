"""Ordering keys and per-key limits in the claim: order, one at a time, retries keep their
place, a future job blocks nobody, crashed attempts free their key, and the plain claim
never takes a keyed job."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa
from models import EmailJob
from sqlalchemy.orm import Session

import sqla_jobs
from sqla_jobs import ClaimedJob
from sqla_jobs.errors import InvalidJobError


def enqueue(engine: sa.Engine, *jobs: EmailJob) -> list[int]:
    with Session(engine) as session, session.begin():
        session.add_all(jobs)
        session.flush()
        return [job.id for job in jobs]


def claim(engine: sa.Engine, *, limit: int = 10, keys: bool = True, **options: Any) -> list[ClaimedJob]:
    with engine.begin() as connection:
        return sqla_jobs.claim(connection, EmailJob, limit=limit, keys=keys, **options)


def finish(engine: sa.Engine, *jobs: ClaimedJob) -> None:
    with engine.begin() as connection:
        assert sqla_jobs.complete_many(connection, list(jobs)) == []


def test_same_key_jobs_run_one_at_a_time_in_order(queue_engine: sa.Engine) -> None:
    ids = enqueue(
        queue_engine,
        EmailJob(task="a1", ordering_key="customer:1"),
        EmailJob(task="b1", ordering_key="customer:2"),
        EmailJob(task="a2", ordering_key="customer:1", priority=-5),
        EmailJob(task="a3", ordering_key="customer:1"),
        EmailJob(task="plain"),
    )
    first = claim(queue_engine)
    # One per key (the best of each: a2 has the higher priority), and the plain job.
    assert sorted(job.task for job in first) == ["a2", "b1", "plain"]
    assert claim(queue_engine) == []  # both keys busy
    finish(queue_engine, *first)
    assert [job.task for job in claim(queue_engine)] == ["a1"]
    assert len(ids) == 5
