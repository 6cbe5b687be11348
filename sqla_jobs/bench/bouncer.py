"""The ``pgbouncer`` section: lease-mode drains through PgBouncer in transaction mode,
each beside the same drain direct."""

from __future__ import annotations

import itertools
from typing import Final

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from sqla_jobs.bench import scratch
from sqla_jobs.bench.drain import drain_name
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.workers import measured_drain
from sqla_jobs.pgbouncer import PgBouncer, find_binary

__all__ = ["run_pgbouncer"]

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
        scratch.progress(f"pgbouncer skipped: {results.skipped['pgbouncer']}")
        return
    database = make_url(cfg.url).database
    assert database is not None
    # Alternate which goes first between repeats, so neither gets the warmer machine.
    pooled_first = next(_PGBOUNCER_ROUNDS) % 2 == 1
    with PgBouncer(cfg.url) as bouncer:
        pooled_url = bouncer.url(database)
        for batch_kind, procs in _PGBOUNCER_DRAINS:
            slots, count = (
                (cfg.concurrency, cfg.jobs) if batch_kind == "batched" else (1, cfg.single_jobs)
            )
            direct = drain_name("pgbouncer.direct", "lease", batch_kind, procs)
            for via in (pooled_url, None) if pooled_first else (None, pooled_url):
                value = measured_drain(
                    cfg, engine, "lease", slots, procs, count, pooled_url=via
                ).rate
                if via is None:
                    results.add(direct, value, "jobs/s")
                else:
                    name = drain_name("pgbouncer.drain", "lease", batch_kind, procs)
                    results.add(name, value, "jobs/s", direct)
            scratch.progress(f"pgbouncer {batch_kind} {procs}p")
