"""The steps the schema versions' helpers are made of: run a DDL statement, add or drop
nullable columns, create or drop a partial index (concurrently or not)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from sqla_jobs import ddl


def _execute(sql: str) -> None:
    op.execute(ddl.executable(sql))


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
