"""The fair claim's plan stays flat: its two statements read a few index pages per tenant
served, whatever the backlog of the biggest tenant or the finished history (buffers, not
milliseconds, asserted, as in tests/test_plan.py)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from models import TenantJob
from plans import explain_rolled_back, plan_nodes

from sqla_jobs import names
from sqla_jobs._queries.fair import claim_fair, fair_tenants
from sqla_jobs.schema.fair import fair_index_name

BACKLOG = 50_000
HISTORY = 50_000
SMALL = 50
TABLE: sa.Table = TenantJob.__table__  # type: ignore[assignment]
FAIR_INDEX = fair_index_name("tenant_jobs", "tenant")
N = names("tenant_jobs")


#: The most buffers a statement may read per tenant it serves: a few index pages and the rows
#: it locks (measured on PostgreSQL 15: some 3 a tenant for the scan, 15 for the claim),
#: none for reading the backlog (the bad plan read 54,362 for a claim of 50).
SCAN_PAGES_PER_TENANT = 8
CLAIM_PAGES_PER_TENANT = 30
#: What the two statements may scan: the fair index, and the claim's expired leases (the
#: running index), its rows by primary key, the pause table's.
ALLOWED = {FAIR_INDEX, N.running_index, "tenant_jobs_pkey", "tenant_jobs_pauses_pkey"}


def seed(engine: sa.Engine, *, stale: bool) -> None:
    """A finished history, one tenant's backlog, then SMALL tenants with 10 jobs each;
    vacuumed and analyzed. ``stale``: analyzed before the small tenants came, as when one
    tenant had the queue to itself until the statistics were taken."""

    def insert(sql: str, **params: Any) -> None:
        with engine.begin() as connection:
            connection.execute(sa.text("ALTER TABLE tenant_jobs DISABLE TRIGGER USER"))
            connection.execute(sa.text(sql), params)
            connection.execute(sa.text("ALTER TABLE tenant_jobs ENABLE TRIGGER USER"))

    def analyze() -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(sa.text("VACUUM ANALYZE tenant_jobs"))

    insert(
        "INSERT INTO tenant_jobs (queue, task, tenant, status, finished_at) "
        "SELECT 'default', 'old', 'big', 'succeeded', now() FROM generate_series(1, :n)",
        n=HISTORY,
    )
    insert(
        "INSERT INTO tenant_jobs (queue, task, tenant) "
        "SELECT 'default', 'new', 'big' FROM generate_series(1, :n)",
        n=BACKLOG,
    )
    if stale:
        analyze()
    insert(
        "INSERT INTO tenant_jobs (queue, task, tenant) "
        "SELECT 'default', 'new', 's' || lpad(CAST(n % :small AS text), 2, '0') "
        "FROM generate_series(1, :small * 10) AS n",
        small=SMALL,
    )
    if not stale:
        analyze()


def plan_of(engine: sa.Engine, statement: Any, params: dict[str, Any], *, generic: bool) -> Any:
    compiled = statement.compile(dialect=engine.dialect)
    return explain_rolled_back(engine, str(compiled), params, generic=generic)


def reads(plan: dict[str, Any]) -> tuple[int, set[str]]:
    """The plan's shared buffers in all, and the relations it scans (indexes by name, the
    table itself when it is scanned whole)."""
    top = plan["Plan"]
    scanned = set()
    for node in plan_nodes(top):
        if "Index Name" in node:
            scanned.add(node["Index Name"])
        elif node["Node Type"] == "Seq Scan":
            scanned.add(node["Relation Name"])
    return top["Shared Hit Blocks"] + top["Shared Read Blocks"], scanned


CASES = pytest.mark.parametrize(
    ("stale", "generic"),
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["custom", "generic", "stale-custom", "stale-generic"],
)


@CASES
def test_the_tenants_scan_reads_a_few_pages_per_tenant(
    queue_engine: sa.Engine, stale: bool, generic: bool
) -> None:
    seed(queue_engine, stale=stale)
    params = {"queue_name": "default", "after": None, "mode": 0, "most": 50, "cap": 114}
    statement = fair_tenants(TABLE, column="tenant")
    buffers, scanned = reads(plan_of(queue_engine, statement, params, generic=generic))
    assert scanned <= ALLOWED
    assert buffers <= SCAN_PAGES_PER_TENANT * 50


@CASES
def test_the_fair_claim_reads_a_few_pages_per_tenant(
    queue_engine: sa.Engine, stale: bool, generic: bool
) -> None:
    """Fifty tenants, the backlog's one of them: each reads its share (one job) from the
    fair index, never through the pending index filtered by tenant (which stale statistics
    once made PostgreSQL 15 choose, custom plan or generic: every small tenant read the
    backlog; PostgreSQL 18 did not)."""
    seed(queue_engine, stale=stale)
    tenants = ["big", *(f"s{n:02d}" for n in range(SMALL - 1))]
    params = {
        "queue_name": "default",
        "tenants": tenants,
        "weights": [1] * len(tenants),
        "limit": 50,
        "lease_seconds": 30.0,
        "worker": "w",
    }
    statement = claim_fair(TABLE, column="tenant")
    buffers, scanned = reads(plan_of(queue_engine, statement, params, generic=generic))
    assert scanned <= ALLOWED
    assert buffers <= CLAIM_PAGES_PER_TENANT * len(tenants)
