"""The claim uses the partial claim index, and its cost does not grow with history."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from models import EmailJob
from sqlalchemy.orm import Session

from sqla_jobs import names, statements


def _claim_plan(engine: sa.Engine, *, generic: bool) -> dict[str, Any]:
    table = EmailJob.__table__
    compiled = statements.claim(table, queue_count=1).compile(dialect=engine.dialect)  # type: ignore[arg-type]
    params = {"queue_name": "default", "limit": 10, "lease_seconds": 30.0, "worker": "w"}
    with engine.connect() as connection:
        transaction = connection.begin()
        cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
        if generic:
            # A prepared statement planned once for any parameters: the partial index must
            # still apply, which is why the claim spells its statuses as literals.
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + str(compiled), params, prepare=generic
        )
        raw = cursor.fetchone()[0]
        transaction.rollback()
    plan = raw if isinstance(raw, list) else json.loads(raw)
    return plan[0]  # type: ignore[no-any-return]


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found.extend(_nodes(child))
    return found


def test_claim_reads_the_partial_index_only(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        # 20k finished jobs of history and 50 runnable ones.
        session.execute(
            sa.text(
                "INSERT INTO email_jobs (task, status, finished_at) "
                "SELECT 'old', 'succeeded', now() FROM generate_series(1, 20000)"
            )
        )
        session.add_all([EmailJob(task="new", args={"i": i}) for i in range(50)])
    with queue_engine.connect() as connection:
        connection.execute(sa.text("ANALYZE email_jobs"))

    index = names("email_jobs").claim_index
    for generic in (False, True):
        plan = _claim_plan(queue_engine, generic=generic)
        nodes = _nodes(plan["Plan"])
        scans = [
            n for n in nodes if n.get("Relation Name") == "email_jobs" and "Scan" in n["Node Type"]
        ]
        claim_scan = [n for n in scans if n.get("Index Name") == index]
        assert claim_scan, f"claim did not use {index}: {[n['Node Type'] for n in nodes]}"
        assert not [n for n in nodes if n["Node Type"] in ("Seq Scan", "Sort")]
        # A handful of buffers, not the 20k-row history.
        assert claim_scan[0]["Shared Hit Blocks"] + claim_scan[0].get("Shared Read Blocks", 0) < 50
