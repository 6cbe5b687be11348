"""The ceiling: the simplest correct queue SQL in a plain psycopg loop, at its best batch, on
the simplest table that SQL needs.

The loops run on the seed articles' own table
(:data:`~sqla_jobs.bench.statements.SEED_TABLE`: the columns they read and write, one
partial index of the pending jobs): that is the ceiling (``ceiling.<mode>.*``), and every
ratio is against it. The same loops run on the library's job table beside it
(``ceiling.library.<mode>.*``, at one job per claim and at the seed table's best batch),
their ratio to the ceiling the cost of the library table's shape alone.

Each loop runs in processes of its own (1 or 2), on one autocommit connection each, with
server-side prepared statements (``prepare=True``), until the queue is empty:

``lease``  claim up to B jobs (:func:`~sqla_jobs.bench.statements.seed_claim`: the seed
           articles' ``FOR UPDATE SKIP LOCKED`` CTE in an ``UPDATE ... RETURNING``, the
           lease folded in), then complete them fenced by attempt
           (:func:`~sqla_jobs.bench.statements.seed_complete`): two single-statement
           transactions per B jobs.
``lock``   one transaction per B jobs: lock them ``FOR UPDATE SKIP LOCKED``
           (:func:`~sqla_jobs.bench.statements.seed_lock`), complete them in the same
           transaction (:func:`~sqla_jobs.bench.statements.seed_lock_complete`), commit.
           It counts no attempt before the handler would run: a job that kills its
           worker every time runs forever.
``lock_counted``  what lock-held mode promises on top: each attempt is counted (and so a
           crash-looping job ends dead) before its handler runs. Claim up to B jobs as
           ``lease`` does (a committed transaction), then one transaction that locks their
           rows fenced by attempt (:func:`~sqla_jobs.bench.statements.seed_relock`),
           completes them (:func:`~sqla_jobs.bench.statements.seed_complete`) and commits.
           The worker's lock-held mode does this, and is compared with it too.

B runs over the sweep (``--sweep``, default 1, 10, 50, 100, 200, 500), and on past its
largest size, doubling, for as long as the rate still rises: B = 1 is the one-job-per-claim
ceiling, and the best rate of the others the batched ceiling
(``ceiling.<mode>.batched.<n>p``), so that the ceiling is the strongest plain loop, not one
at a batch size that happens to suit the library. Every point of the sweep is reported
(``ceiling.sweep.<mode>.b<B>.<n>p``), and the batch that won each run is recorded.

Each drain's CPU per job is reported beside its rate (:mod:`~sqla_jobs.bench.cpu`): the
loop processes' own (``.client_us``) and the server's (``.server_us``, when it runs on this
machine), which the worker's drains are compared with.

Also the bulk INSERT of :func:`sqla_jobs.enqueue_many` run by psycopg alone.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import psycopg
import sqlalchemy as sa

from sqla_jobs import _queries as statements
from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.cpu import Meter, Usage
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import LEASE_SECONDS, Q_ENQUEUE, Q_LEASE, Q_LOCK
from sqla_jobs.urls import libpq_url

__all__ = [
    "Drain",
    "add_drain",
    "bare_insert",
    "processes",
    "run_sweep",
    "seed_drain",
    "seed_loop",
    "table_named",
]


#: The tables a ceiling loop can run on, by name (a spawned process gets the name); any
#: other name is ``<schema>`` of a copy of the library's table (:mod:`~sqla_jobs.bench.shape`).
_TABLES: dict[str, sa.Table] = {"seed": bench_sql.SEED_TABLE, "library": scratch.TABLE}


def table_named(name: str) -> sa.Table:
    """The table a ceiling loop runs on: ``"seed"``, ``"library"``, or the schema of a copy
    of the library's job table."""
    found = _TABLES.get(name)
    return found if found is not None else scratch.TABLE.to_metadata(sa.MetaData(), schema=name)


