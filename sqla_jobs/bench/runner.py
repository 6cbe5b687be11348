"""The benchmark itself: its sections, worker processes, report and command line.

What it measures and against what: :mod:`sqla_jobs.bench`. Its own SQL (filling and
resetting tables, server facts): :mod:`sqla_jobs.bench.statements`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import multiprocessing
import os
import platform
import random
import resource
import secrets
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import NullPool

from sqla_jobs import statements
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.embedded import EmbeddedPostgres
from sqla_jobs.models import Job, JobResult, metadata
from sqla_jobs.pgbouncer import PgBouncer, find_binary
from sqla_jobs.queue import claim, complete_many, enqueue_many
from sqla_jobs.registry import JobContext, Registry
from sqla_jobs.urls import libpq_url, psycopg_url
from sqla_jobs.worker import Worker

if TYPE_CHECKING:
    from sqla_jobs.bench.drivers import Rate

__all__ = ["SECTIONS", "main"]

SECTIONS: Final = (
    "ceiling",
    "enqueue",
    "drain",
    "latency",
    "history",
    "memory",
    "pgbouncer",
    "async",
)

_TABLE: Final[sa.Table] = Job.__table__  # type: ignore[assignment]
_RESULTS: Final[sa.Table] = JobResult.__table__  # type: ignore[assignment]
_Q_LEASE: Final = "bench_lease"
_Q_LOCK: Final = "bench_lock"
_Q_LATENCY: Final = "bench_latency"
_Q_CLAIM: Final = "bench_claim"
_Q_HISTORY: Final = "bench_history"
_Q_ENQUEUE: Final = "bench_enqueue"
_LEASE_SECONDS: Final = 300.0
# Latency under load: a steady rate of slow jobs on a worker with a few slots.
_LOAD_RATE: Final = 50.0  # jobs/s: 10 of the 16 slots busy on average
_LOAD_SLOTS: Final = 16
_SLOW_HANDLER_SECONDS: Final = 0.2
_FLUSH_EVERY: Final = 1000
_BASE_HISTORY: Final = 10_000
_LOCK_CONCURRENCY_CAP: Final = 20

# -- the tasks the workers run ---------------------------------------------------------------

registry = Registry(Job, default_lease=_LEASE_SECONDS)
latency_registry = Registry(Job, result_model=JobResult)


@registry.task(queue=_Q_LEASE)
def bench_noop(ctx: JobContext) -> None:
    """A no-op job in lease mode."""


@registry.task(queue=_Q_LOCK, mode="lock")
def bench_noop_lock(ctx: JobContext) -> None:
    """A no-op job in lock-held mode."""


@latency_registry.task(queue=_Q_LATENCY)
def bench_stamp(ctx: JobContext) -> float:
    """Returns the wall-clock time at which the handler started."""
    return time.time()


@latency_registry.task(queue=_Q_LATENCY)
def bench_stamp_slow(ctx: JobContext) -> float:
    """Returns the wall-clock time at which the handler started, after working 200 ms."""
    started = time.time()
    time.sleep(_SLOW_HANDLER_SECONDS)
    return started


# -- the ORM's own ceiling -------------------------------------------------------------------


class _PlainBase(DeclarativeBase):
    pass


class _PlainJob(_PlainBase):
    """A bare declarative model with the columns an enqueue sets, nothing of sqla_jobs: what
    SQLAlchemy's unit of work itself does with ``add_all``, the ceiling of ours."""

    __tablename__ = "sqla_jobs_bench_plain"

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    queue: Mapped[str] = mapped_column(sa.Text)
    task: Mapped[str] = mapped_column(sa.Text)
    args: Mapped[dict[str, Any]] = mapped_column(JSONB)


_PLAIN: Final[sa.Table] = _PlainJob.__table__  # type: ignore[assignment]


# -- plumbing ----------------------------------------------------------------------------------


@dataclass
class Config:
    url: str
    jobs: int = 20_000
    single_jobs: int = 2_000
    history_rows: int = 10_000_000
    memory_jobs: int = 1_000_000
    repeat: int = 3
    batch: int = 50
    chunk: int = 1_000
    latency_samples: int = 200
    sections: tuple[str, ...] = SECTIONS


@dataclass
class Metric:
    name: str
    unit: str
    runs: list[float] = field(default_factory=list)
    ceiling: str | None = None
    higher_is_better: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None


class Results:
    def __init__(self) -> None:
        self.metrics: dict[str, Metric] = {}
        self.skipped: dict[str, str] = {}  # section -> why it was not measured

    def add(self, name: str, value: float, unit: str, ceiling: str | None = None) -> None:
        metric = self.metrics.setdefault(name, Metric(name, unit, ceiling=ceiling))
        metric.runs.append(value)

    def median(self, name: str) -> float | None:
        metric = self.metrics.get(name)
        return None if metric is None else metric.median

    def ratio(self, name: str) -> float | None:
        metric = self.metrics.get(name)
        if metric is None or metric.ceiling is None:
            return None
        value, ceiling = metric.median, self.median(metric.ceiling)
        if value is None or not ceiling:
            return None
        return value / ceiling


def _sql(stmt: sa.ClauseElement) -> str:
    """The SQL text psycopg runs for one of our statements (``%(name)s`` parameters)."""
    return str(stmt.compile(dialect=psycopg_dialect.dialect()))  # type: ignore[no-untyped-call]


