"""Reading PostgreSQL's plans in tests: ``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`` of a
statement, and a walk over the plan's nodes.

The plan tests assert what a statement reads (which index, how many buffers, no sequential
scan), never how long it takes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import sqlalchemy as sa

EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``node`` and every node below it, depth first."""
    yield node
    for child in node.get("Plans", []):
        yield from plan_nodes(child)


def explain_statement(connection: sa.Connection, statement: sa.Executable) -> dict[str, Any]:
    """The plan of a SQLAlchemy statement with its bound values, run on ``connection``."""
    compiled = statement.compile(dialect=connection.dialect)  # type: ignore[attr-defined]
    (plan,) = connection.exec_driver_sql(EXPLAIN + str(compiled), compiled.params).scalar_one()
    return plan  # type: ignore[no-any-return]


def explain_sql(
    cursor: Any, sql: str, params: Mapping[str, Any], *, generic: bool
) -> dict[str, Any]:
    """The plan of ``sql`` on a psycopg cursor, PREPAREd when ``generic`` (so that, under
    ``plan_cache_mode = force_generic_plan``, it is the generic plan)."""
    cursor.execute(EXPLAIN + sql, params, prepare=generic)
    raw = cursor.fetchone()[0]
    return (raw if isinstance(raw, list) else json.loads(raw))[0]  # type: ignore[no-any-return]


def explain_rolled_back(
    engine: sa.Engine, sql: str, params: dict[str, Any], *, generic: bool
) -> dict[str, Any]:
    """The plan of ``sql`` (custom, or ``generic``), in a transaction that is rolled back."""
    with engine.connect() as connection:
        transaction = connection.begin()
        cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
        if generic:
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        plan = explain_sql(cursor, sql, params, generic=generic)
        transaction.rollback()
    return plan