def seed_loop(
    url: str, queue: str, batch: int, mode: str, table_name: str, ready: Any, go: Any, out: Any
) -> None:
    """Once connected, put None on ``ready`` and wait for ``go``; then claim and complete
    with the seed SQL on table ``table_name`` (:func:`table_named`) until the queue is
    empty. Sends ``(count, started, ended, cpu_seconds)`` (wall clock; this process's
    CPU over the loop) to ``out``."""
    table = table_named(table_name)
    many = batch > 1
    done = 0
    with psycopg.connect(libpq_url(url), autocommit=True) as connection:
        connection.execute(scratch.sql(statements.ping()))
        ready.put(None)
        go.wait(120)
        started, cpu = time.time(), time.process_time()
        if mode == "lease":
            claim_sql = scratch.sql(bench_sql.seed_claim(table))
            complete_sql = scratch.sql(bench_sql.seed_complete(table, many=many))
            params = {"queue": queue, "limit": batch, "lease_seconds": LEASE_SECONDS}
            while rows := connection.execute(claim_sql, params, prepare=True).fetchall():
                if many:
                    fence: dict[str, Any] = {
                        "ids": [r[0] for r in rows],
                        "attempts": [r[1] for r in rows],
                    }
                else:
                    fence = {"id": rows[0][0], "attempt": rows[0][1]}
                done += connection.execute(complete_sql, fence, prepare=True).rowcount
        elif mode == "lock_counted":
            claim_sql = scratch.sql(bench_sql.seed_claim(table))
            relock_sql = scratch.sql(bench_sql.seed_relock(table))
            complete_sql = scratch.sql(bench_sql.seed_complete(table, many=True))
            params = {"queue": queue, "limit": batch, "lease_seconds": LEASE_SECONDS}
            while rows := connection.execute(claim_sql, params, prepare=True).fetchall():
                fence = {"ids": [r[0] for r in rows], "attempts": [r[1] for r in rows]}
                with connection.transaction():
                    connection.execute(relock_sql, fence, prepare=True).fetchall()
                    done += connection.execute(complete_sql, fence, prepare=True).rowcount
        else:
            lock_sql = scratch.sql(bench_sql.seed_lock(table))
            complete_sql = scratch.sql(bench_sql.seed_lock_complete(table, many=many))
            params = {"queue": queue, "limit": batch}
            while True:
                with connection.transaction():
                    rows = connection.execute(lock_sql, params, prepare=True).fetchall()
                    if not rows:
                        break
                    ids: dict[str, Any] = (
                        {"ids": [r[0] for r in rows]} if many else {"id": rows[0][0]}
                    )
                    done += connection.execute(complete_sql, ids, prepare=True).rowcount
        ended, cpu = time.time(), time.process_time() - cpu
    out.put((done, started, ended, cpu))


def processes(target: Callable[..., None], args: Sequence[Any], count: int) -> list[Any]:
    """Run ``target(*args, ready, go, out)`` in ``count`` spawned processes, released
    together (``go``) once each has said it is ready; what each put on ``out``."""
    context = multiprocessing.get_context("spawn")
    ready, go, out = context.Queue(), context.Event(), context.Queue()
    procs = [context.Process(target=target, args=(*args, ready, go, out)) for _ in range(count)]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    go.set()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(30)
    return results


class Drain(NamedTuple):
    """A loop's drain: jobs/s, and CPU per job of the loop's processes and of the server."""

    rate: float
    client_us: float | None
    server_us: float | None


def seed_drain(
    cfg: Config, engine: sa.Engine, mode: str, batch: int, procs: int, table: str = "seed"
) -> Drain:
    queue = Q_LEASE if mode == "lease" else Q_LOCK
    count = cfg.jobs if batch > 1 else cfg.single_jobs
    jobs = table_named(table)
    scratch.reset(engine, jobs)
    # The server's CPU counts the INSERT of the jobs, as a worker drain's does (its workers
    # wait for the jobs, which wake them).
    meter = Meter(engine)
    meter.start()
    scratch.fill(engine, queue, "bench_noop", count, table=jobs)
    results = processes(seed_loop, (cfg.url, queue, batch, mode, table), procs)
    server = meter.stop().server
    done = sum(r[0] for r in results)
    span = max(r[2] for r in results) - min(r[1] for r in results)
    if done != count:
        raise RuntimeError(f"the seed {mode} loop completed {done} of {count} jobs")
    # The loops' own CPU is process_time(), exact; the server's is counted in clock ticks.
    client_us = sum(r[3] for r in results) / done * 1e6
    return Drain(float(done / span), client_us, Usage(None, server).per_job(done)[1])


