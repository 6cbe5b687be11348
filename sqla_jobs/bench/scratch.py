"""The bench's scratch database: create it, reset and fill its job table, watch a drain.

Every statement comes from :mod:`sqla_jobs.bench.statements` (or the queue's own
:mod:`sqla_jobs._queries`); this module only runs them.
"""

from __future__ import annotations

import contextlib
import resource
import secrets
import sys
import time
from datetime import datetime
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.tasks import LEASE_SECONDS
from sqla_jobs.models import Job, JobResult
from sqla_jobs.queue import claim, complete_many

__all__ = [
    "RESULTS",
    "TABLE",
    "claim_cycle",
    "count_rows",
    "db_now",
    "drain",
    "engine",
    "fill",
    "peak_rss",
    "progress",
    "reset",
    "rss",
    "scratch_database",
    "sql",
    "vacuum",
    "wait_drained",
]

TABLE: Final[sa.Table] = Job.__table__  # type: ignore[assignment]
RESULTS: Final[sa.Table] = JobResult.__table__  # type: ignore[assignment]


def sql(stmt: sa.ClauseElement) -> str:
    """The SQL text psycopg runs for a statement (``%(name)s`` parameters)."""
    return str(stmt.compile(dialect=psycopg_dialect.dialect()))  # type: ignore[no-untyped-call]


def engine(url: str, **kwargs: Any) -> sa.Engine:
    return sa.create_engine(url, **kwargs)


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def rss(pid: int | None = None) -> int | None:
    """Resident set size in bytes, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def count_rows(engine: sa.Engine, table: sa.Table) -> int:
    """How many rows ``table`` holds (a small one: it is read whole)."""
    with engine.connect() as connection:
        return int(connection.execute(bench_sql.row_count(table)).scalar_one())


def reset(engine: sa.Engine, *tables: sa.Table) -> None:
    """Empty ``tables`` (by default the library's job and result tables)."""
    with engine.begin() as connection:
        connection.execute(sa.text(bench_sql.truncate(*(tables or (TABLE, RESULTS)))))


def fill(
    engine: sa.Engine,
    queue: str,
    task: str,
    count: int,
    *,
    finished: bool = False,
    table: sa.Table = TABLE,
) -> None:
    """``count`` jobs of ``task`` in ``queue`` of ``table`` (by default the library's)."""
    stmt = bench_sql.fill(table, finished=finished)
    with engine.begin() as connection:
        connection.execute(stmt, {"queue": queue, "task": task, "count": count})


def vacuum(engine: sa.Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text(bench_sql.vacuum_analyze(TABLE)))


def db_now(engine: sa.Engine) -> datetime:
    with engine.connect() as connection:
        value: datetime = connection.execute(bench_sql.database_clock()).scalar_one()
        return value


def wait_drained(engine: sa.Engine, queue: str, timeout: float) -> tuple[int, datetime | None]:
    """Wait until ``queue`` has no runnable job; how many succeeded, and the last one when."""
    deadline = time.monotonic() + timeout
    with engine.connect() as connection:
        while time.monotonic() < deadline:
            busy = connection.execute(bench_sql.has_runnable(TABLE), {"queue": queue})
            connection.commit()
            if not busy.scalar_one():
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"queue {queue} did not drain within {timeout:.0f}s")
        count, last = connection.execute(bench_sql.finished(TABLE), {"queue": queue}).one()
        return int(count), last


def scratch_database(server_url: str, stack: contextlib.ExitStack) -> str:
    """Create ``sqla_jobs_bench_<hex>`` on the server, dropped when ``stack`` closes; its URL."""
    name = f"sqla_jobs_bench_{secrets.token_hex(4)}"
    admin = engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as connection:
        connection.execute(sa.text(bench_sql.create_database(name)))

    def drop() -> None:
        with admin.connect() as connection:
            connection.execute(sa.text(bench_sql.drop_database(name)))
        admin.dispose()

    stack.callback(drop)
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def claim_cycle(
    connection: sa.Connection, model: type[Any], queue: str, batch: int, **options: Any
) -> tuple[int, int]:
    """A claim of ``batch`` jobs of ``queue`` (``options``: the claim's other arguments,
    such as ``fair_shares``) and the ``complete_many`` of what it took, a transaction each
    on ``connection``: how many it claimed and how many it completed."""
    with connection.begin():
        jobs = claim(connection, model, queues=queue, limit=batch, lease=LEASE_SECONDS, **options)
    if not jobs:
        return 0, 0
    with connection.begin():
        return len(jobs), len(jobs) - len(complete_many(connection, jobs))


def drain(
    engine: sa.Engine, model: type[Any], queue: str, batch: int, count: int, **options: Any
) -> float:
    """:func:`claim_cycle` on one Core connection until a claim comes back empty: jobs/s
    (RuntimeError unless all ``count`` were done)."""
    done = 0
    with engine.connect() as connection:
        started = time.perf_counter()
        while True:
            claimed, completed = claim_cycle(connection, model, queue, batch, **options)
            if not claimed:
                break
            done += completed
        elapsed = time.perf_counter() - started
    if done != count:
        raise RuntimeError(f"claimed and completed {done} of {count} jobs")
    return done / elapsed
