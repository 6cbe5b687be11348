"""The ``enqueue`` section: ORM ``add_all`` and :func:`sqla_jobs.enqueue_many`, each beside
its ceiling, and what the NOTIFY trigger costs an enqueue.

``add_all``'s ceiling (``ceiling.orm_add_all``) is the same ``add_all`` of a bare declarative
class mapped onto the same job table (:class:`PlainJob`): the same columns, server defaults,
indexes and trigger, so the same INSERT, without the mixin's validators and flush listener.
The gap between the two is what sqla_jobs adds to SQLAlchemy's own unit of work.
"""

from __future__ import annotations

import itertools
import time
from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.ceiling import bare_insert
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import Q_ENQUEUE
from sqla_jobs.models import Job
from sqla_jobs.queue import enqueue_many

__all__ = ["PlainJob", "add_all", "run_enqueue"]

FLUSH_EVERY: Final = 1000
#: add_all and its ceiling, measured this many times each per run (interleaved).
ADD_ALL_PAIRS: Final = 3


class _PlainBase(DeclarativeBase):
    pass


class PlainJob(_PlainBase):
    """The job table mapped by a bare declarative class: every column, nothing of
    sqla_jobs' Python (no validators, no listeners). What SQLAlchemy's unit of work itself
    does with ``add_all``: the ceiling of ours."""

    __table__ = scratch.TABLE


def add_all(engine: sa.Engine, model: type[Job] | type[PlainJob], count: int) -> float:
    """ORM ``add_all`` of ``count`` jobs, a flush per ``FLUSH_EVERY``, one transaction."""
    started = time.perf_counter()
    with Session(engine) as session, session.begin():
        for first in range(0, count, FLUSH_EVERY):
            session.add_all(
                [
                    model(task="bench_noop", queue=Q_ENQUEUE, args={"n": n})
                    for n in range(first, min(first + FLUSH_EVERY, count))
                ]
            )
            session.flush()
    return count / (time.perf_counter() - started)


_ADD_ALL_ROUNDS: Final = itertools.count()


def run_enqueue(cfg: Config, engine: sa.Engine, results: Results) -> None:
    count = cfg.jobs
    if "ceiling" in cfg.sections:
        scratch.reset(engine)
        results.add("ceiling.insert", bare_insert(cfg, count), "jobs/s")
    # add_all and its ceiling side by side, ADD_ALL_PAIRS pairs per run, the first of each
    # pair alternating; beside each rate, this process's CPU per job (the client's work,
    # which the load of a shared machine disturbs less than the rate).
    models: list[type[Job] | type[PlainJob]] = []
    if "ceiling" in cfg.sections:
        models.append(PlainJob)
    if "enqueue" in cfg.sections:
        models.append(Job)
    for _ in range(ADD_ALL_PAIRS):
        if next(_ADD_ALL_ROUNDS) % 2:
            models.reverse()
        for model in models:
            scratch.reset(engine)
            cpu = time.process_time()
            rate = add_all(engine, model, count)
            client_us = (time.process_time() - cpu) / count * 1e6
            if model is PlainJob:
                results.add("ceiling.orm_add_all", rate, "jobs/s")
                results.add_cpu("ceiling.orm_add_all.client_us", client_us)
            else:
                results.add("enqueue.add_all", rate, "jobs/s", "ceiling.orm_add_all")
                results.add_cpu(
                    "enqueue.add_all.client_us", client_us, "ceiling.orm_add_all.client_us"
                )
    if "enqueue" not in cfg.sections:
        return
    scratch.reset(engine)
    started = time.perf_counter()
    with Session(engine) as session, session.begin():
        jobs = ({"task": "bench_noop", "queue": Q_ENQUEUE, "args": {"n": n}} for n in range(count))
        enqueue_many(session, Job, jobs, chunk_size=cfg.chunk)
    results.add("enqueue.bulk", count / (time.perf_counter() - started), "jobs/s", "ceiling.insert")
    _notify_cost(cfg, engine, results)
    scratch.progress("enqueue")


_NOTIFY_ROUNDS: Final = itertools.count()


def _notify_cost(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """What the NOTIFY trigger costs enqueueing: one job per business transaction (where
    NOTIFY's commit-time lock matters most) and bulk transactions, trigger on vs off. The
    ``notify`` figures' ratio is to the same work with the trigger disabled."""
    single = max(cfg.single_jobs, 1)
    bulk_rows = cfg.jobs
    for n in range(min(single, 200)):  # warm the connections, caches and prepared plans
        with Session(engine) as session, session.begin():
            session.add(Job(task="bench_noop", queue=Q_ENQUEUE, args={"n": n}))
    # Alternate which goes first between repeats, so neither gets the warmer machine.
    order = (False, True) if next(_NOTIFY_ROUNDS) % 2 == 0 else (True, False)
    for enabled in order:
        with engine.begin() as connection:
            connection.exec_driver_sql(bench_sql.set_user_triggers(scratch.TABLE, enabled=enabled))
        try:
            label = "notify" if enabled else "no_notify"
            scratch.reset(engine)
            started = time.perf_counter()
            for n in range(single):
                with Session(engine) as session, session.begin():
                    session.add(Job(task="bench_noop", queue=Q_ENQUEUE, args={"n": n}))
            ceiling = None if not enabled else "enqueue.tx1.no_notify"
            results.add(
                f"enqueue.tx1.{label}", single / (time.perf_counter() - started), "jobs/s", ceiling
            )
            scratch.reset(engine)
            started = time.perf_counter()
            for first in range(0, bulk_rows, 100):
                with Session(engine) as session, session.begin():
                    rows = (
                        {"task": "bench_noop", "queue": Q_ENQUEUE, "args": {"n": n}}
                        for n in range(first, min(first + 100, bulk_rows))
                    )
                    enqueue_many(session, Job, rows)
            ceiling = None if not enabled else "enqueue.tx100.no_notify"
            results.add(
                f"enqueue.tx100.{label}",
                bulk_rows / (time.perf_counter() - started),
                "jobs/s",
                ceiling,
            )
        finally:
            with engine.begin() as connection:
                connection.exec_driver_sql(bench_sql.set_user_triggers(scratch.TABLE, enabled=True))
