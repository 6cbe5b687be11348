"""A large seeded job table and the plans of the dashboard's reads on it.

Used by tests/test_dashboard_plan.py (a small table, checking the plans' shape) and run as a
script to measure on a large one::

    python tests/dashboard_plans.py --rows 10000000 \
        --database-url postgresql+psycopg://postgres@127.0.0.1/postgres

(the script creates a database of its own, seeds it, prints each read's plan figures, and
drops the database unless ``--keep``).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

# Run as a script, this file's folder is first on sys.path, as under pytest.
import models
import psycopg.sql
import sqlalchemy as sa
from plans import plan_nodes
from sqlalchemy.dialects.postgresql import asyncpg as asyncpg_dialect
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from sqla_jobs._queries import dashboard as statements
from sqla_jobs.schema import JobStatus

EMAIL_JOBS = cast(sa.Table, models.EmailJob.__table__)
RARE_EVERY = 10_007  # one job in this many has the task "rare"


def seed(connection: sa.Connection, table: sa.Table, rows: int) -> None:
    """``rows`` jobs, oldest first: five queues, twenty tasks (and a rare one), mostly
    succeeded, one in 500 dead, one in 997 cancelled, the newest 1,000 pending, a few
    running. Then VACUUM ANALYZE (run it on a connection in autocommit mode)."""
    name = table.name
    connection.execute(
        sa.text(
            f"""
            INSERT INTO {name} (queue, task, args, status, attempts, max_attempts, run_at,
                                created_at, finished_at, last_error)
            SELECT 'q' || (g % 5),
                   CASE WHEN g % {RARE_EVERY} = 0 THEN 'rare' ELSE 'task_' || (g % 20) END,
                   jsonb_build_object('n', g),
                   s.status,
                   CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
                   3,
                   t.created,
                   t.created,
                   CASE WHEN s.status IN ('succeeded', 'dead', 'cancelled')
                        THEN t.created + interval '1 second' END,
                   CASE WHEN s.status = 'dead' THEN 'Traceback ...\nValueError: ' || g END
            FROM generate_series(1, :rows) AS g,
                 LATERAL (SELECT now() - (:rows - g) * interval '100 milliseconds') AS t(created),
                 LATERAL (SELECT CASE
                     WHEN g > :rows - 1000 THEN 'pending'
                     WHEN g % 100003 = 0 THEN 'running'
                     WHEN g % 500 = 0 THEN 'dead'
                     WHEN g % 997 = 0 THEN 'cancelled'
                     ELSE 'succeeded' END) AS s(status)
            """
        ),
        {"rows": rows},
    )


@dataclass(frozen=True)
class Read:
    """One read of the dashboard: its name, statement and parameters."""

    name: str
    statement: Any
    params: dict[str, Any]


def reads(table: sa.Table, rows: int, *, scan: int, page: int) -> Iterator[Read]:
    """The dashboard's reads, as a person paging through a large table makes them."""
    top = statements.MAX_ID
    middle = rows // 2

    def page_of(status: JobStatus | None, queue: str | None, task: str | None) -> Any:
        return statements.job_page(
            table,
            status=status,
            queue=queue is not None,
            task=task is not None,
            scan=scan,
            limit=page + 1,
        )

    yield Read("list, no filter", page_of(None, None, None), {"before": top})
    yield Read("list, no filter, middle", page_of(None, None, None), {"before": middle})
    yield Read("list, status=dead", page_of(JobStatus.DEAD, None, None), {"before": top})
    yield Read("list, status=pending", page_of(JobStatus.PENDING, None, None), {"before": top})
    yield Read(
        "list, task=rare (sparse)", page_of(None, None, "rare"), {"before": top, "task": "rare"}
    )
    yield Read(
        "list, queue+task+status, middle",
        page_of(JobStatus.SUCCEEDED, "q3", "task_3"),
        {"before": middle, "queue": "q3", "task": "task_3"},
    )
    yield Read(
        "next window's cursor", statements.window_floor(table, scan=scan), {"before": middle}
    )
    yield Read("recent throughput", statements.recent_throughput(table, scan=scan), {"before": top})
    yield Read("a job's record", statements.job(table), {"job_id": middle})