def _engine(url: str, **kwargs: Any) -> sa.Engine:
    return sa.create_engine(url, **kwargs)


def _rss(pid: int | None = None) -> int | None:
    """Resident set size in bytes, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        connection.execute(sa.text(bench_sql.truncate(_TABLE, _RESULTS)))


def _fill(engine: sa.Engine, queue: str, task: str, count: int, *, finished: bool = False) -> None:
    stmt = bench_sql.fill(_TABLE, finished=finished)
    with engine.begin() as connection:
        connection.execute(stmt, {"queue": queue, "task": task, "count": count})


def _vacuum(engine: sa.Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text(bench_sql.vacuum_analyze(_TABLE)))


def _db_now(engine: sa.Engine) -> datetime:
    with engine.connect() as connection:
        value: datetime = connection.execute(bench_sql.database_clock()).scalar_one()
        return value


def _wait_drained(engine: sa.Engine, queue: str, timeout: float) -> tuple[int, datetime | None]:
    deadline = time.monotonic() + timeout
    with engine.connect() as connection:
        while time.monotonic() < deadline:
            busy = connection.execute(bench_sql.has_runnable(_TABLE), {"queue": queue})
            connection.commit()
            if not busy.scalar_one():
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"queue {queue} did not drain within {timeout:.0f}s")
        count, last = connection.execute(bench_sql.finished(_TABLE), {"queue": queue}).one()
        return int(count), last


# -- the bare loops (the ceiling) ------------------------------------------------------------


def _bare_loop(url: str, queue: str, batch: int, mode: str, start_at: float, out: Any) -> None:
    """Claim and complete until the queue is empty, with plain psycopg. Sends
    ``(count, started, ended)`` (wall clock) to ``out``."""
    claim_sql = _sql(statements.claim(_TABLE, queue_count=1))
    complete_sql = _sql(statements.complete(_TABLE))
    lock_sql = _sql(statements.lock(_TABLE))
    params = {"queue_name": queue, "limit": batch, "lease_seconds": _LEASE_SECONDS}
    params["worker"] = f"bare:{os.getpid()}"
    done = 0
    with psycopg.connect(libpq_url(url), autocommit=True) as connection:
        connection.execute(_sql(statements.ping()))
        time.sleep(max(0.0, start_at - time.time()))
        started = time.time()
        while True:
            rows = connection.execute(claim_sql, params, prepare=True).fetchall()
            if not rows:
                break
            if mode == "lease":
                fence = {
                    "fence_ids": ",".join([str(r[0]) for r in rows]),
                    "fence_attempts": ",".join([str(r[6]) for r in rows]),
                }
                done += len(connection.execute(complete_sql, fence, prepare=True).fetchall())
            else:
                for row in rows:
                    fence = {"fence_ids": str(row[0]), "fence_attempts": str(row[6])}
                    with connection.transaction():
                        connection.execute(lock_sql, fence, prepare=True).fetchall()
                        done += len(
                            connection.execute(complete_sql, fence, prepare=True).fetchall()
                        )
        ended = time.time()
    out.put((done, started, ended))


def _processes(target: Callable[..., None], args: Sequence[Any], count: int) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start_at = time.time() + 1.5  # spawned interpreters need a moment to import
    procs = [context.Process(target=target, args=(*args, start_at, out)) for _ in range(count)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(30)
    return results


def _bare_drain(cfg: Config, engine: sa.Engine, mode: str, batch: int, procs: int) -> float:
    queue = _Q_LEASE if mode == "lease" else _Q_LOCK
    count = cfg.jobs if batch > 1 else cfg.single_jobs
    _reset(engine)
    _fill(engine, queue, "bench_noop", count)
    results = _processes(_bare_loop, (cfg.url, queue, batch, mode), procs)
    done = sum(r[0] for r in results)
    span = max(r[2] for r in results) - min(r[1] for r in results)
    if done != count:
        raise RuntimeError(f"bare {mode} loop completed {done} of {count} jobs")
    return float(done / span)


def _bare_insert(cfg: Config, engine: sa.Engine, count: int) -> float:
    """The bulk statement with psycopg alone: same SQL, same chunks, one transaction."""
    _reset(engine)
    insert_sql = _sql(statements.enqueue_many(_TABLE))
    encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    with psycopg.connect(libpq_url(cfg.url)) as connection:
        started = time.perf_counter()
        with connection.transaction():
            for first in range(0, count, cfg.chunk):
                rows = [
                    {"queue": _Q_ENQUEUE, "task": "bench_noop", "args": {"n": n}}
                    for n in range(first, min(first + cfg.chunk, count))
                ]
                params = {"rows": encode(rows), "trace_context": None}  # no span: NULL
                connection.execute(insert_sql, params, prepare=True)
        elapsed = time.perf_counter() - started
    return count / elapsed


# -- workers ---------------------------------------------------------------------------------


def _worker_process(
    url: str,
    which: str,
    concurrency: int,
    batch: int,
    listen_url: str | None,
    ready: Any,
    stop: Any,
    synchronous_commit: bool = True,
) -> None:
    """A worker on ``url``; with ``listen_url``, ``url`` goes through PgBouncer: no prepared
    statements there, and LISTEN on ``listen_url``, a direct connection."""
    registry_ = latency_registry if which == "latency" else registry
    queue = {"lease": _Q_LEASE, "lock": _Q_LOCK, "latency": _Q_LATENCY}[which]
    pooled = {"connect_args": {"prepare_threshold": None}} if listen_url else {}
    engine = _engine(url, pool_size=concurrency + 5, max_overflow=10, **pooled)
    listen_engine = _engine(listen_url, poolclass=NullPool) if listen_url else None
    worker = Worker(
        registry_,
        engine,
        queues=[queue],
        concurrency=concurrency,
        batch_size=batch,
        handle_signals=False,
        synchronous_commit=synchronous_commit,
        listen_engine=listen_engine,
    )

    def watch() -> None:
        while not worker.health().listening:
            time.sleep(0.01)
        ready.set()
        stop.wait()
        worker.stop()

    threading.Thread(target=watch, daemon=True).start()
    worker.run()
    engine.dispose()
    if listen_engine is not None:
        listen_engine.dispose()


@contextlib.contextmanager
def _workers(
    cfg: Config,
    which: str,
    procs: int,
    concurrency: int,
    batch: int,
    pooled_url: str | None = None,
    synchronous_commit: bool = True,
) -> Iterator[list[int]]:
    """Worker processes on ``cfg.url``, or through PgBouncer at ``pooled_url`` (LISTEN on
    ``cfg.url``), each ready once it listens."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    readies = [context.Event() for _ in range(procs)]
    url, listen_url = (pooled_url, cfg.url) if pooled_url else (cfg.url, None)
    processes = [
        context.Process(
            target=_worker_process,
            args=(url, which, concurrency, batch, listen_url, ready, stop, synchronous_commit),
        )
        for ready in readies
    ]
    for proc in processes:
        proc.start()
    try:
        deadline = time.monotonic() + 60
        for ready, proc in zip(readies, processes, strict=True):
            while not ready.wait(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"a benchmark worker did not start ({proc.exitcode=})")
        yield [proc.pid for proc in processes if proc.pid is not None]
    finally:
        stop.set()
        for proc in processes:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def _worker_drain(
    cfg: Config,
    engine: sa.Engine,
    mode: str,
    batch: int,
    procs: int,
    count: int | None = None,
    on_sample: Callable[[list[int], float], None] | None = None,
    pooled_url: str | None = None,
    synchronous_commit: bool = True,
) -> float:
    queue = _Q_LEASE if mode == "lease" else _Q_LOCK
    task = "bench_noop" if mode == "lease" else "bench_noop_lock"
    count = count or (cfg.jobs if batch > 1 else cfg.single_jobs)
    if mode == "lock":
        concurrency = min(batch, _LOCK_CONCURRENCY_CAP)
    else:
        # Batched: room for two batches, so that the next claim goes out while the handlers
        # run the last one (measured 1-4% faster than concurrency == batch, 8 pairs of 8).
        concurrency = 1 if batch == 1 else 2 * batch
    _reset(engine)
    with _workers(cfg, mode, procs, concurrency, batch, pooled_url, synchronous_commit) as pids:
        _fill(engine, queue, task, count)
        committed = _db_now(engine)
        if on_sample is not None:
            _sample_until_drained(engine, queue, pids, on_sample)
        done, last = _wait_drained(engine, queue, timeout=max(600.0, count / 100))
    if done != count or last is None:
        raise RuntimeError(f"the workers completed {done} of {count} jobs")
    return done / (last - committed).total_seconds()


