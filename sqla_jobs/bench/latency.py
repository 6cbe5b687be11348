"""The ``latency`` section: enqueue commit -> handler start, on an idle worker and under load."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import Session

from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import Q_LATENCY
from sqla_jobs.bench.workers import workers
from sqla_jobs.models import Job

__all__ = ["run_latency"]

# Latency under load: a steady rate of slow jobs on a worker with a few slots.
_LOAD_RATE: Final = 50.0  # jobs/s: 10 of the 16 slots busy on average
_LOAD_SLOTS: Final = 16


def run_latency(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """Enqueue (commit returned) to handler start: an idle worker woken by NOTIFY
    (``latency.p50``/``p99``), and a worker under load (``latency.load.*``): 16 slots, a
    steady 50 jobs/s of 200 ms handlers, so that about 10 run at any time."""
    idle = _latencies(
        engine, cfg, task="bench_stamp", slots=4, pause=lambda: random.uniform(0.02, 0.06)
    )
    load = _latencies(
        engine, cfg, task="bench_stamp_slow", slots=_LOAD_SLOTS, pause=lambda: 1 / _LOAD_RATE
    )
    for prefix, latencies in (("latency", idle), ("latency.load", load)):
        p99_index = min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))
        for name, value in (("p50", statistics.median(latencies)), ("p99", latencies[p99_index])):
            metric = results.add(f"{prefix}.{name}", max(value, 1e-3), "ms")
            metric.higher_is_better = False
    scratch.progress("latency")


def _latencies(
    engine: sa.Engine, cfg: Config, *, task: str, slots: int, pause: Callable[[], float]
) -> list[float]:
    """Milliseconds from each enqueue's commit to its handler's start, sorted."""
    scratch.reset(engine)
    committed: dict[int, float] = {}
    with workers(cfg, "latency", 1, slots, slots):
        next_at = time.monotonic()
        for _ in range(cfg.latency_samples):
            next_at += pause()
            time.sleep(max(0.0, next_at - time.monotonic()))
            with Session(engine) as session:
                session.add(job := Job(task=task, queue=Q_LATENCY))
                session.flush()
                job_id = job.id
                session.commit()
                committed[job_id] = time.time()
        scratch.wait_drained(engine, Q_LATENCY, timeout=60)
    with engine.connect() as connection:
        rows = connection.execute(bench_sql.stored_results(scratch.RESULTS))
        started = {row.job_id: float(row.value) for row in rows}
    return sorted((started[i] - t) * 1000 for i, t in committed.items())