def add_drain(results: Results, name: str, drain: Drain, ceiling: str | None = None) -> None:
    """A drain's rate as ``name``, and its CPU per job as ``name.client_us`` and
    ``name.server_us`` (each against ``ceiling``'s, when given)."""
    results.add(name, drain.rate, "jobs/s", ceiling)
    for kind, value in (("client_us", drain.client_us), ("server_us", drain.server_us)):
        results.add_cpu(f"{name}.{kind}", value, ceiling and f"{ceiling}.{kind}")


def _batches(cfg: Config, rates: dict[int, float], procs: int) -> int | None:
    """The sweep's next batch size: the next of ``--sweep``, then double the largest tried
    while its rate was the best so far (the rate still rising), up to ``cfg.sweep_max`` and
    to a batch each process can still fill from ``--jobs``; None when done."""
    for batch in cfg.sweep:
        if batch not in rates:
            return batch
    largest = max(rates)
    grow = largest * 2
    if largest == 1 or grow > cfg.sweep_max or grow * procs > cfg.jobs:
        return None
    best = max((b for b in rates if b > 1), key=rates.__getitem__)
    return grow if best == largest else None


def run_sweep(cfg: Config, engine: sa.Engine, results: Results, mode: str, procs: int) -> None:
    """One run of the sweep for ``mode`` with ``procs`` processes on the seed table: every
    point, the one-per-claim ceiling (B = 1) and the batched ceiling (the best B > 1); then
    the same loop on the library's table at B = 1 and at that best B, against them."""
    drains: dict[int, Drain] = {}
    while (batch := _batches(cfg, {b: d.rate for b, d in drains.items()}, procs)) is not None:
        drains[batch] = drain = seed_drain(cfg, engine, mode, batch, procs)
        results.add(f"ceiling.sweep.{mode}.b{batch}.{procs}p", drain.rate, "jobs/s")
    single, batched = f"ceiling.{mode}.single.{procs}p", f"ceiling.{mode}.batched.{procs}p"
    shape = f"ceiling.library.{mode}"
    if 1 in drains:
        add_drain(results, single, drains[1])
        add_drain(
            results,
            f"{shape}.single.{procs}p",
            seed_drain(cfg, engine, mode, 1, procs, "library"),
            single,
        )
    larger = [b for b in drains if b > 1]
    if larger:
        best = max(larger, key=lambda b: drains[b].rate)
        add_drain(results, batched, drains[best])
        results.metrics[batched].extra.setdefault("best_batch", []).append(best)
        library = seed_drain(cfg, engine, mode, best, procs, "library")
        add_drain(results, f"{shape}.batched.{procs}p", library, batched)


def bare_insert(cfg: Config, count: int) -> float:
    """The bulk statement of :func:`sqla_jobs.enqueue_many` with psycopg alone: same SQL,
    same chunks, one transaction."""
    insert_sql = scratch.sql(statements.enqueue_many(scratch.TABLE))
    encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    with psycopg.connect(libpq_url(cfg.url)) as connection:
        started = time.perf_counter()
        with connection.transaction():
            for first in range(0, count, cfg.chunk):
                rows = [
                    {"queue": Q_ENQUEUE, "task": "bench_noop", "args": {"n": n}}
                    for n in range(first, min(first + cfg.chunk, count))
                ]
                params = {"rows": encode(rows), "trace_context": None}  # no span: NULL
                connection.execute(insert_sql, params, prepare=True)
        elapsed = time.perf_counter() - started
    return count / elapsed
