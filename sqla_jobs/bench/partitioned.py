"""The benchmark's figures of the partitioned history (:mod:`sqla_jobs.history`).

* ``drain.lease.batched.1p.history``: the batched lease-mode drain of the ``drain``
  section on a model with ``partitioned_history`` (each completion moves its jobs into the
  history, in the completion statement), as a ratio to the plain drain of the same run.
* ``drain.lease.batched.1p.mover``: the alternative, measured the same way: completions
  update the jobs to ``succeeded`` as without a history, and a mover beside the worker
  moves finished rows into a history table in batches, continuously
  (:func:`sqla_jobs._queries.history.sweep`).
* ``drain.wal_per_job.nohist`` / ``.history`` / ``.mover``: the WAL bytes per job of the same
  drain without a history, moved in the completion, and moved by the mover (its work
  included): what each costs the server, which a shared machine's drift does not blur.
* ``history.partitioned.10k`` / ``.big`` (``history`` section): claim + complete throughput
  on the history model with 10k and with ``--history-rows`` rows already in its history
  (spread over ten day partitions).
* ``hot.*`` (``hot`` section): a steady flow of ``--memory-jobs`` jobs through a worker
  (enqueued 10k at a time as the worker drains them), on the history model and on the plain
  model: the size of the job table (heap and indexes) and its dead rows afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs._queries import history as history_sql
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.context import JobContext
from sqla_jobs.ddl import executable
from sqla_jobs.history import create_partitions, history_table
from sqla_jobs.queue import claim, complete_many
from sqla_jobs.registry import Registry
from sqla_jobs.schema import JobMixin
from sqla_jobs.schema.history import create_partition, partition_day

__all__ = [
    "REGISTRIES",
    "HistoryJob",
    "MoverJob",
    "metadata",
    "run_drains",
    "run_hot",
    "run_partitioned_history",
]

_LEASE_SECONDS: Final = 300.0
_Q_HIST: Final = "bench_hist"
_Q_MOVER: Final = "bench_mover"
_Q_HIST_CLAIM: Final = "bench_hist_claim"
_FLOW_CHUNK: Final = 10_000
_SWEEP_SCAN: Final = 10_000
_HISTORY_DAYS: Final = 10


class _Base(DeclarativeBase):
    pass


class HistoryJob(JobMixin, _Base):
    """The bench's model with a partitioned history."""

    __tablename__ = "sqla_jobs_bench_hist"
    partitioned_history = True


class MoverJob(JobMixin, _Base):
    """The bench's model for the mover alternative: completions update, a mover moves."""

    __tablename__ = "sqla_jobs_bench_mover"


class PlainJob(JobMixin, _Base):
    """The same drain without a history, for the WAL figure."""

    __tablename__ = "sqla_jobs_bench_nohist"


metadata = _Base.metadata
_HOT: Final[sa.Table] = HistoryJob.__table__  # type: ignore[assignment]
_MOVER: Final[sa.Table] = MoverJob.__table__  # type: ignore[assignment]
_PLAIN: Final[sa.Table] = PlainJob.__table__  # type: ignore[assignment]
_Q_PLAIN: Final = "bench_nohist"
_HOT_HISTORY: Final = history_table(HistoryJob)
_MOVER_HISTORY: Final = history_table(_MOVER)

history_registry = Registry(HistoryJob, default_lease=_LEASE_SECONDS)
mover_registry = Registry(MoverJob, default_lease=_LEASE_SECONDS)
plain_registry = Registry(PlainJob, default_lease=_LEASE_SECONDS)


@history_registry.task(queue=_Q_HIST)
def bench_noop(ctx: JobContext) -> None:
    """A no-op job of the history model."""


@mover_registry.task(queue=_Q_MOVER, name="bench_noop")
def bench_noop_mover(ctx: JobContext) -> None:
    """A no-op job of the mover model."""


@plain_registry.task(queue=_Q_PLAIN, name="bench_noop")
def bench_noop_plain(ctx: JobContext) -> None:
    """A no-op job of the model without a history."""


#: ``which`` -> (registry, queue), for the runner's worker processes.
REGISTRIES: Final[dict[str, tuple[Registry, str]]] = {
    "history": (history_registry, _Q_HIST),
    "mover": (mover_registry, _Q_MOVER),
    "nohist": (plain_registry, _Q_PLAIN),
}

#: The runner's worker processes: (which, concurrency, batch) -> context of their pids.
Workers = Callable[[str, int, int], AbstractContextManager[list[int]]]


