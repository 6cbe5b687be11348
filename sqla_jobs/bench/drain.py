"""The ``drain`` section, interleaved with the ceiling's sweep it is compared with.

For each mode (lease, lock-held) and 1 and 2 processes: one run of the ceiling's sweep
(:mod:`~sqla_jobs.bench.ceiling`), then the same number of no-op jobs through the real worker
(:mod:`~sqla_jobs.bench.workers`):

``batched``  ``Worker(registry, engine, concurrency=--concurrency)`` and nothing else: the
             worker's default batch size and timings, what a user who sets only a
             concurrency gets; the same in both modes. (Lock-held mode holds a connection
             per running group of jobs, not per job: no-op handlers at concurrency 200 hold
             about as many as at 20, see docs/benchmarks.md.)
``single``   one job per claim: ``concurrency=1``. In lease mode also with
             ``synchronous_commit=False`` (``.async_commit``), beside the durable figure,
             against the same ceiling.

Lock-held drains are compared with two ceilings: the ``lock`` loop (``drain.lock.*``, the
issue's target) and the ``lock_counted`` loop (``drain.lock.*.counted``), which also counts
each attempt in a committed transaction before the rows are locked, as the worker does
(:mod:`~sqla_jobs.bench.ceiling`).
"""

from __future__ import annotations

import sqlalchemy as sa

from sqla_jobs.bench import scratch
from sqla_jobs.bench.ceiling import run_sweep
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.workers import worker_drain

__all__ = ["drain_name", "run_drain"]


def drain_name(kind: str, mode: str, batch_kind: str, procs: int) -> str:
    return f"{kind}.{mode}.{batch_kind}.{procs}p"


def run_drain(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """One run of the ceiling's sweeps and of the worker drains, interleaved per mode and
    number of processes."""
    for mode in ("lease", "lock"):
        for procs in (1, 2):
            if "ceiling" in cfg.sections:
                run_sweep(cfg, engine, results, mode, procs)
                if mode == "lock":
                    run_sweep(cfg, engine, results, "lock_counted", procs)
            if "drain" in cfg.sections:
                _drains(cfg, engine, results, mode, procs)
            scratch.progress(f"{mode} {procs}p")


def _drains(cfg: Config, engine: sa.Engine, results: Results, mode: str, procs: int) -> None:
    for batch_kind, slots, count in (
        ("batched", cfg.concurrency, cfg.jobs),
        ("single", 1, cfg.single_jobs),
    ):
        ceiling = drain_name("ceiling", mode, batch_kind, procs)
        name = drain_name("drain", mode, batch_kind, procs)
        value = worker_drain(cfg, engine, mode, slots, procs, count)
        results.add(name, value, "jobs/s", ceiling).extra["concurrency"] = slots
        if mode == "lock":
            counted = drain_name("ceiling", "lock_counted", batch_kind, procs)
            results.add(f"{name}.counted", value, "jobs/s", counted)
        if mode == "lease" and batch_kind == "single":
            # The worker's own transactions with synchronous_commit = off (Worker(...,
            # synchronous_commit=False)), beside the durable figure, same ceiling.
            value = worker_drain(cfg, engine, mode, slots, procs, count, synchronous_commit=False)
            results.add(f"{name}.async_commit", value, "jobs/s", ceiling)
