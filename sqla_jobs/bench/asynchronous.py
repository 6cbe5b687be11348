"""The ``async`` section: runs :mod:`sqla_jobs.bench.drivers`' paths side by side."""

from __future__ import annotations

import importlib.util
import itertools
from typing import TYPE_CHECKING, Final

import sqlalchemy as sa

from sqla_jobs.bench import scratch
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import LEASE_SECONDS, Q_ASYNC

if TYPE_CHECKING:
    from sqla_jobs.bench.drivers import Rate

__all__ = ["ASYNC_PATHS", "run_async"]

_ASYNC_ROUNDS: Final = itertools.count()
# drivers.PATHS, which this module cannot import without greenlet.
ASYNC_PATHS: Final = ("connection", "session", "psycopg", "asyncpg")


def run_async(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """The ``async`` section (:mod:`sqla_jobs.bench.drivers`): enqueue and claim + complete
    through :mod:`sqla_jobs.aio` on psycopg and on asyncpg, beside the sync paths."""
    if importlib.util.find_spec("asyncpg") is None:
        scratch.progress(
            'async: skipped, asyncpg is not installed (pip install "sqla-jobs[asyncpg]")'
        )
        return
    try:
        from sqla_jobs.bench import drivers
    except ImportError as exc:  # no greenlet: sqla_jobs.aio names the extra
        scratch.progress(f"async: skipped, {exc}")
        return

    rotation = next(_ASYNC_ROUNDS)
    paths = drivers.Paths(cfg.url, lease=LEASE_SECONDS)
    try:
        # Warm every path (connections, prepared statements) on a few jobs, untimed.
        for path in drivers.PATHS:
            scratch.fill(engine, Q_ASYNC, "bench_noop", 10)
            paths.cycles(path, Q_ASYNC, 2, 10)
        enqueueing = drivers.PATHS[1:]
        for path in drivers.rotated(enqueueing, rotation):
            scratch.reset(engine)
            _add_rate(results, "add_all", path, paths.add_all(path, Q_ASYNC, cfg.jobs))
        for path in drivers.rotated(enqueueing, rotation):
            scratch.reset(engine)
            rate = paths.enqueue_many(path, Q_ASYNC, cfg.jobs, cfg.chunk)
            _add_rate(results, "enqueue_many", path, rate)
        for kind, batch, count in (
            ("single", 1, cfg.single_jobs),
            ("batched", cfg.batch, cfg.jobs),
        ):
            for path in drivers.rotated(drivers.PATHS, rotation):
                scratch.reset(engine)
                scratch.fill(engine, Q_ASYNC, "bench_noop", count)
                rate = paths.cycles(path, Q_ASYNC, batch, count)
                _add_rate(results, f"cycle.{kind}", path, rate)
    finally:
        paths.close()
    scratch.progress("async (psycopg and asyncpg)")


def _add_rate(results: Results, operation: str, path: str, rate: Rate) -> None:
    """``async.<operation>.<path>`` in jobs/s, and ``async.cpu.<operation>.<path>``, the
    bench process's CPU per job (lower is better), each beside the path before it."""
    name, cpu = f"async.{operation}.{path}", f"async.cpu.{operation}.{path}"
    before = _before(operation, path)
    results.add(name, rate.per_second, "jobs/s", before)
    ceiling = before and before.replace(".", ".cpu.", 1)
    results.add_cpu(cpu, rate.cpu_us_per_job, ceiling)


def _before(operation: str, path: str) -> str | None:
    """The figure a path's is compared with: the path before it (enqueueing has no
    ``connection`` path)."""
    index = ASYNC_PATHS.index(path)
    if index == 0 or (index == 1 and operation in ("add_all", "enqueue_many")):
        return None
    return f"async.{operation}.{ASYNC_PATHS[index - 1]}"
