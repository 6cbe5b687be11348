"""The ceiling: the simplest correct queue SQL in a plain psycopg loop, at its best batch.

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

B runs over the sweep (``--sweep``, default 1, 10, 50, 100, 200, 500): B = 1 is the
one-job-per-claim ceiling, and the best rate of the others the batched ceiling
(``ceiling.<mode>.batched.<n>p``), so that the ceiling is the strongest plain loop, not one
at a batch size that happens to suit the library. Every point of the sweep is reported
(``ceiling.sweep.<mode>.b<B>.<n>p``), and the batch that won each run is recorded.

Also the bulk INSERT of :func:`sqla_jobs.enqueue_many` run by psycopg alone.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa

from sqla_jobs import _queries as statements
from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import LEASE_SECONDS, Q_ENQUEUE, Q_LEASE, Q_LOCK
from sqla_jobs.urls import libpq_url

__all__ = ["bare_insert", "processes", "run_sweep", "seed_loop"]


def seed_loop(url: str, queue: str, batch: int, mode: str, ready: Any, go: Any, out: Any) -> None:
    """Once connected, put None on ``ready`` and wait for ``go``; then claim and complete
    with the seed SQL until the queue is empty. Sends ``(count, started, ended)`` (wall
    clock) to ``out``."""
    table = scratch.TABLE
    many = batch > 1
    done = 0
    with psycopg.connect(libpq_url(url), autocommit=True) as connection:
        connection.execute(scratch.sql(statements.ping()))
        ready.put(None)
        go.wait(120)
        started = time.time()
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
        ended = time.time()
    out.put((done, started, ended))


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


def _seed_drain(cfg: Config, engine: sa.Engine, mode: str, batch: int, procs: int) -> float:
    queue = Q_LEASE if mode == "lease" else Q_LOCK
    count = cfg.jobs if batch > 1 else cfg.single_jobs
    scratch.reset(engine)
    scratch.fill(engine, queue, "bench_noop", count)
    results = processes(seed_loop, (cfg.url, queue, batch, mode), procs)
    done = sum(r[0] for r in results)
    span = max(r[2] for r in results) - min(r[1] for r in results)
    if done != count:
        raise RuntimeError(f"the seed {mode} loop completed {done} of {count} jobs")
    return float(done / span)


def run_sweep(cfg: Config, engine: sa.Engine, results: Results, mode: str, procs: int) -> None:
    """One run of the sweep for ``mode`` with ``procs`` processes: every point, the
    one-per-claim ceiling (B = 1) and the batched ceiling (the best B > 1)."""
    best: tuple[float, int] | None = None
    for batch in cfg.sweep:
        rate = _seed_drain(cfg, engine, mode, batch, procs)
        results.add(f"ceiling.sweep.{mode}.b{batch}.{procs}p", rate, "jobs/s")
        if batch == 1:
            results.add(f"ceiling.{mode}.single.{procs}p", rate, "jobs/s")
        elif best is None or rate > best[0]:
            best = (rate, batch)
    if best is not None:
        metric = results.add(f"ceiling.{mode}.batched.{procs}p", best[0], "jobs/s")
        metric.extra.setdefault("best_batch", []).append(best[1])


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