def _sample_until_drained(
    engine: sa.Engine, queue: str, pids: list[int], on_sample: Callable[[list[int], float], None]
) -> None:
    """Call ``on_sample(pids, seconds since the start)`` every half second until the queue
    has no runnable job. Only the claim index's first entry is read: counting the finished
    rows of a large drain would cost the server more than the drain it measures."""
    started = time.monotonic()
    with engine.connect() as connection:
        while True:
            busy = connection.execute(bench_sql.has_runnable(_TABLE), {"queue": queue})
            connection.commit()
            remaining = bool(busy.scalar_one())
            on_sample(pids, time.monotonic() - started)
            if not remaining:
                return
            time.sleep(0.5)


# -- sections --------------------------------------------------------------------------------

_DRAINS: Final = [
    (mode, batch_kind, procs)
    for mode in ("lease", "lock")
    for batch_kind in ("single", "batched")
    for procs in (1, 2)
]


def _drain_name(kind: str, mode: str, batch_kind: str, procs: int) -> str:
    return f"{kind}.{mode}.{batch_kind}.{procs}p"


def run_drain(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """The ceiling's claim/complete loops and the worker drains, interleaved per config."""
    for mode, batch_kind, procs in _DRAINS:
        batch = cfg.batch if batch_kind == "batched" else 1
        ceiling = _drain_name("ceiling", mode, batch_kind, procs)
        if "ceiling" in cfg.sections:
            results.add(ceiling, _bare_drain(cfg, engine, mode, batch, procs), "jobs/s")
        if "drain" in cfg.sections:
            value = _worker_drain(cfg, engine, mode, batch, procs)
            results.add(_drain_name("drain", mode, batch_kind, procs), value, "jobs/s", ceiling)
            if mode == "lease" and batch == 1:
                # The worker's own transactions with synchronous_commit = off (Worker(...,
                # synchronous_commit=False)), beside the durable figure, same ceiling.
                value = _worker_drain(cfg, engine, mode, batch, procs, synchronous_commit=False)
                name = _drain_name("drain", mode, batch_kind, procs) + ".async_commit"
                results.add(name, value, "jobs/s", ceiling)
        _progress(f"{mode} {batch_kind} {procs}p")


_PGBOUNCER_DRAINS: Final = (("batched", 1), ("batched", 2), ("single", 1))
_PGBOUNCER_ROUNDS: Final = itertools.count()


def run_pgbouncer(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """Lease-mode drains with the worker's engine through PgBouncer in transaction mode
    (``prepare_threshold=None``, LISTEN on a direct connection), each against the same drain
    direct, measured side by side: ``pgbouncer.drain.*`` has ``pgbouncer.direct.*`` as its
    ceiling. Skipped, saying why, when PgBouncer is not installed."""
    if find_binary() is None:
        results.skipped["pgbouncer"] = (
            "PgBouncer is not installed (on Debian: apt-get install pgbouncer)"
        )
        _progress(f"pgbouncer skipped: {results.skipped['pgbouncer']}")
        return
    database = make_url(cfg.url).database
    assert database is not None
    # Alternate which goes first between repeats, so neither gets the warmer machine.
    pooled_first = next(_PGBOUNCER_ROUNDS) % 2 == 1
    with PgBouncer(cfg.url) as bouncer:
        pooled_url = bouncer.url(database)
        for batch_kind, procs in _PGBOUNCER_DRAINS:
            batch = cfg.batch if batch_kind == "batched" else 1
            direct = _drain_name("pgbouncer.direct", "lease", batch_kind, procs)
            for via in (pooled_url, None) if pooled_first else (None, pooled_url):
                value = _worker_drain(cfg, engine, "lease", batch, procs, pooled_url=via)
                if via is None:
                    results.add(direct, value, "jobs/s")
                else:
                    name = _drain_name("pgbouncer.drain", "lease", batch_kind, procs)
                    results.add(name, value, "jobs/s", direct)
            _progress(f"pgbouncer {batch_kind} {procs}p")


def _add_all(engine: sa.Engine, model: type[Job] | type[_PlainJob], count: int) -> float:
    """ORM ``add_all`` of ``count`` jobs, a flush per ``_FLUSH_EVERY``, one transaction."""
    started = time.perf_counter()
    with Session(engine) as session, session.begin():
        for first in range(0, count, _FLUSH_EVERY):
            session.add_all(
                [
                    model(task="bench_noop", queue=_Q_ENQUEUE, args={"n": n})
                    for n in range(first, min(first + _FLUSH_EVERY, count))
                ]
            )
            session.flush()
    return count / (time.perf_counter() - started)


def run_enqueue(cfg: Config, engine: sa.Engine, results: Results) -> None:
    count = cfg.jobs
    if "ceiling" in cfg.sections:
        results.add("ceiling.insert", _bare_insert(cfg, engine, count), "jobs/s")
        with engine.begin() as connection:
            connection.execute(bench_sql.clear(_PLAIN))
        results.add("ceiling.orm_add_all", _add_all(engine, _PlainJob, count), "jobs/s")
    if "enqueue" not in cfg.sections:
        return
    _reset(engine)
    results.add("enqueue.add_all", _add_all(engine, Job, count), "jobs/s", "ceiling.orm_add_all")
    _reset(engine)
    started = time.perf_counter()
    with Session(engine) as session, session.begin():
        jobs = ({"task": "bench_noop", "queue": _Q_ENQUEUE, "args": {"n": n}} for n in range(count))
        enqueue_many(session, Job, jobs, chunk_size=cfg.chunk)
    results.add("enqueue.bulk", count / (time.perf_counter() - started), "jobs/s", "ceiling.insert")
    _notify_cost(cfg, engine, results)
    _progress("enqueue")


_NOTIFY_ROUNDS: Final = itertools.count()


def _notify_cost(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """What the NOTIFY trigger costs enqueueing: one job per business transaction (where
    NOTIFY's commit-time lock matters most) and bulk transactions, trigger on vs off. The
    ``notify`` figures' ratio is to the same work with the trigger disabled."""
    single = max(cfg.single_jobs, 1)
    bulk_rows = cfg.jobs
    for n in range(min(single, 200)):  # warm the connections, caches and prepared plans
        with Session(engine) as session, session.begin():
            session.add(Job(task="bench_noop", queue=_Q_ENQUEUE, args={"n": n}))
    # Alternate which goes first between repeats, so neither gets the warmer machine.
    order = (False, True) if next(_NOTIFY_ROUNDS) % 2 == 0 else (True, False)
    for enabled in order:
        with engine.begin() as connection:
            connection.exec_driver_sql(bench_sql.set_user_triggers(_TABLE, enabled=enabled))
        try:
            label = "notify" if enabled else "no_notify"
            _reset(engine)
            started = time.perf_counter()
            for n in range(single):
                with Session(engine) as session, session.begin():
                    session.add(Job(task="bench_noop", queue=_Q_ENQUEUE, args={"n": n}))
            ceiling = None if not enabled else "enqueue.tx1.no_notify"
            results.add(
                f"enqueue.tx1.{label}", single / (time.perf_counter() - started), "jobs/s", ceiling
            )
            _reset(engine)
            started = time.perf_counter()
            for first in range(0, bulk_rows, 100):
                with Session(engine) as session, session.begin():
                    rows = (
                        {"task": "bench_noop", "queue": _Q_ENQUEUE, "args": {"n": n}}
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
                connection.exec_driver_sql(bench_sql.set_user_triggers(_TABLE, enabled=True))


def run_latency(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """Enqueue (commit returned) to handler start: an idle worker woken by NOTIFY
    (``latency.p50``/``p99``), and a worker under load (``latency.load.*``): 16 slots, a
    steady 100 jobs/s of 200 ms handlers, so that about 20 run at any time."""
    idle = _latencies(
        engine, cfg, task="bench_stamp", slots=4, pause=lambda: random.uniform(0.02, 0.06)
    )
    load = _latencies(
        engine, cfg, task="bench_stamp_slow", slots=_LOAD_SLOTS, pause=lambda: 1 / _LOAD_RATE
    )
    for prefix, latencies in (("latency", idle), ("latency.load", load)):
        p99_index = min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))
        for name, value in (("p50", statistics.median(latencies)), ("p99", latencies[p99_index])):
            results.add(f"{prefix}.{name}", max(value, 1e-3), "ms")
            results.metrics[f"{prefix}.{name}"].higher_is_better = False
    _progress("latency")


def _latencies(
    engine: sa.Engine, cfg: Config, *, task: str, slots: int, pause: Callable[[], float]
) -> list[float]:
    """Milliseconds from each enqueue's commit to its handler's start, sorted."""
    _reset(engine)
    committed: dict[int, float] = {}
    with _workers(cfg, "latency", 1, slots, slots):
        next_at = time.monotonic()
        for _ in range(cfg.latency_samples):
            next_at += pause()
            time.sleep(max(0.0, next_at - time.monotonic()))
            with Session(engine) as session:
                session.add(job := Job(task=task, queue=_Q_LATENCY))
                session.flush()
                job_id = job.id
                session.commit()
                committed[job_id] = time.time()
        _wait_drained(engine, _Q_LATENCY, timeout=60)
    with engine.connect() as connection:
        rows = connection.execute(bench_sql.stored_results(_RESULTS))
        started = {row.job_id: float(row.value) for row in rows}
    return sorted((started[i] - t) * 1000 for i, t in committed.items())


def _claim_throughput(engine: sa.Engine, batch: int, count: int) -> float:
    """The library's batched claim + complete_many, in this process, until ``count`` done."""
    done = 0
    started = time.perf_counter()
    while True:
        with Session(engine) as session, session.begin():
            jobs = claim(session, Job, queues=_Q_CLAIM, limit=batch, lease=_LEASE_SECONDS)
        if not jobs:
            break
        with Session(engine) as session, session.begin():
            done += len(jobs) - len(complete_many(session, jobs))
    if done != count:
        raise RuntimeError(f"claimed and completed {done} of {count} jobs")
    return done / (time.perf_counter() - started)


def run_history(cfg: Config, engine: sa.Engine, results: Results) -> None:
    _reset(engine)
    have = 0
    for label, rows in (("10k", _BASE_HISTORY), ("big", max(cfg.history_rows, _BASE_HISTORY))):
        started = time.perf_counter()
        while have < rows:
            step = min(1_000_000, rows - have)
            _fill(engine, _Q_HISTORY, "bench_noop", step, finished=True)
            have += step
        _vacuum(engine)
        setup = time.perf_counter() - started
        for _ in range(cfg.repeat):
            _fill(engine, _Q_CLAIM, "bench_noop", cfg.jobs)
            value = _claim_throughput(engine, cfg.batch, cfg.jobs)
            results.add(f"history.claim.{label}", value, "jobs/s", "history.claim.10k")
            with engine.begin() as connection:
                connection.execute(bench_sql.delete_queue(_TABLE), {"queue": _Q_CLAIM})
            _vacuum(engine)
        results.metrics[f"history.claim.{label}"].extra.update(
            finished_rows=rows, setup_seconds=round(setup, 1)
        )
        _progress(f"history {rows} rows")
    results.metrics["history.claim.10k"].ceiling = None


def _bulk_memory_child(url: str, count: int, chunk: int, out: Any) -> None:
    engine = _engine(url, poolclass=NullPool)
    with engine.connect() as connection:
        connection.execute(statements.ping())
    base = _rss() or 0
    started = time.perf_counter()
    with Session(engine) as session, session.begin():
        jobs = ({"task": "bench_noop", "queue": _Q_ENQUEUE, "args": {"n": n}} for n in range(count))
        enqueue_many(session, Job, jobs, chunk_size=chunk)
    elapsed = time.perf_counter() - started
    out.put((base, _peak_rss(), count / elapsed))


def run_memory(cfg: Config, engine: sa.Engine, results: Results) -> None:
    # Bulk enqueue: the peak RSS of a process that enqueues N jobs, against N / 10.
    peaks = {}
    for label, count in (("tenth", max(cfg.memory_jobs // 10, 1)), ("full", cfg.memory_jobs)):
        _reset(engine)
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        proc = context.Process(target=_bulk_memory_child, args=(cfg.url, count, cfg.chunk, out))
        proc.start()
        base, peak, rate = out.get(timeout=3600)
        proc.join(60)
        peaks[label] = peak
        results.add(f"memory.bulk_peak_rss.{label}", peak / 2**20, "MiB")
        results.metrics[f"memory.bulk_peak_rss.{label}"].extra.update(
            jobs=count, base_mib=base / 2**20
        )
        if label == "full":
            results.add("memory.bulk_rate", rate, "jobs/s", "ceiling.insert")
    results.add("memory.bulk_peak_growth", peaks["full"] / peaks["tenth"] - 1, "fraction")
    results.metrics["memory.bulk_peak_growth"].higher_is_better = False
    _progress("bulk enqueue memory")

    # Worker RSS over a long drain: after the first 10% of it (warmed up) against the rest.
    samples: list[tuple[float, int]] = []

    def sample(pids: list[int], seconds: float) -> None:
        rss = _rss(pids[0])
        if rss is not None:
            samples.append((round(seconds, 3), rss))

    rate = _worker_drain(cfg, engine, "lease", cfg.batch, 1, cfg.memory_jobs, on_sample=sample)
    results.add("memory.drain_rate", rate, "jobs/s", "ceiling.lease.batched.1p")
    span = samples[-1][0] if samples else 0.0
    warm = [rss for seconds, rss in samples if seconds >= span / 10] or [s[1] for s in samples]
    if warm:
        first, peak = warm[0], max(warm)
        results.add("memory.worker_rss_start", first / 2**20, "MiB")
        results.add("memory.worker_rss_peak", peak / 2**20, "MiB")
        results.add("memory.worker_rss_growth", peak / first - 1, "fraction")
        results.metrics["memory.worker_rss_growth"].higher_is_better = False
        results.metrics["memory.worker_rss_growth"].extra["samples"] = samples
    _progress("worker memory")


_ASYNC_ROUNDS: Final = itertools.count()
_Q_ASYNC: Final = "bench_async"


def run_async(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """The ``async`` section (:mod:`sqla_jobs.bench.drivers`): enqueue and claim + complete
    through :mod:`sqla_jobs.aio` on psycopg and on asyncpg, beside the sync paths."""
    if importlib.util.find_spec("asyncpg") is None:
        _progress('async: skipped, asyncpg is not installed (pip install "sqla-jobs[asyncpg]")')
        return
    try:
        from sqla_jobs.bench import drivers
    except ImportError as exc:  # no greenlet: sqla_jobs.aio names the extra
        _progress(f"async: skipped, {exc}")
        return

    rotation = next(_ASYNC_ROUNDS)
    paths = drivers.Paths(cfg.url, lease=_LEASE_SECONDS)
    try:
        # Warm every path (connections, prepared statements) on a few jobs, untimed.
        for path in drivers.PATHS:
            _fill(engine, _Q_ASYNC, "bench_noop", 10)
            paths.cycles(path, _Q_ASYNC, 2, 10)
        enqueueing = drivers.PATHS[1:]
        for path in drivers.rotated(enqueueing, rotation):
            _reset(engine)
            _add_rate(results, "add_all", path, paths.add_all(path, _Q_ASYNC, cfg.jobs))
        for path in drivers.rotated(enqueueing, rotation):
            _reset(engine)
            rate = paths.enqueue_many(path, _Q_ASYNC, cfg.jobs, cfg.chunk)
            _add_rate(results, "enqueue_many", path, rate)
        for kind, batch, count in (
            ("single", 1, cfg.single_jobs),
            ("batched", cfg.batch, cfg.jobs),
        ):
            for path in drivers.rotated(drivers.PATHS, rotation):
                _reset(engine)
                _fill(engine, _Q_ASYNC, "bench_noop", count)
                rate = paths.cycles(path, _Q_ASYNC, batch, count)
                _add_rate(results, f"cycle.{kind}", path, rate)
    finally:
        paths.close()
    _progress("async (psycopg and asyncpg)")


def _add_rate(results: Results, operation: str, path: str, rate: Rate) -> None:
    """``async.<operation>.<path>`` in jobs/s, and ``async.cpu.<operation>.<path>``, the
    bench process's CPU per job (lower is better), each beside the path before it."""
    name, cpu = f"async.{operation}.{path}", f"async.cpu.{operation}.{path}"
    results.add(name, rate.per_second, "jobs/s", _before(operation, path))
    before = _before(operation, path)
    results.add(cpu, rate.cpu_us_per_job, "us/job", before and before.replace(".", ".cpu.", 1))
    results.metrics[cpu].higher_is_better = False


# drivers.PATHS, which this module cannot import without greenlet.
_ASYNC_PATHS: Final = ("connection", "session", "psycopg", "asyncpg")


def _before(operation: str, path: str) -> str | None:
    """The figure a path's is compared with: the path before it (enqueueing has no
    ``connection`` path)."""
    index = _ASYNC_PATHS.index(path)
    if index == 0 or (index == 1 and operation in ("add_all", "enqueue_many")):
        return None
    return f"async.{operation}.{_ASYNC_PATHS[index - 1]}"


# -- report ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    metric: str
    text: str
    check: Callable[[Results], float | None]
    threshold: float
    at_least: bool = True


def _value(name: str) -> Callable[[Results], float | None]:
    return lambda results: results.median(name)


def _difference(name: str, base: str) -> Callable[[Results], float | None]:
    def check(results: Results) -> float | None:
        value, other = results.median(name), results.median(base)
        return None if value is None or other is None else value - other

    return check


def _ratio(name: str) -> Callable[[Results], float | None]:
    return lambda results: results.ratio(name)


TARGETS: Final = [
    Target(
        "drain.lease.batched.1p",
        "batched drain >= 75% of bare (lease, 1p)",
        _ratio("drain.lease.batched.1p"),
        0.75,
    ),
    Target(
        "drain.lease.batched.2p",
        "batched drain >= 75% of bare (lease, 2p)",
        _ratio("drain.lease.batched.2p"),
        0.75,
    ),
    Target(
        "drain.lease.single.1p",
        "one per claim >= 70% of bare (lease, 1p)",
        _ratio("drain.lease.single.1p"),
        0.70,
    ),
    Target(
        "drain.lease.single.2p",
        "one per claim >= 70% of bare (lease, 2p)",
        _ratio("drain.lease.single.2p"),
        0.70,
    ),
    Target("enqueue.add_all", "add_all >= 30k jobs/s", _value("enqueue.add_all"), 30_000),
    Target("enqueue.bulk", "bulk >= 60% of bare INSERT", _ratio("enqueue.bulk"), 0.60),
    Target("latency.p50", "idle wake-up p50 <= 5 ms", _value("latency.p50"), 5.0, at_least=False),
    Target(
        "latency.load.p50",
        "p50 under load within 2 ms of idle",
        _difference("latency.load.p50", "latency.p50"),
        2.0,
        at_least=False,
    ),
    Target(
        "history.claim.big", "claim at big history >= 90% of 10k", _ratio("history.claim.big"), 0.90
    ),
    Target(
        "memory.worker_rss_growth",
        "worker RSS growth <= 10%",
        _value("memory.worker_rss_growth"),
        0.10,
        at_least=False,
    ),
    Target(
        "memory.bulk_peak_growth",
        "bulk peak RSS (N vs N/10) growth <= 10%",
        _value("memory.bulk_peak_growth"),
        0.10,
        at_least=False,
    ),
]


def _targets(results: Results) -> list[dict[str, Any]]:
    rows = []
    for target in TARGETS:
        value = target.check(results)
        met = (
            None
            if value is None
            else (value >= target.threshold if target.at_least else value <= target.threshold)
        )
        rows.append({"metric": target.metric, "target": target.text, "value": value, "met": met})
    return rows


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "fraction":
        return f"{value * 100:+.1f}%"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def render(results: Results, machine: dict[str, Any]) -> str:
    lines = [
        (
            f"sqla_jobs bench: PostgreSQL {machine['server_version']} (fsync={machine['fsync']}, "
            f"synchronous_commit={machine['synchronous_commit']}), {machine['cpus']} CPUs, "
            f"Python {machine['python']}, medians of {machine['repeat']} runs"
        ),
        f"{'metric':<32} {'median':>12} {'unit':<9} {'ceiling':>12} {'ratio':>7}",
    ]
    for name in sorted(results.metrics, key=_order):
        metric = results.metrics[name]
        ceiling = results.median(metric.ceiling) if metric.ceiling else None
        ratio = results.ratio(name)
        lines.append(
            f"{name:<32} {_fmt(metric.median, metric.unit):>12} {metric.unit:<9} "
            f"{_fmt(ceiling):>12} {'-' if ratio is None else f'{ratio:.2f}':>7}"
        )
    for section, why in results.skipped.items():
        lines.append(f"{section}: skipped: {why}")
    lines.append("")
    lines.append("targets:")
    for row in _targets(results):
        verdict = {None: "not measured", True: "met", False: "NOT met"}[row["met"]]
        value = row["value"]
        lines.append(f"  {row['target']:<42} {_fmt(value):>10}  {verdict}")
    return "\n".join(lines)


def _order(name: str) -> tuple[int, str]:
    section = name.split(".")[0]
    order = {
        "ceiling": 0,
        "enqueue": 1,
        "drain": 2,
        "latency": 3,
        "history": 4,
        "memory": 5,
        "pgbouncer": 6,
        "async": 7,
    }
    if section == "async":  # per operation: its paths' rates, then their CPU per job
        operation, _, path = name.removeprefix("async.").rpartition(".")
        cpu = operation.startswith("cpu.")
        return order[
            section
        ], f"{operation.removeprefix('cpu.')}.{cpu:d}.{_ASYNC_PATHS.index(path)}"
    return order.get(section, 9), name


def _progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def _machine(engine: sa.Engine, cfg: Config, server: str) -> dict[str, Any]:
    with engine.connect() as connection:
        facts = connection.execute(bench_sql.server_facts()).one()._asdict()
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "sqlalchemy": sa.__version__,
        "psycopg": psycopg.__version__,
        "server": server,
        "repeat": cfg.repeat,
        **facts,
    }


# -- command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sqla-jobs bench",
        description="Measure sqla_jobs against the same statements run bare (see the docs).",
    )
    parser.add_argument("--database-url", help="a PostgreSQL server (default: embedded)")
    parser.add_argument("--json", metavar="PATH", help="write every raw number here")
    parser.add_argument("--repeat", type=int, help="runs per figure, medians (3)")
    parser.add_argument("--jobs", type=int, help="jobs per batched run (20000)")
    parser.add_argument("--single-jobs", type=int, help="jobs per one-per-claim run (jobs/10)")
    parser.add_argument("--history-rows", type=int, help="finished rows, big case (10000000)")
    parser.add_argument("--memory-jobs", type=int, help="jobs of the memory runs (1000000)")
    parser.add_argument("--batch", type=int, help="claim batch size (50)")
    parser.add_argument("--chunk", type=int, help="bulk enqueue chunk size (1000)")
    parser.add_argument("--latency-samples", type=int, help="wake-ups measured (200)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run (for tests)")
    parser.add_argument("--only", help=f"comma-separated sections of: {','.join(SECTIONS)}")
    return parser


_QUICK: Final[dict[str, Any]] = {
    "jobs": 300,
    "single_jobs": 30,
    "history_rows": 20_000,
    "memory_jobs": 3_000,
    "repeat": 1,
    "batch": 10,
    "chunk": 500,
    "latency_samples": 10,
}
_SIZES: Final = ("repeat", "jobs", "single_jobs", "history_rows", "memory_jobs", "batch", "chunk")


def _config(args: argparse.Namespace, url: str) -> Config:
    cfg = Config(url=url, **(_QUICK if args.quick else {}))
    if not args.quick:
        cfg.single_jobs = max((args.jobs or cfg.jobs) // 10, 1)
    for name in (*_SIZES, "latency_samples"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                raise _usage(f"--{name.replace('_', '-')} must be positive")
            setattr(cfg, name, value)
    if args.only:
        chosen = tuple(s.strip() for s in args.only.split(",") if s.strip())
        unknown = set(chosen) - set(SECTIONS)
        if unknown:
            raise _usage(f"unknown sections {sorted(unknown)}; of {SECTIONS}")
        cfg.sections = chosen
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table of medians, return 0.

    ``argv`` as for ``sqla-jobs bench`` (default: ``sys.argv[1:]``); bad arguments exit
    with status 2 (argparse's ``SystemExit``)."""
    args = _parser().parse_args(argv)
    _config(args, "postgresql://")  # bad arguments fail before a server starts
    with contextlib.ExitStack() as stack:
        if threading.current_thread() is threading.main_thread():
            # SIGTERM unwinds like Ctrl-C, so the scratch database and server go with us.
            previous = signal.signal(signal.SIGTERM, _terminate)
            stack.callback(signal.signal, signal.SIGTERM, previous)
        if args.database_url:
            # As every sqla-jobs command takes it: postgresql:// means psycopg 3.
            server_url = psycopg_url(args.database_url).render_as_string(hide_password=False)
            server = "url"
        else:
            embedded = EmbeddedPostgres()
            embedded.start()
            stack.callback(embedded.stop)
            server_url, server = embedded.url("postgres"), "embedded"
        url = _scratch_database(server_url, stack)
        cfg = _config(args, url)
        engine = _engine(url, pool_size=10)
        stack.callback(engine.dispose)
        metadata.create_all(engine)
        _PlainBase.metadata.create_all(engine)
        results = Results()
        machine = _machine(engine, cfg, server)
        _progress(f"bench on {machine['version'].split(',')[0]}, sections {','.join(cfg.sections)}")
        for _ in range(cfg.repeat):
            if {"ceiling", "drain"} & set(cfg.sections):
                run_drain(cfg, engine, results)
            if {"ceiling", "enqueue"} & set(cfg.sections):
                run_enqueue(cfg, engine, results)
            if "latency" in cfg.sections:
                run_latency(cfg, engine, results)
            if "pgbouncer" in cfg.sections:
                run_pgbouncer(cfg, engine, results)
            if "async" in cfg.sections:
                run_async(cfg, engine, results)
        if "history" in cfg.sections:
            run_history(cfg, engine, results)
        if "memory" in cfg.sections:
            run_memory(cfg, engine, results)
        print(render(results, machine))
        if args.json:
            _write_json(args.json, cfg, machine, results)
    return 0


def _scratch_database(server_url: str, stack: contextlib.ExitStack) -> str:
    name = f"sqla_jobs_bench_{secrets.token_hex(4)}"
    admin = _engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as connection:
        connection.execute(sa.text(bench_sql.create_database(name)))

    def drop() -> None:
        with admin.connect() as connection:
            connection.execute(sa.text(bench_sql.drop_database(name)))
        admin.dispose()

    stack.callback(drop)
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def _write_json(path: str, cfg: Config, machine: dict[str, Any], results: Results) -> None:
    config = asdict(cfg)
    config["url"] = make_url(cfg.url).render_as_string(hide_password=True)
    document = {
        "machine": machine,
        "config": config,
        "metrics": {
            name: {
                "unit": m.unit,
                "median": m.median,
                "runs": m.runs,
                "ceiling": m.ceiling,
                "ceiling_median": results.median(m.ceiling) if m.ceiling else None,
                "ratio": results.ratio(name),
                "higher_is_better": m.higher_is_better,
                **m.extra,
            }
            for name, m in results.metrics.items()
        },
        "targets": _targets(results),
        "skipped": results.skipped,
    }
    with open(path, "w") as out:
        json.dump(document, out, indent=2, default=str)


def _usage(message: str) -> SystemExit:
    _parser().print_usage(sys.stderr)
    print(f"sqla-jobs bench: error: {message}", file=sys.stderr)
    return SystemExit(2)


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
