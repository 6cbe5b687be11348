"""Compare the database with the models where Alembic's autogenerate does not look.

Autogenerate compares an index's name and columns but not its ``WHERE`` predicate, and it
does not see triggers at all: a table that it (or a plain ``create_table``) creates has no
wake-up trigger. :func:`check_job_tables` checks both; :func:`check_claim_indexes` only the
partial indexes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from sqla_jobs import _queries as statements
from sqla_jobs import ddl
from sqla_jobs.schema import names
from sqla_jobs.schema.history import PARTITION_KEY, history_names, is_history_partition
from sqla_jobs.worker import table_version
from sqla_jobs.worker.table_version import helper_call, partial_indexes

__all__ = ["check_claim_indexes", "check_job_tables", "include_name"]

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
# A history table's shape: partitioned, by what, whether it has a DEFAULT partition and
# its dead index (health reads the history's dead jobs from it).
_HISTORY_SHAPE = sa.text(
    """
    SELECT
        c.relkind = 'p' AS partitioned,
        CASE WHEN c.relkind = 'p' THEN pg_get_partkeydef(c.oid) END AS partition_key,
        EXISTS (
            SELECT 1 FROM pg_inherits AS i JOIN pg_class AS p ON p.oid = i.inhrelid
            WHERE i.inhparent = c.oid AND pg_get_expr(p.relpartbound, p.oid) = 'DEFAULT'
        ) AS has_default,
        EXISTS (
            SELECT 1 FROM pg_index AS x
            WHERE x.indexrelid = to_regclass(:dead_index) AND x.indrelid = c.oid
        ) AS has_dead_index,
        ARRAY(
            SELECT a.attname::text FROM pg_attribute AS a
            WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
        ) AS columns
    FROM pg_class AS c
    WHERE c.oid = to_regclass(:history)
    """
)
_SCRATCH_TABLE = "sqla_jobs_index_check"
# The columns every version of JobMixin has: a table that has them all is a job table,
# whoever made it (and whichever version: version 3 adds nullable columns to version 2's).
_JOB_COLUMNS = (frozenset(statements.ENQUEUE_COLUMNS) | statements.MANAGED_COLUMNS) - {
    "cancel_requested_at"
}


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


def _expected_shape(connection: sa.Connection, table: sa.Table, index: sa.Index) -> _Shape | None:
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
        try:
            with connection.begin_nested():
                scratch_index.create(connection)
        except sa.exc.ProgrammingError:  # a column the index needs is not in the table yet
            savepoint.rollback()
            return None
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
        if _is_job_table(table) and index.name == names(table.name).unique_index:
            problem = (
                f"{label}: missing from the database (a job table of schema version 2); "
                f"upgrade it from a new revision with {helper_call('add_unique_keys', table)}"
            )
            return [problem]
        return [f"{label}: missing from the database"]
    if not actual.valid:
        return [f"{label}: invalid (a failed CREATE INDEX CONCURRENTLY?); drop and rebuild it"]
    expected = _expected_shape(connection, table, index)
    if expected is None:
        return [
            (
                f"{label}: the model's index needs columns the table does not have yet; "
                "upgrade the table (sqla_jobs.migrations: add_ordering_keys for schema version 3)"
            )
        ]
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


def _is_job_table(table: sa.Table) -> bool:
    return _JOB_COLUMNS.issubset(column.name for column in table.columns)


def _arguments(table: sa.Table) -> str:
    schema = "" if table.schema is None else f", schema={table.schema!r}"
    return f"({table.name!r}{schema})"


def _version_1_problems(connection: sa.Connection, table: sa.Table) -> list[str]:
    # A job table still at schema version 1 has its claim index, which the model (version 2)
    # no longer declares: autogenerate would drop it, but not build the two that replace it.
    n = names(table.name)
    if not _is_job_table(table) or any(i.name == n.claim_index for i in table.indexes):
        return []
    index_name = ddl.qualified_name(n.claim_index, table.schema)
    if _shape(connection, index_name, ddl.qualified_name(table.name, table.schema)) is None:
        return []
    problem = (
        f"index {n.claim_index} on {table.fullname}: the claim index of schema version 1, "
        "which the model no longer has; upgrade the table from a new revision with "
        f"{helper_call('upgrade_job_table_to_v2', table)}"
    )
    return [problem]


def _index_problems(connection: sa.Connection, table: sa.Table) -> list[str]:
    problems: list[str] = []
    indexes = {str(index.name): index for index in table.indexes}
    for name in partial_indexes(table):
        problems.extend(_problems(connection, table, indexes[name]))
    return problems + _version_1_problems(connection, table)


def _wakeup_problems(connection: sa.Connection, table: sa.Table) -> list[str]:
    if connection.execute(statements.wakeup_trigger_exists(table)).scalar_one():
        return []
    arguments = _arguments(table)
    problem = (
        f"wake-up trigger {names(table.name).notify_trigger} on {table.fullname}: missing, "
        "disabled or not the one sqla_jobs creates (autogenerate and a plain create_table "
        "make none), so workers see new jobs only when they poll; add it from a revision "
        f"with {helper_call('create_notify_trigger', table)} (after "
        f"drop_notify_trigger{arguments} to replace one that is there but wrong)"
    )
    return [problem]


def _history_problems(connection: sa.Connection, table: sa.Table) -> list[str]:
    # A model with partitioned_history has its history table in the same MetaData.
    n = history_names(table.name, table.schema)
    key = n.table if table.schema is None else f"{table.schema}.{n.table}"
    declared = table.metadata.tables.get(key)
    if declared is None or declared.info.get("sqla_jobs_history_of") != table.name:
        return []
    label = f"history table {n.table} of {table.fullname}"
    call = helper_call("add_history", table)  # of the version the mixins declare
    fix = f"{call[:-1]}, version={table_version.SCHEMA_VERSION}) (with your own columns)"
    row = connection.execute(
        _HISTORY_SHAPE,
        {
            "history": ddl.qualified_name(n.table, table.schema),
            "dead_index": ddl.qualified_name(n.dead_index, table.schema),
        },
    ).one_or_none()
    if row is None:
        return [f"{label}: missing from the database; create it from a revision with {fix}"]
    if not row.partitioned or row.partition_key != f"RANGE ({PARTITION_KEY})":
        return [f"{label}: not partitioned by RANGE ({PARTITION_KEY}); recreate it with {fix}"]
    if not row.has_default:
        return [f"{label}: has no DEFAULT partition; recreate it with {fix}"]
    if not row.has_dead_index:
        problem = (
            f"{label}: has no dead index {n.dead_index}, from which health counts and lists "
            "its dead jobs; create it from a revision with CREATE INDEX "
            f"{n.dead_index} ON {ddl.qualified_name(n.table, table.schema)} "
            "(finished_at, id, queue) WHERE status = 'dead' (or recreate the table with "
            f"{fix})"
        )
        return [problem]
    missing = [c.name for c in declared.columns if c.name not in row.columns]
    if missing:
        # A history added at an older schema version (add_history without version=4), or
        # the job table's own columns not copied: the moves into it would fail.
        problem = (
            f"{label}: lacks the column(s) {', '.join(missing)} of its job table, which every "
            "move into it copies; add them from a revision (the version-4 ones with "
            f"{helper_call('upgrade_job_table_to_v4', table)}, which runs again safely)"
        )
        return [problem]
    return []


def check_claim_indexes(connection: sa.Connection, *models: type[Any] | sa.Table) -> list[str]:
    """Compare each partial index of the models with the database; return the differences.

    Alembic's autogenerate compares an index's name and columns but not its ``WHERE``
    predicate, and a claim index whose predicate does not match the claim statement's is
    silently not used. This check covers every index of the given models (or tables) that
    has ``postgresql_where``, the claim indexes of a :class:`~sqla_jobs.schema.JobMixin`
    model (the pending index and the running index) first of all: each must exist, be
    valid, and have the model's key columns, predicate, uniqueness and access method as
    PostgreSQL normalises them. A job table that still has the claim index of schema
    version 1 is reported too, with the helper that upgrades it. An empty list means they
    all match.

    It reads the catalog and builds the model's index on an empty temporary table inside a
    savepoint that it rolls back; it changes nothing else in the caller's transaction.
    :func:`check_job_tables` runs it and checks the wake-up trigger too: use that one in a
    test or in CI after ``alembic upgrade heads``.
    """
    problems: list[str] = []
    for model in models:
        problems.extend(_index_problems(connection, _table_of(model)))
    return problems


def check_job_tables(
    connection: sa.Connection, *models: type[Any] | sa.Table, notify: bool = True
) -> list[str]:
    """Check what the job tables need beyond what autogenerate compares; return the problems.

    For each model (or table): the partial indexes, as :func:`check_claim_indexes` does,
    and, for a job table (one with every column of :class:`~sqla_jobs.schema.JobMixin`), the
    wake-up trigger (:func:`sqla_jobs._queries.wakeup_trigger_exists`): present, enabled,
    and the one :func:`~sqla_jobs.migrations.create_notify_trigger` creates. Without it
    workers hear of no new job and find them by polling only. ``notify=False`` skips the
    trigger, for tables made with ``create_job_table(..., notify=False)`` on purpose. An
    empty list means everything matches.

    Changes nothing in the caller's transaction (see :func:`check_claim_indexes`). Use it in
    a test or in CI after ``alembic upgrade heads``::

        with engine.connect() as connection:
            assert check_job_tables(connection, EmailJob, ReportJob) == []
    """
    problems: list[str] = []
    for model in models:
        table = _table_of(model)
        problems.extend(_index_problems(connection, table))
        if notify and _is_job_table(table):
            problems.extend(_wakeup_problems(connection, table))
        problems.extend(_history_problems(connection, table))
    return problems


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """An ``include_name`` hook for Alembic's ``context.configure``: leaves out the
    partitions of history tables (``<job table>_history_p20260131``, ``..._pdefault``),
    which are tables in the database that no model declares, made and dropped by the
    maintenance rather than by revisions. Everything else is included::

        context.configure(..., include_name=sqla_jobs.migrations.include_name)
    """
    return not (type_ == "table" and name is not None and is_history_partition(name))
