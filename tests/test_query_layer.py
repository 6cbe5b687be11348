"""Where SQL is built and run: the query layer (sqla_jobs._queries), and only the modules
listed here, each with the reason it may (none of them on the queue's own tables). A scan of
the package's source, not a promise.

A module outside the layer that builds statements (imports SQLAlchemy's ``select``,
``update``, ``insert``, ``delete``, ``text``, ``func``, ...), runs them (calls
``execute``, ``exec_driver_sql``, ``scalar``, ``scalars``, ``scalar_one``) or runs the layer's
statements itself (imports ``built``, ``fetch`` or ``driver_sql`` of
``sqla_jobs._queries.run``, instead of calling a :class:`~sqla_jobs._queries.run.Query`) fails
here unless it is listed below; a listed module that no longer does any of these fails too,
until its entry goes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sqla_jobs

PACKAGE = Path(sqla_jobs.__file__).resolve().parent
BUILDERS = frozenset(
    {"select", "update", "insert", "delete", "text", "literal_column", "func", "table", "column"}
)
RUNNERS = frozenset({"execute", "exec_driver_sql", "scalar", "scalars", "scalar_one"})
#: The layer's own means of running a statement, which only a Query (inside it) uses.
LAYER_RUNNERS = frozenset({"built", "fetch", "driver_sql"})

#: Modules that build or run SQL, and not on the queue's tables: a tool's own tables, the
#: server's catalog, the tables' own definitions.
OUTSIDE_THE_QUEUE = {
    # The benchmark measures the simplest correct SQL on the simplest table it needs (the
    # ceilings), on tables of its own, and reads the server's settings.
    "bench/ceiling.py",
    "bench/cpu.py",
    "bench/enqueue.py",
    "bench/fair.py",
    "bench/history.py",
    "bench/keys.py",
    "bench/latency.py",
    "bench/memory.py",
    "bench/partitioned.py",
    "bench/probe.py",
    "bench/report.py",
    "bench/scratch.py",
    "bench/shape.py",
    "bench/statements.py",
    # A bench task that writes a row of the bench's own table (bench_write_lock).
    "bench/tasks.py",
    "bench/workers.py",
    "bench/workflows.py",
    # The demo's own orders table; the embedded server's CREATE DATABASE.
    "demo.py",
    "embedded.py",
    # Column defaults, index predicates and DDL events of the tables themselves.
    "schema/__init__.py",
    "schema/fair.py",
    "schema/history.py",
    "schema/leases.py",
    "schema/pauses.py",
    "schema/rates.py",
    "schema/workflows.py",
    # Alembic helpers: DDL through Alembic's operations and the catalog reads they check.
    "migrations/check.py",
    "migrations/steps.py",
    "migrations/tables.py",
}


def _touches_sql(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("sqlalchemy")
            and any(alias.name in BUILDERS for alias in node.names)
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "sqla_jobs._queries.run"
            and any(alias.name in LAYER_RUNNERS for alias in node.names)
        ):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in RUNNERS
        ):
            return True
    return False


def test_sql_is_built_and_run_only_in_the_query_layer_and_the_listed_modules() -> None:
    touching = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if not path.relative_to(PACKAGE).as_posix().startswith("_queries/") and _touches_sql(path)
    }
    assert not touching - OUTSIDE_THE_QUEUE, "build or run SQL in _queries"
    assert not OUTSIDE_THE_QUEUE - touching, "listed, but no longer touch SQL"
