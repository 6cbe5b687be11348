"""Real :class:`~sqla_jobs.worker.Worker` processes for the bench, and a drain through them.

A drain: the workers start and wait idle (each ready once it listens), the jobs arrive in one
committed INSERT whose NOTIFY wakes them, and the rate is jobs / (last ``finished_at`` -
commit), both by the database's clock.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from sqla_jobs.bench import partitioned, scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.cpu import Meter, Usage
from sqla_jobs.bench.results import Config
from sqla_jobs.bench.tasks import Q_LATENCY, Q_LEASE, Q_LOCK, latency_registry, registry
from sqla_jobs.worker import Worker

__all__ = [
    "Drained",
    "WaitSampler",
    "measured_drain",
    "sample_until_drained",
    "worker_process",
    "workers",
]


def worker_process(
    url: str,
    which: str,
    concurrency: int,
    batch: int | None,
    listen_url: str | None,
    ready: Any,
    stop: Any,
    synchronous_commit: bool = True,
) -> None:
    """A worker on ``url`` (``batch`` None: the worker's default batch size); with
    ``listen_url``, ``url`` goes through PgBouncer: no prepared statements there, and LISTEN
    on ``listen_url``, a direct connection."""
    registry_ = latency_registry if which == "latency" else registry
    if which in partitioned.REGISTRIES:  # the partitioned history's drains
        registry_, queue = partitioned.REGISTRIES[which]
    else:
        queue = {"lease": Q_LEASE, "lock": Q_LOCK, "latency": Q_LATENCY}[which]
    pooled = {"connect_args": {"prepare_threshold": None}} if listen_url else {}
    engine = scratch.engine(url, pool_size=concurrency + 5, max_overflow=10, **pooled)
    listen_engine = scratch.engine(listen_url, poolclass=NullPool) if listen_url else None
    options: dict[str, Any] = {} if batch is None else {"batch_size": batch}
    worker = Worker(
        registry_,
        engine,
        queues=[queue],
        concurrency=concurrency,
        handle_signals=False,
        synchronous_commit=synchronous_commit,
        listen_engine=listen_engine,
        **options,
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
def workers(
    cfg: Config,
    which: str,
    procs: int,
    concurrency: int,
    batch: int | None,
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
            target=worker_process,
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


class Drained(NamedTuple):
    """A drain's rate (jobs/s), and its CPU: the worker processes' and the server's; with
    ``waits``, the server's wait events sampled during it (:class:`WaitSampler`)."""

    rate: float
    usage: Usage
    waits: dict[str, int] | None = None


class WaitSampler:
    """Samples, every ``every`` seconds on a thread of its own until :meth:`stop`, what the
    scratch database's backends in a transaction are doing (:func:`bench_sql.wait_events`):
    counts by ``"<state> <wait>"``, such as ``"active Lock:transactionid"`` (a row lock
    waited for), ``"active CPU"``, ``"idle in transaction Client:ClientRead"`` (the worker's
    own time inside a transaction)."""

    def __init__(self, engine: sa.Engine, every: float = 0.02) -> None:
        self.engine, self.every = engine, every
        self.counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        query = bench_sql.wait_events()
        with self.engine.connect() as connection:
            while not self._stop.wait(self.every):
                for state, wait, n in connection.execute(query):
                    key = f"{state} {wait}"
                    self.counts[key] = self.counts.get(key, 0) + int(n)
                connection.commit()

    def __enter__(self) -> WaitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)


def measured_drain(
    cfg: Config,
    engine: sa.Engine,
    mode: str,
    concurrency: int,
    procs: int,
    count: int,
    *,
    batch: int | None = None,
    on_sample: Callable[[list[int], float], None] | None = None,
    pooled_url: str | None = None,
    synchronous_commit: bool = True,
    waits: bool = False,
    task: str | None = None,
) -> Drained:
    """Drain ``count`` no-op jobs through ``procs`` worker processes of ``concurrency``
    (``batch`` None: the worker's default batch size): the rate, and the CPU the worker
    processes and the server used from the moment the jobs arrive to the last one's
    completion (:mod:`~sqla_jobs.bench.cpu`);
    ``waits``: and the server's wait events meanwhile (:class:`WaitSampler`); ``task``:
    jobs of this task of the bench's registry instead (one of ``mode``'s queue)."""
    queue = Q_LEASE if mode == "lease" else Q_LOCK
    if task is None:
        task = "bench_noop" if mode == "lease" else "bench_noop_lock"
    scratch.reset(engine)
    with workers(cfg, mode, procs, concurrency, batch, pooled_url, synchronous_commit) as pids:
        meter = Meter(engine, pids)
        meter.start()
        with contextlib.ExitStack() as sampling:
            sampler = sampling.enter_context(WaitSampler(engine)) if waits else None
            scratch.fill(engine, queue, task, count)
            committed = scratch.db_now(engine)
            if on_sample is not None:
                sample_until_drained(engine, queue, pids, on_sample)
            done, last = scratch.wait_drained(engine, queue, timeout=max(600.0, count / 100))
        usage = meter.stop()
    if done != count or last is None:
        raise RuntimeError(f"the workers completed {done} of {count} jobs")
    found = None if sampler is None else dict(sampler.counts)
    return Drained(done / (last - committed).total_seconds(), usage, found)


def sample_until_drained(
    engine: sa.Engine, queue: str, pids: list[int], on_sample: Callable[[list[int], float], None]
) -> None:
    """Call ``on_sample(pids, seconds since the start)`` every half second until the queue
    has no runnable job. Only the claim index's first entry is read: counting the finished
    rows of a large drain would cost the server more than the drain it measures."""
    started = time.monotonic()
    with engine.connect() as connection:
        while True:
            busy = connection.execute(bench_sql.has_runnable(scratch.TABLE), {"queue": queue})
            connection.commit()
            remaining = bool(busy.scalar_one())
            on_sample(pids, time.monotonic() - started)
            if not remaining:
                return
            time.sleep(0.5)
