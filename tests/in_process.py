"""Helpers of the tests that enqueue through the ORM and run a :class:`Worker` in this
process (the tests of worker processes use ``worker_harness``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from sqla_jobs import Registry
from sqla_jobs.worker import Worker

#: How long a test waits for what must happen (a failing test, not a hang).
PATIENCE = 30.0


def enqueue(engine: sa.Engine, *objects: Any) -> list[int]:
    """Add ``objects`` (jobs, and anything else of the same transaction) in one committed
    transaction; their ids, in order."""
    with Session(engine) as session, session.begin():
        session.add_all(objects)
        session.flush()
        return [row.id for row in objects]


@contextmanager
def running(registry: Registry, engine: sa.Engine, **options: Any) -> Iterator[Worker]:
    """A worker of ``registry`` polling every 0.1 s (``options`` go to :class:`Worker`),
    stopped at the end with a 5 s grace."""
    with Worker(registry, engine, **{"poll_interval": 0.1, "grace": 5, **options}) as worker:
        yield worker