def picture_reads(table: sa.Table, *, scan: int) -> Iterator[Read]:
    """The reads of the dashboard's pictures (/activity, /failures)."""
    yield Read(
        "minute counts (charts)",
        statements.minute_counts(table, scan=scan),
        {"before": statements.MAX_ID},
    )
    yield Read("failures by task and error", statements.failures(table, scan=scan), {})


def explain(connection: sa.Connection, read: Read, *, generic: bool) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the read: as the driver sends it (a custom plan), or
    ``generic``: PREPAREd with ``plan_cache_mode = force_generic_plan`` (the plan a pooled
    connection reuses once psycopg prepares the statement)."""
    dialect = asyncpg_dialect.dialect()  # type: ignore[no-untyped-call]  # $1 parameters
    compiled = read.statement.compile(dialect=dialect)
    values = [read.params[name] for name in compiled.positiontup]
    name = f"dash_{secrets.token_hex(4)}"
    driver = connection.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cursor:
        cursor.execute(f"SET LOCAL plan_cache_mode = {'force_generic_plan' if generic else 'auto'}")
        cursor.execute(f"PREPARE {name} AS {compiled}")
        # EXECUTE takes no bind parameters: the values go in as quoted literals.
        args = ", ".join(psycopg.sql.Literal(value).as_string(driver) for value in values)
        execute = f"EXECUTE {name}({args})" if values else f"EXECUTE {name}"
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {execute}")
        row = cursor.fetchone()
        cursor.execute(f"DEALLOCATE {name}")
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    result: dict[str, Any] = document[0]
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures that show how much a plan read: its node types, the most rows any scan
    node produced, the buffers it touched, and its execution time."""
    nodes = list(plan_nodes(result["Plan"]))
    top = result["Plan"]
    return {
        "nodes": [node["Node Type"] for node in nodes],
        "indexes": sorted({node["Index Name"] for node in nodes if "Index Name" in node}),
        "scanned_rows": max(
            (node["Actual Rows"] * node.get("Actual Loops", 1))
            for node in nodes
            if "Scan" in node["Node Type"]
        ),
        "buffers": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
        "ms": result["Execution Time"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", required=True, help="a server's maintenance database")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--scan", type=int, default=20_000)
    parser.add_argument("--page", type=int, default=50)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    admin = sa.create_engine(args.database_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    name = f"sqla_jobs_dashplan_{secrets.token_hex(4)}"
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine = sa.create_engine(make_url(args.database_url).set(database=name), poolclass=NullPool)
    table = EMAIL_JOBS
    try:
        models.Base.metadata.create_all(engine)
        started = time.monotonic()
        with engine.begin() as connection:
            seed(connection, table, args.rows)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(sa.text(f"VACUUM ANALYZE {table.name}"))
        print(f"seeded {args.rows} jobs in {time.monotonic() - started:.0f} s", flush=True)
        with engine.begin() as connection:
            size = connection.execute(
                sa.text(f"SELECT pg_size_pretty(pg_total_relation_size('{table.name}'))")
            ).scalar()
            print(f"table with indexes: {size}")
            every = [
                *reads(table, args.rows, scan=args.scan, page=args.page),
                *picture_reads(table, scan=args.scan),
            ]
            for read in every:
                for generic in (False, True):
                    explain(connection, read, generic=generic)  # warm the cache
                    figures = summary(explain(connection, read, generic=generic))
                    kind = "generic" if generic else "custom"
                    print(
                        f"{read.name:34} {kind:7} {figures['ms']:8.2f} ms  "
                        f"rows read {figures['scanned_rows']:6}  buffers {figures['buffers']:6}  "
                        f"{' > '.join(figures['nodes'])}  {','.join(figures['indexes'])}"
                    )
            started = time.monotonic()
            connection.execute(sa.text("SELECT 1"))
            from sqla_jobs import queue

            queue.queue_stats(connection, models.EmailJob)
            print(
                f"queue_stats (the overview's counts): {(time.monotonic() - started) * 1000:.0f} ms"
            )
    finally:
        engine.dispose()
        if not args.keep:
            with admin.connect() as connection:
                connection.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
