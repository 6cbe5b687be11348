"""ArchiveJob rows for the history tests (tests/models.py's model with ``partitioned_history``):
enqueue one, count where its rows are, start from the DEFAULT partition only."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from models import ArchiveJob
from sqlalchemy.orm import Session

from sqla_jobs.history import list_partitions


def drop_day_partitions(engine: sa.Engine) -> None:
    """Leave the history's DEFAULT partition only (queue_engine truncates the tables but
    leaves the partitions made by earlier tests)."""
    for partition in list_partitions(engine, ArchiveJob):
        if partition.start is not None:
            with engine.begin() as connection:
                connection.execute(sa.text(f'DROP TABLE "{partition.name}"'))


def enqueue(engine: sa.Engine, **values: Any) -> int:
    with Session(engine) as session, session.begin():
        job = ArchiveJob(task=values.pop("task", "t"), **values)
        session.add(job)
        session.flush()
        return job.id


def where(engine: sa.Engine, job_id: int) -> tuple[int, int]:
    """How many rows of the job the hot table and the history hold."""
    with engine.connect() as connection:
        hot = connection.scalar(
            sa.text("SELECT count(*) FROM archive_jobs WHERE id = :i"), {"i": job_id}
        )
        old = connection.scalar(
            sa.text("SELECT count(*) FROM archive_jobs_history WHERE id = :i"), {"i": job_id}
        )
    return int(hot or 0), int(old or 0)
