"""The ``history`` section: the library's claim with 10k and with ``--history-rows``
finished rows in the table."""

from __future__ import annotations

import time
from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import Session

from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import LEASE_SECONDS, Q_CLAIM, Q_HISTORY
from sqla_jobs.models import Job
from sqla_jobs.queue import claim, complete_many

__all__ = ["run_history"]

_BASE_HISTORY: Final = 10_000


def _claim_throughput(engine: sa.Engine, batch: int, count: int) -> float:
    """The library's batched claim + complete_many, in this process, until ``count`` done."""
    done = 0
    started = time.perf_counter()
    while True:
        with Session(engine) as session, session.begin():
            jobs = claim(session, Job, queues=Q_CLAIM, limit=batch, lease=LEASE_SECONDS)
        if not jobs:
            break
        with Session(engine) as session, session.begin():
            done += len(jobs) - len(complete_many(session, jobs))
    if done != count:
        raise RuntimeError(f"claimed and completed {done} of {count} jobs")
    return done / (time.perf_counter() - started)


def run_history(cfg: Config, engine: sa.Engine, results: Results) -> None:
    scratch.reset(engine)
    have = 0
    for label, rows in (("10k", _BASE_HISTORY), ("big", max(cfg.history_rows, _BASE_HISTORY))):
        started = time.perf_counter()
        while have < rows:
            step = min(1_000_000, rows - have)
            scratch.fill(engine, Q_HISTORY, "bench_noop", step, finished=True)
            have += step
        scratch.vacuum(engine)
        setup = time.perf_counter() - started
        for _ in range(cfg.repeat):
            scratch.fill(engine, Q_CLAIM, "bench_noop", cfg.jobs)
            value = _claim_throughput(engine, cfg.batch, cfg.jobs)
            results.add(f"history.claim.{label}", value, "jobs/s", "history.claim.10k")
            with engine.begin() as connection:
                connection.execute(bench_sql.delete_queue(scratch.TABLE), {"queue": Q_CLAIM})
            scratch.vacuum(engine)
        results.metrics[f"history.claim.{label}"].extra.update(
            finished_rows=rows, setup_seconds=round(setup, 1)
        )
        scratch.progress(f"history {rows} rows")
    results.metrics["history.claim.10k"].ceiling = None
