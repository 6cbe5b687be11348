"""Compare the partial indexes in the database with the models' (autogenerate does not)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from sqla_jobs import ddl

__all__ = ["check_claim_indexes"]

# Key columns, predicate, uniqueness and access method, as PostgreSQL prints them back.
_INDEX_SHAPE = sa.text(
    """
    SELECT
        i.indisvalid AS valid,
        i.indisunique AS is_unique,
        am.amname AS method,
        pg_get_expr(i.indpred, i.indrelid, true) AS predicate,
        ARRAY(
            SELECT pg_get_indexdef(i.indexrelid, k, true)
            FROM generate_series(1, i.indnkeyatts) AS k ORDER BY k
        ) AS columns
    FROM pg_index AS i
    JOIN pg_class AS c ON c.oid = i.indexrelid
    JOIN pg_am AS am ON am.oid = c.relam
    WHERE i.indexrelid = to_regclass(:index_name)
      AND i.indrelid = to_regclass(:table_name)
    """
)
_SCRATCH_TABLE = "sqla_jobs_index_check"


@dataclass(frozen=True)
class _Shape:
    valid: bool
    is_unique: bool
    method: str
    predicate: str | None
    columns: tuple[str, ...]


def _shape(connection: sa.Connection, index_name: str, table_name: str) -> _Shape | None:
    row = connection.execute(
        _INDEX_SHAPE, {"index_name": index_name, "table_name": table_name}
    ).one_or_none()
    if row is None:
        return None
    return _Shape(row.valid, row.is_unique, row.method, row.predicate, tuple(row.columns))


def _table_of(model: type[Any] | sa.Table) -> sa.Table:
    if isinstance(model, sa.Table):
        return model
    table = sa.inspect(model).local_table
    if not isinstance(table, sa.Table):
        raise TypeError(f"{model!r} is not mapped to a table")
    return table


def _expected_shape(connection: sa.Connection, table: sa.Table, index: sa.Index) -> _Shape:
    # PostgreSQL prints an index back in its own normal form ("((status)::text = ANY ..."),
    # so let it normalise the model's index too: build it on an empty temporary copy of the
    # table, inside a savepoint that is rolled back.
    # schema=None puts the copy in no schema (the stubs do not admit None, the code does).
    scratch = table.to_metadata(sa.MetaData(), schema=None, name=_SCRATCH_TABLE)  # type: ignore[arg-type]
    (scratch_index,) = (i for i in scratch.indexes if i.name == index.name)
    with connection.begin_nested() as savepoint:
        connection.execute(
            ddl.executable(
                f"CREATE TEMPORARY TABLE {ddl.quote(_SCRATCH_TABLE)} "
                f"(LIKE {ddl.qualified_name(table.name, table.schema)})"
            )
        )
        scratch_index.create(connection)
        shape = _shape(
            connection,
            f"pg_temp.{ddl.quote(str(index.name))}",
            f"pg_temp.{ddl.quote(_SCRATCH_TABLE)}",
        )
        savepoint.rollback()
    assert shape is not None
    return shape


def _problems(connection: sa.Connection, table: sa.Table, index: sa.Index) -> list[str]:
    label = f"index {index.name} on {table.fullname}"
    index_name = ddl.qualified_name(str(index.name), table.schema)
    actual = _shape(connection, index_name, ddl.qualified_name(table.name, table.schema))
    if actual is None:
        return [f"{label}: missing from the database"]
    if not actual.valid:
        return [f"{label}: invalid (a failed CREATE INDEX CONCURRENTLY?); drop and rebuild it"]
    expected = _expected_shape(connection, table, index)
    return [
        f"{label}: {what} is {got!r} in the database but {want!r} in the model"
        for what, got, want in (
            ("the predicate", actual.predicate, expected.predicate),
            ("the column list", actual.columns, expected.columns),
            ("uniqueness", actual.is_unique, expected.is_unique),
            ("the access method", actual.method, expected.method),
        )
        if got != want
    ]


def check_claim_indexes(connection: sa.Connection, *models: type[Any] | sa.Table) -> list[str]:
    """Compare each partial index of the models with the database; return the differences.

    Alembic's autogenerate compares an index's name and columns but not its ``WHERE``
    predicate, and a claim index whose predicate does not match the claim statement's is
    silently not used. This check covers every index of the given models (or tables) that
    has ``postgresql_where``, the claim index of a :class:`~sqla_jobs.schema.JobMixin`
    model first of all: it must exist, be valid, and have the model's key columns,
    predicate, uniqueness and access method as PostgreSQL normalises them. An empty list
    means they all match.

    It reads the catalog and builds the model's index on an empty temporary table inside a
    savepoint that it rolls back; it changes nothing else in the caller's transaction. Use
    it in a test or in CI after ``alembic upgrade heads``::

        with engine.connect() as connection:
            assert check_claim_indexes(connection, EmailJob, ReportJob) == []
    """
    problems: list[str] = []
    for model in models:
        table = _table_of(model)
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            if index.dialect_options["postgresql"]["where"] is not None:
                problems.extend(_problems(connection, table, index))
    return problems
