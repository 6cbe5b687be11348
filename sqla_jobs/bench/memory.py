"""The ``memory`` section: the peak RSS of a bulk enqueue of ``--memory-jobs`` jobs (against
a tenth of them), and a worker's RSS and rate over a drain of ``--memory-jobs`` jobs, against
the rate of a ``--memory-base-jobs`` drain (50k) through the same worker, same run."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from sqla_jobs import _queries as statements
from sqla_jobs.bench import scratch
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import Q_ENQUEUE
from sqla_jobs.bench.workers import measured_drain
from sqla_jobs.models import Job
from sqla_jobs.queue import enqueue_many

__all__ = ["run_memory"]


def _bulk_memory_child(url: str, count: int, chunk: int, out: Any) -> None:
    engine = scratch.engine(url, poolclass=NullPool)
    with engine.connect() as connection:
        connection.execute(statements.ping())
    base = scratch.rss() or 0
    started = time.perf_counter()
    with Session(engine) as session, session.begin():
        jobs = ({"task": "bench_noop", "queue": Q_ENQUEUE, "args": {"n": n}} for n in range(count))
        enqueue_many(session, Job, jobs, chunk_size=chunk)
    elapsed = time.perf_counter() - started
    out.put((base, scratch.peak_rss(), count / elapsed))


def run_memory(cfg: Config, engine: sa.Engine, results: Results) -> None:
    # Bulk enqueue: the peak RSS of a process that enqueues N jobs, against N / 10.
    peaks = {}
    for label, count in (("tenth", max(cfg.memory_jobs // 10, 1)), ("full", cfg.memory_jobs)):
        scratch.reset(engine)
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        proc = context.Process(target=_bulk_memory_child, args=(cfg.url, count, cfg.chunk, out))
        proc.start()
        base, peak, rate = out.get(timeout=3600)
        proc.join(60)
        peaks[label] = peak
        metric = results.add(f"memory.bulk_peak_rss.{label}", peak / 2**20, "MiB")
        metric.extra.update(jobs=count, base_mib=base / 2**20)
        if label == "full":
            results.add("memory.bulk_rate", rate, "jobs/s", "ceiling.insert")
    growth = results.add("memory.bulk_peak_growth", peaks["full"] / peaks["tenth"] - 1, "fraction")
    growth.higher_is_better = False
    scratch.progress("bulk enqueue memory")

    # The short drain first: the long one's rate is compared with it.
    base_jobs = min(cfg.memory_base_jobs, cfg.memory_jobs)
    rate = measured_drain(cfg, engine, "lease", cfg.concurrency, 1, base_jobs).rate
    results.add("memory.drain_rate.base", rate, "jobs/s").extra["jobs"] = base_jobs

    # Worker RSS over a long drain: after the first 10% of it (warmed up) against the rest.
    samples: list[tuple[float, int]] = []

    def sample(pids: list[int], seconds: float) -> None:
        rss = scratch.rss(pids[0])
        if rss is not None:
            samples.append((round(seconds, 3), rss))

    rate = measured_drain(
        cfg, engine, "lease", cfg.concurrency, 1, cfg.memory_jobs, on_sample=sample
    ).rate
    metric = results.add("memory.drain_rate", rate, "jobs/s", "memory.drain_rate.base")
    metric.extra["jobs"] = cfg.memory_jobs
    span = samples[-1][0] if samples else 0.0
    warm = [rss for seconds, rss in samples if seconds >= span / 10] or [s[1] for s in samples]
    if warm:
        first, peak = warm[0], max(warm)
        results.add("memory.worker_rss_start", first / 2**20, "MiB")
        results.add("memory.worker_rss_peak", peak / 2**20, "MiB")
        growth = results.add("memory.worker_rss_growth", peak / first - 1, "fraction")
        growth.higher_is_better = False
        growth.extra["samples"] = samples
    scratch.progress("worker memory")
