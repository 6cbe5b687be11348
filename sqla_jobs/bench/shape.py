"""The ``shape`` section: what each part of the library's job table costs the ceiling's loop.

The ceiling's lease loop (:func:`~sqla_jobs.bench.ceiling.seed_loop`, one process, batch
``max(--sweep)``) drains no-op jobs from copies of the library's job table, each in a schema
of its own (``sqla_jobs_bench_shape_<variant>``): the whole table (``shape.library``), and
the table without one of its parts at a time (``shape.without_<part>``): each index that the
loop's claim does not read (the running, keyed, key, unique and dead indexes) and its check
constraints. The seed table's drain (``shape.seed``: ten columns, one index) closes the
range. Each figure is against ``shape.library`` in the same round, rate and server CPU per
job, so a part's cost is the ratio's distance from 1.

A copy has the library table's columns, defaults, constraints and indexes (with their
names, in its own schema), but not its NOTIFY trigger, which fires only on the INSERT of
the jobs, before the drain's clock starts. The variants run in a rotating order, so that
none is always first in a round.
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa

from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.ceiling import add_drain, seed_drain, table_named
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.naming import names

__all__ = ["VARIANTS", "run_shape"]

_N: Final = names(scratch.TABLE.name)
#: Each variant, by name, and what is dropped from its copy: indexes and constraints of the
#: library's table, by their names.
VARIANTS: Final[dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "library": ((), ()),
    "without_running_index": ((_N.running_index,), ()),
    "without_keyed_pending_index": ((_N.keyed_pending_index,), ()),
    "without_key_index": ((_N.key_index,), ()),
    "without_unique_index": ((_N.unique_index,), ()),
    "without_dead_index": ((_N.dead_index,), ()),
    "without_checks": ((), (_N.attempts_check, _N.priority_check, _N.status_check)),
}


def _schema(variant: str) -> str:
    return f"sqla_jobs_bench_shape_{variant}"


def _create(engine: sa.Engine) -> None:
    """Each variant's schema and its copy of the library's table, without what it drops."""
    with engine.begin() as connection:
        for variant, (indexes, checks) in VARIANTS.items():
            schema = _schema(variant)
            connection.execute(sa.text(bench_sql.create_schema(schema)))
            copy = table_named(schema)
            copy.create(connection)
            for index in indexes:
                connection.execute(sa.text(bench_sql.drop_index(index, schema)))
            for check in checks:
                connection.execute(sa.text(bench_sql.drop_constraint(copy, check)))


def _drop(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        for variant in VARIANTS:
            connection.execute(sa.text(bench_sql.drop_schema(_schema(variant))))


def run_shape(cfg: Config, engine: sa.Engine, results: Results, turn: int) -> None:
    """One round: every variant's drain and the seed table's, the order rotated by
    ``turn``, each against ``shape.library``."""
    batch = max(cfg.sweep)
    runs = [*VARIANTS, "seed"]
    shift = turn % len(runs)
    _create(engine)
    try:
        drains = {
            variant: seed_drain(
                cfg, engine, "lease", batch, 1, "seed" if variant == "seed" else _schema(variant)
            )
            for variant in runs[shift:] + runs[:shift]
        }
    finally:
        _drop(engine)
    for variant in runs:
        name = f"shape.{variant}"
        add_drain(results, name, drains[variant], None if variant == "library" else "shape.library")
        results.metrics[name].extra["batch"] = batch
    scratch.progress("shape")
