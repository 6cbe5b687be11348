"""The dashboard's reads stay bounded on a large table: their plans, on a seeded one.

Every list read walks the primary key backwards from its cursor and reads at most its
window, whatever the filters, in the plan the driver gets first (custom) and in the one a
prepared statement settles on (generic); none scans the table or sorts it. The same reads
measured on 10M rows: ``python tests/dashboard_plans.py --database-url URL``
(docs/operations/dashboard.md, "The job list on a large table").
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from dashboard_plans import EMAIL_JOBS, explain, picture_reads, reads, seed, summary
from models import Base, EmailJob
from sqlalchemy.pool import NullPool

from sqla_jobs.naming import names

ROWS = 100_000
SCAN = 2_000  # small beside ROWS: a read that walked the table would show it
PAGE = 50


@pytest.fixture(scope="module")
def large_table(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(fresh_database("sqla_jobs_dashplan"), poolclass=NullPool)
    Base.metadata.create_all(engine)
    with engine.begin() as connection:
        seed(connection, EMAIL_JOBS, ROWS)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text(f"VACUUM ANALYZE {EmailJob.__tablename__}"))
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_every_read_is_bounded_by_its_window(large_table: sa.Engine, generic: bool) -> None:
    table = EMAIL_JOBS
    pkey = f"{table.name}_pkey"
    checked = []
    with large_table.begin() as connection:
        for read in reads(table, ROWS, scan=SCAN, page=PAGE):
            figures = summary(explain(connection, read, generic=generic))
            assert "Seq Scan" not in figures["nodes"], (read.name, figures)
            assert figures["indexes"] == [pkey], (read.name, figures)
            assert figures["scanned_rows"] <= SCAN, (read.name, figures)
            if read.name.startswith("list"):
                assert "Sort" not in figures["nodes"], (read.name, figures)
            checked.append(read.name)
    assert len(checked) == 9
    # The sparse read really is sparse here: a full window read, and the page not full.
    with large_table.begin() as connection:
        sparse = next(r for r in reads(table, ROWS, scan=SCAN, page=PAGE) if "rare" in r.name)
        assert summary(explain(connection, sparse, generic=generic))["scanned_rows"] == SCAN


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_the_pictures_read_a_window_and_the_dead_index(
    large_table: sa.Engine, generic: bool
) -> None:
    """The charts read one window of the primary key (at most SCAN rows, read once), the
    failures only the dead index and its rows (one job in 500 is dead here), never the
    table."""
    table = EMAIL_JOBS
    dead = ROWS // 500 + 1
    with large_table.begin() as connection:
        charts, failures = (
            summary(explain(connection, read, generic=generic))
            for read in picture_reads(table, scan=SCAN)
        )
    assert "Seq Scan" not in charts["nodes"], charts
    assert charts["indexes"] == [f"{table.name}_pkey"], charts
    assert charts["scanned_rows"] <= SCAN, charts
    assert "Seq Scan" not in failures["nodes"], failures
    assert failures["indexes"] == [names(table.name).dead_index], failures
    assert 0 < failures["scanned_rows"] <= dead, failures
