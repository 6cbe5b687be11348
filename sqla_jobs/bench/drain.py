"""The ``drain`` section, interleaved with the ceiling's sweep it is compared with.

For each mode (lease, lock-held) and 1 and 2 processes: one run of the ceiling's sweep
(:mod:`~sqla_jobs.bench.ceiling`), then the same number of no-op jobs through the real worker
(:mod:`~sqla_jobs.bench.workers`):

``batched``  ``Worker(registry, engine, concurrency=--concurrency)`` and nothing else: the
             worker's default batch size and timings, what a user who sets only a
             concurrency gets; the same in both modes. (Lock-held mode holds a connection
             per running group of jobs, not per job: no-op handlers at concurrency 200 hold
             about as many as at 20, see docs/benchmarks.md.)
``default``  lease mode only: the worker's default concurrency (``sqla-jobs worker`` with no
             options), against the ``batched`` drain of the same run.
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
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.ceiling import run_sweep
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.workers import measured_drain
from sqla_jobs.worker.settings import ClaimSettings

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
                if mode == "lease":
                    _default_drain(cfg, engine, results, procs)
                elif procs == 1:
                    _writes_drain(cfg, engine, results)
            scratch.progress(f"{mode} {procs}p")


def _default_drain(cfg: Config, engine: sa.Engine, results: Results, procs: int) -> None:
    """``drain.lease.default.<n>p``: the worker as ``sqla-jobs worker`` runs it with no
    options (its default concurrency), against the batched drain (``--concurrency``) of
    the same run: what a user who tunes nothing gets of what tuning gives."""
    slots = ClaimSettings.concurrency
    value = measured_drain(cfg, engine, "lease", slots, procs, cfg.jobs).rate
    against = drain_name("drain", "lease", "batched", procs)
    metric = results.add(drain_name("drain", "lease", "default", procs), value, "jobs/s", against)
    metric.extra["concurrency"] = slots


def _writes_drain(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """``drain.lock.writes.1p``: lock-held jobs that each write one row through the claim's
    session (``bench_write_lock``), what lock-held mode is for, at the worker's default
    concurrency, against the batched drain of no-op lock-held jobs of the same run: what a
    write costs a job, the savepoint it runs in among it. ``--single-jobs`` of them."""
    scratch.reset(engine, bench_sql.WRITES_TABLE)
    slots = ClaimSettings.concurrency
    count = cfg.single_jobs
    drained = measured_drain(cfg, engine, "lock", slots, 1, count, task="bench_write_lock")
    name, no_op = "drain.lock.writes.1p", drain_name("drain", "lock", "batched", 1)
    metric = results.add(name, drained.rate, "jobs/s", no_op)
    metric.extra["concurrency"] = slots
    worker_us, server_us = drained.usage.per_job(count)
    results.add_cpu(f"{name}.worker_us", worker_us, f"{no_op}.worker_us")
    results.add_cpu(f"{name}.server_us", server_us, f"{no_op}.server_us")
    written = scratch.count_rows(engine, bench_sql.WRITES_TABLE)
    if written != count:
        raise RuntimeError(f"the writing lock-held jobs wrote {written} rows for {count} jobs")


def _drains(cfg: Config, engine: sa.Engine, results: Results, mode: str, procs: int) -> None:
    for batch_kind, slots, count in (
        ("batched", cfg.concurrency, cfg.jobs),
        ("single", 1, cfg.single_jobs),
    ):
        ceiling = drain_name("ceiling", mode, batch_kind, procs)
        name = drain_name("drain", mode, batch_kind, procs)
        # Lock-held drains sample the server's wait events: a row lock waited for (two
        # processes' groups after the same rows) shows as "active Lock:...".
        drained = measured_drain(cfg, engine, mode, slots, procs, count, waits=mode == "lock")
        value = drained.rate
        metric = results.add(name, value, "jobs/s", ceiling)
        metric.extra["concurrency"] = slots
        if drained.waits is not None:
            metric.extra.setdefault("wait_events", []).append(drained.waits)
            in_transaction = sum(drained.waits.values())
            locked = sum(n for key, n in drained.waits.items() if key.startswith("active Lock:"))
            if in_transaction:
                share = results.add(f"{name}.lock_waits", locked / in_transaction, "fraction")
                share.higher_is_better = False
        # CPU per job: the worker processes' against the loop processes', the server's
        # against the server's in the loop's drain.
        worker_us, server_us = drained.usage.per_job(count)
        results.add_cpu(f"{name}.worker_us", worker_us, f"{ceiling}.client_us")
        results.add_cpu(f"{name}.server_us", server_us, f"{ceiling}.server_us")
        if mode == "lock":
            counted = drain_name("ceiling", "lock_counted", batch_kind, procs)
            results.add(f"{name}.counted", value, "jobs/s", counted)
        if mode == "lease" and batch_kind == "single":
            # The worker's own transactions with synchronous_commit = off (Worker(...,
            # synchronous_commit=False)), beside the durable figure, same ceiling.
            value = measured_drain(
                cfg, engine, mode, slots, procs, count, synchronous_commit=False
            ).rate
            results.add(f"{name}.async_commit", value, "jobs/s", ceiling)
