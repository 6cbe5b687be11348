"""The steps the schema versions' helpers are made of: run a DDL statement, add or drop
nullable columns, create or drop a partial index (concurrently or not)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from sqla_jobs import ddl


def _execute(sql: str) -> None:
    op.execute(ddl.executable(sql))


def _unattached_partitions(table: str, index: str) -> list[str]:
    # The partitions of partitioned ``table`` (a qualified name) that have no index attached
    # to partitioned ``index`` yet: those a build partition by partition has still to do.
    found = op.get_bind().execute(
        sa.text(
            "SELECT c.relname FROM pg_catalog.pg_inherits AS i "
            "JOIN pg_catalog.pg_class AS c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(:table) AND NOT EXISTS ("
            "SELECT FROM pg_catalog.pg_inherits AS ii "
            "JOIN pg_catalog.pg_index AS x ON x.indexrelid = ii.inhrelid "
            "WHERE ii.inhparent = to_regclass(:index) AND x.indrelid = c.oid) "
            "ORDER BY c.relname"
        ),
        {"table": table, "index": index},
    )
    return [str(name) for name in found.scalars()]


def _add_columns(table_name: str, schema: str | None, *definitions: str) -> None:
    # One ALTER TABLE of nullable columns without defaults (no rewrite); IF NOT EXISTS, so
    # that an upgrade interrupted after it can run again.
    adds = ", ".join(f"ADD COLUMN IF NOT EXISTS {definition}" for definition in definitions)
    _execute(f"ALTER TABLE {ddl.qualified_name(table_name, schema)} {adds}")


def _drop_columns(table_name: str, schema: str | None, *columns: str) -> None:
    drops = ", ".join(f"DROP COLUMN IF EXISTS {column}" for column in columns)
    _execute(f"ALTER TABLE {ddl.qualified_name(table_name, schema)} {drops}")


def _create_index(
    name: str,
    table_name: str,
    columns: tuple[str, ...],
    predicate: str,
    *,
    schema: str | None,
    concurrently: bool,
) -> None:
    options: dict[str, Any] = {"schema": schema, "postgresql_where": sa.text(predicate)}
    if concurrently:
        options["postgresql_concurrently"] = True
    op.create_index(name, table_name, list(columns), **options)


def _drop_index(
    name: str,
    table_name: str,
    *,
    schema: str | None,
    concurrently: bool,
    if_exists: bool = False,
) -> None:
    options: dict[str, Any] = {"table_name": table_name, "schema": schema}
    if concurrently:
        options["postgresql_concurrently"] = True
    if if_exists:
        options["if_exists"] = True
    op.drop_index(name, **options)