def _reset(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        tables = (_HOT, _HOT_HISTORY, _MOVER, _MOVER_HISTORY, _PLAIN)
        connection.execute(sa.text(bench_sql.truncate(*tables)))
    create_partitions(engine, HistoryJob, days_ahead=1)
    with engine.begin() as connection:
        now: datetime = connection.execute(history_sql.database_now()).scalar_one()
        for offset in range(2):
            day = partition_day(now) + timedelta(days=offset)
            connection.execute(executable(create_partition(_MOVER.name, day)))


def _runnable(connection: sa.Connection, table: sa.Table, queue: str) -> bool:
    busy = connection.execute(bench_sql.has_runnable(table), {"queue": queue}).scalar_one()
    connection.commit()
    return bool(busy)


def _finished(
    connection: sa.Connection, tables: tuple[sa.Table, ...], queue: str
) -> tuple[int, datetime | None]:
    count, last = 0, None
    for table in tables:
        n, at = connection.execute(bench_sql.finished(table), {"queue": queue}).one()
        count += int(n)
        last = at if last is None or (at is not None and at > last) else last
    return count, last


def _sweep_until(engine: sa.Engine, stop: threading.Event, moved: list[int]) -> None:
    """The mover: sweep the mover table's windows, over and over, until ``stop``."""
    after = 0
    while not stop.is_set():
        with engine.begin() as connection:
            upto = connection.execute(
                history_sql.sweep_window(_MOVER), {"after": after, "scan": _SWEEP_SCAN}
            ).scalar_one()
            if upto is None:
                after = 0
                stop.wait(0.01)
                continue
            rows = connection.execute(history_sql.sweep(_MOVER), {"after": after, "upto": upto})
            moved[0] += len(rows.all())
        after = upto


def _wal(connection: sa.Connection) -> int:
    position = connection.execute(bench_sql.wal_position()).scalar_one()
    connection.commit()
    return int(position)


def _drain(
    engine: sa.Engine, workers: Workers, which: str, batch: int, count: int
) -> tuple[float, float]:
    """Jobs/s of one batched lease-mode drain of ``count`` jobs by one worker process (and
    the mover, for ``which="mover"``, whose moves the rate does not wait for), and the WAL
    bytes per job of the drain (the mover's included, once it has moved every job; the
    enqueue's not)."""
    table, tables = {
        "history": (_HOT, (_HOT_HISTORY,)),
        "mover": (_MOVER, (_MOVER, _MOVER_HISTORY)),
        "nohist": (_PLAIN, (_PLAIN,)),
    }[which]
    queue = REGISTRIES[which][1]
    _reset(engine)
    stop = threading.Event()
    moved = [0]
    mover = threading.Thread(target=_sweep_until, args=(engine, stop, moved), daemon=True)
    with workers(which, 2 * batch, batch), engine.connect() as connection:
        with engine.begin() as filling:
            filling.execute(
                bench_sql.fill(table), {"queue": queue, "task": "bench_noop", "count": count}
            )
        committed: datetime = connection.execute(bench_sql.database_clock()).scalar_one()
        connection.commit()
        wal = _wal(connection)
        if which == "mover":
            mover.start()
        deadline = time.monotonic() + max(600.0, count / 100)
        while _runnable(connection, table, queue):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {which} drain did not finish")
            time.sleep(0.02)
        if which == "mover":  # until the mover has moved them all
            while _finished(connection, (_MOVER,), queue)[0]:
                connection.commit()
                time.sleep(0.02)
        stop.set()
        if mover.is_alive():
            mover.join(60)
        wal = _wal(connection) - wal
        done, last = _finished(connection, tables, queue)
    if done != count or last is None:
        raise RuntimeError(f"the {which} drain finished {done} of {count} jobs")
    return done / (last - committed).total_seconds(), wal / count


def run_drains(cfg: Any, engine: sa.Engine, results: Any, workers: Workers) -> None:
    """``drain.lease.batched.1p.history`` and ``.mover`` (see the module docstring), and
    ``drain.wal_per_job.*``: the WAL bytes each job cost, without a history (``nohist``),
    moved in the completion (``history``) and moved by the mover (``mover``, its work
    included), each as a ratio to ``nohist``."""
    for which in ("nohist", "history", "mover"):
        rate, wal = _drain(engine, workers, which, cfg.batch, cfg.jobs)
        if which != "nohist":
            name = f"drain.lease.batched.1p.{which}"
            results.add(name, rate, "jobs/s", "drain.lease.batched.1p")
        ceiling = None if which == "nohist" else "drain.wal_per_job.nohist"
        results.add(f"drain.wal_per_job.{which}", wal, "bytes", ceiling)
        results.metrics[f"drain.wal_per_job.{which}"].higher_is_better = False


def _claim_throughput(engine: sa.Engine, batch: int, count: int) -> float:
    done = 0
    started = time.perf_counter()
    while True:
        with Session(engine) as session, session.begin():
            jobs = claim(
                session, HistoryJob, queues=_Q_HIST_CLAIM, limit=batch, lease=_LEASE_SECONDS
            )
        if not jobs:
            break
        with Session(engine) as session, session.begin():
            done += len(jobs) - len(complete_many(session, jobs))
    if done != count:
        raise RuntimeError(f"claimed and completed {done} of {count} jobs")
    return done / (time.perf_counter() - started)


def _vacuum(engine: sa.Engine, *tables: sa.Table) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        for table in tables:
            connection.execute(sa.text(bench_sql.vacuum_analyze(table)))


def run_partitioned_history(
    cfg: Any, engine: sa.Engine, results: Any, progress: Callable[[str], None]
) -> None:
    """``history.partitioned.10k`` and ``.big`` (see the module docstring)."""
    _reset(engine)
    with engine.begin() as connection:
        now: datetime = connection.execute(history_sql.database_now()).scalar_one()
        for offset in range(1, _HISTORY_DAYS + 1):
            day = partition_day(now) - timedelta(days=offset)
            connection.execute(executable(create_partition(_HOT.name, day)))
    have = 0
    for label, rows in (("10k", 10_000), ("big", max(cfg.history_rows, 10_000))):
        started = time.perf_counter()
        while have < rows:
            step = min(1_000_000, rows - have)
            with engine.begin() as connection:
                connection.execute(
                    bench_sql.fill_history(_HOT_HISTORY),
                    {"first": have + 1, "last": have + step, "queue": "bench_history",
                     "days": _HISTORY_DAYS},
                )  # fmt: skip
            have += step
        _vacuum(engine, _HOT, _HOT_HISTORY)
        setup = time.perf_counter() - started
        name = f"history.partitioned.{label}"
        for _ in range(cfg.repeat):
            with engine.begin() as connection:
                connection.execute(
                    bench_sql.fill(_HOT),
                    {"queue": _Q_HIST_CLAIM, "task": "bench_noop", "count": cfg.jobs},
                )
            results.add(name, _claim_throughput(engine, cfg.batch, cfg.jobs), "jobs/s",
                        "history.partitioned.10k")  # fmt: skip
            with engine.begin() as connection:
                connection.execute(bench_sql.delete_queue(_HOT_HISTORY), {"queue": _Q_HIST_CLAIM})
            _vacuum(engine, _HOT)
        results.metrics[name].extra.update(history_rows=rows, setup_seconds=round(setup, 1))
        progress(f"partitioned history {rows} rows")
    results.metrics["history.partitioned.10k"].ceiling = None


def _flow(engine: sa.Engine, table: sa.Table, queue: str, count: int) -> None:
    """Enqueue ``count`` jobs 10k at a time, each chunk once the last one has drained."""
    sent = 0
    with engine.connect() as connection:
        while sent < count:
            step = min(_FLOW_CHUNK, count - sent)
            connection.execute(
                bench_sql.fill(table), {"queue": queue, "task": "bench_noop", "count": step}
            )
            connection.commit()
            sent += step
            deadline = time.monotonic() + 600
            while _runnable(connection, table, queue):
                if time.monotonic() > deadline:
                    raise RuntimeError("the flow did not drain")
                time.sleep(0.02)


def _size(engine: sa.Engine, table: sa.Table) -> dict[str, int]:
    with engine.connect() as connection:
        row = connection.execute(bench_sql.table_size(table)).one()
    return {key: int(value) for key, value in row._asdict().items()}


def run_hot(
    cfg: Any,
    engine: sa.Engine,
    results: Any,
    workers: Workers,
    plain: tuple[sa.Table, str, str],
    progress: Callable[[str], None],
) -> None:
    """``hot.*`` (see the module docstring); ``plain`` is the plain model's table, its
    worker kind and its queue, from the runner."""
    plain_table, plain_which, plain_queue = plain
    runs = (("history", _HOT, "history", _Q_HIST), ("plain", plain_table, plain_which, plain_queue))
    for label, table, which, queue in runs:
        _reset(engine)
        with engine.begin() as connection:
            connection.execute(sa.text(bench_sql.truncate(table)))
        started = time.perf_counter()
        with workers(which, 2 * cfg.batch, cfg.batch):
            _flow(engine, table, queue, cfg.memory_jobs)
        elapsed = time.perf_counter() - started
        # The worker processes have exited: their statistics are flushed.
        size = _size(engine, table)
        results.add(f"hot.{label}.total_mib", size["total_bytes"] / 2**20, "MiB")
        results.add(f"hot.{label}.heap_mib", size["heap_bytes"] / 2**20, "MiB")
        results.add(f"hot.{label}.dead_rows", size["dead_rows"], "rows")
        results.add(f"hot.{label}.live_rows", size["live_rows"], "rows")
        results.add(f"hot.{label}.rate", cfg.memory_jobs / elapsed, "jobs/s")
        for key in ("total_mib", "heap_mib", "dead_rows", "live_rows"):
            results.metrics[f"hot.{label}.{key}"].higher_is_better = False
        progress(f"hot table, {label}: {size}")
