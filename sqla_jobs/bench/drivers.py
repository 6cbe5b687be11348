"""The ``async`` section: :mod:`sqla_jobs.aio` on psycopg 3's async connection and on
asyncpg, measured beside the same operations on the sync path.

The same operations on four paths, each figure in the same run on the same table:

``connection``  sync, a Core ``Connection`` of psycopg: the queue's fast path (the compiled
                SQL straight on the driver connection), as the worker runs claim and
                complete. Claim cycles only: enqueueing takes a ``Session``.
``session``     sync, an ORM ``Session`` on psycopg: every statement through ``execute``.
``psycopg``     an ``AsyncSession`` on psycopg's async connection (``postgresql+psycopg``),
                through :mod:`sqla_jobs.aio` (``run_sync``).
``asyncpg``     an ``AsyncSession`` on asyncpg (``postgresql+asyncpg``), through
                :mod:`sqla_jobs.aio`.

The operations: ``add_all`` (ORM ``add_all`` of N jobs, a flush per 1000, one commit),
``enqueue_many`` (N jobs, one transaction) and claim + complete cycles (``cycle.single``:
claim 1 then complete it, ``cycle.batched``: claim B then ``complete_many``, each in a
transaction of its own, as a lease-mode worker does). Each figure's ratio is to the path
before it: ``session`` to ``connection``, ``psycopg`` to ``session``, ``asyncpg`` to
``psycopg``.

Needs greenlet and asyncpg (``pip install "sqla-jobs[asyncpg]"``); the runner skips the
section without them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from typing import Any, Final, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqla_jobs import aio
from sqla_jobs.models import Job
from sqla_jobs.queue import ClaimedJob, claim, complete_many, enqueue_many
from sqla_jobs.urls import asyncpg_url, psycopg_url

__all__ = ["ASYNC_DRIVERS", "PATHS", "Paths", "Rate", "rotated"]

ASYNC_DRIVERS: Final = ("psycopg", "asyncpg")
#: Every path, in the order each is compared with the one before it.
PATHS: Final = ("connection", "session", *ASYNC_DRIVERS)
_FLUSH_EVERY: Final = 1000
_T = TypeVar("_T")


def _jobs(queue: str, first: int, last: int) -> Iterator[dict[str, Any]]:
    return ({"task": "bench_noop", "queue": queue, "args": {"n": n}} for n in range(first, last))


class Rate(NamedTuple):
    """One measurement: jobs per second of wall time, and microseconds of this process's
    CPU per job (the client's cost, which neither the server nor the disk adds to)."""

    per_second: float
    cpu_us_per_job: float


class _Clock:
    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def rate(self, jobs: int) -> Rate:
        wall = time.perf_counter() - self.wall
        cpu = time.process_time() - self.cpu
        return Rate(jobs / wall, cpu * 1e6 / jobs)


class Paths:
    """A sync engine and an async engine per async driver, on one event loop, open for the
    section: each measurement runs on connections that are already open and warm."""

    def __init__(self, url: str, *, lease: float) -> None:
        self.lease = lease
        self.loop = asyncio.new_event_loop()
        self.sync = sa.create_engine(psycopg_url(url), pool_size=2)
        self.engines: dict[str, AsyncEngine] = {
            "psycopg": create_async_engine(psycopg_url(url), pool_size=2),
            "asyncpg": create_async_engine(asyncpg_url(url), pool_size=2),
        }

    def close(self) -> None:
        try:
            for engine in self.engines.values():
                self.loop.run_until_complete(engine.dispose())
        finally:
            self.loop.close()
            self.sync.dispose()

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return self.loop.run_until_complete(coroutine)

    # -- enqueue -------------------------------------------------------------------------

    def add_all(self, path: str, queue: str, count: int) -> Rate:
        """ORM ``add_all`` of ``count`` jobs, a flush per 1000, one transaction."""
        clock = _Clock()
        if path == "session":
            with Session(self.sync) as session, session.begin():
                for first in range(0, count, _FLUSH_EVERY):
                    last = min(first + _FLUSH_EVERY, count)
                    session.add_all([Job(**job) for job in _jobs(queue, first, last)])
                    session.flush()
        else:
            self._run(self._add_all(self.engines[path], queue, count))
        return clock.rate(count)

    async def _add_all(self, engine: AsyncEngine, queue: str, count: int) -> None:
        async with AsyncSession(engine) as session, session.begin():
            for first in range(0, count, _FLUSH_EVERY):
                last = min(first + _FLUSH_EVERY, count)
                session.add_all([Job(**job) for job in _jobs(queue, first, last)])
                await session.flush()

    def enqueue_many(self, path: str, queue: str, count: int, chunk: int) -> Rate:
        """:func:`~sqla_jobs.enqueue_many` of ``count`` jobs in one transaction."""
        clock = _Clock()
        if path == "session":
            with Session(self.sync) as session, session.begin():
                enqueue_many(session, Job, _jobs(queue, 0, count), chunk_size=chunk)
        else:
            self._run(self._enqueue_many(self.engines[path], queue, count, chunk))
        return clock.rate(count)

    async def _enqueue_many(self, engine: AsyncEngine, queue: str, count: int, chunk: int) -> None:
        async with AsyncSession(engine) as session, session.begin():
            await aio.enqueue_many(session, Job, _jobs(queue, 0, count), chunk_size=chunk)

    # -- claim + complete ----------------------------------------------------------------

    def cycles(self, path: str, queue: str, batch: int, count: int) -> Rate:
        """Claim ``batch`` and complete them, each in its own transaction, until the queue
        (holding ``count`` jobs) is empty."""
        clock = _Clock()
        if path == "connection":
            done = self._connection_cycles(queue, batch)
        elif path == "session":
            done = self._session_cycles(queue, batch)
        else:
            done = self._run(self._async_cycles(self.engines[path], queue, batch))
        if done != count:
            raise RuntimeError(f"{path}: claimed and completed {done} of {count} jobs")
        return clock.rate(count)

    def _claim(self, executor: Session | sa.Connection, queue: str, batch: int) -> list[ClaimedJob]:
        return claim(executor, Job, queues=queue, limit=batch, lease=self.lease)

    def _connection_cycles(self, queue: str, batch: int) -> int:
        done = 0
        with self.sync.connect() as connection:
            while True:
                with connection.begin():
                    jobs = self._claim(connection, queue, batch)
                if not jobs:
                    return done
                with connection.begin():
                    done += len(jobs) - len(complete_many(connection, jobs))

    def _session_cycles(self, queue: str, batch: int) -> int:
        done = 0
        while True:
            with Session(self.sync) as session, session.begin():
                jobs = self._claim(session, queue, batch)
            if not jobs:
                return done
            with Session(self.sync) as session, session.begin():
                done += len(jobs) - len(complete_many(session, jobs))

    async def _async_cycles(self, engine: AsyncEngine, queue: str, batch: int) -> int:
        done = 0
        while True:
            async with AsyncSession(engine) as session, session.begin():
                jobs = await aio.claim(session, Job, queues=queue, limit=batch, lease=self.lease)
            if not jobs:
                return done
            async with AsyncSession(engine) as session, session.begin():
                done += len(jobs) - len(await aio.complete_many(session, jobs))


def rotated(paths: tuple[str, ...], rotation: int) -> tuple[str, ...]:
    """``paths``, starting at a different one each ``rotation``: measured in this order, no
    path always gets the warmer (or the busier) moment."""
    start = rotation % len(paths)
    return paths[start:] + paths[:start]
