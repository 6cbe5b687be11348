"""The DDL a job table needs beyond ``CREATE TABLE``, as SQL text.

Pure functions of the table's name (and schema): no connection, no I/O. Two users run them:
the ``after_create``/``before_drop`` events that :class:`~sqla_jobs.schema.JobMixin` attaches
to every job table (so ``metadata.create_all()`` builds the same objects as the migrations),
and the migration helpers in :mod:`sqla_jobs.migrations`.

* **The NOTIFY trigger.** A statement-level ``AFTER INSERT`` trigger with a transition table
  sends one ``pg_notify(<channel>, <queue>)`` per distinct queue of the inserted rows, not one
  per row. Notifications are delivered when the inserting transaction commits, never before,
  and PostgreSQL folds identical notifications within one transaction, so a transaction that
  enqueues a thousand jobs in one queue wakes listeners once. NOTIFY takes a global lock at
  commit; per-row triggers are what make it expensive (oban-bg/oban#956).
* **Storage parameters.** A queue table is updated and deleted from all the time, and dead
  entries at the head of the claim index slow every claim until vacuum removes them, so
  autovacuum runs after a fixed number of changed rows instead of a fraction of the table.
  A fillfactor below 100 leaves room on each page for updates of the same row.

Identifiers are quoted the way SQLAlchemy quotes them in ``CREATE TABLE``.
"""

from __future__ import annotations

from sqlalchemy import DDL
from sqlalchemy.dialects import postgresql

from sqla_jobs.naming import names

__all__ = [
    "BODY_TAG",
    "STORAGE_PARAMETERS",
    "TRANSITION_TABLE",
    "create_notify_function",
    "create_notify_trigger",
    "drop_notify_function",
    "drop_notify_trigger",
    "executable",
    "literal",
    "qualified_name",
    "quote",
    "reset_storage_parameters",
    "set_storage_parameters",
]

# The name the trigger gives the set of rows one INSERT statement added.
TRANSITION_TABLE = "new_jobs"

STORAGE_PARAMETERS: dict[str, int | float] = {
    # Vacuum after a fixed number of dead rows, however large the finished history is.
    "autovacuum_vacuum_scale_factor": 0,
    "autovacuum_vacuum_threshold": 1000,
    # Keep the statistics of the small runnable part current, for the same reason.
    "autovacuum_analyze_scale_factor": 0,
    "autovacuum_analyze_threshold": 1000,
    # Room on each page for the new versions of its rows (claim, heartbeat, outcome), which
    # can then stay on the row's own page. (None of these updates is HOT: each changes a
    # column of an index key or predicate.)
    "fillfactor": 90,
}

_PREPARER = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]
# Dollar-quote tag of the function body; a tag no SQL we write contains.
BODY_TAG = "$sqla_jobs$"


def quote(identifier: str) -> str:
    """Quote an identifier if PostgreSQL needs it quoted (as SQLAlchemy does)."""
    return _PREPARER.quote(identifier)


def qualified_name(name: str, schema: str | None = None) -> str:
    """``schema.name`` (or ``name``), each part quoted as needed."""
    if schema is None:
        return quote(name)
    return f"{_PREPARER.quote_schema(schema)}.{quote(name)}"


def literal(value: str) -> str:
    """``value`` as an SQL string literal."""
    # standard_conforming_strings is on (the default since PostgreSQL 9.1).
    return "'" + value.replace("'", "''") + "'"


def create_notify_function(table: str, schema: str | None = None) -> str:
    """``CREATE OR REPLACE FUNCTION`` of the trigger function that notifies the channel."""
    n = names(table)
    body = (
        "BEGIN\n"
        f"    PERFORM pg_notify({literal(n.channel)}, q)\n"
        f"    FROM (SELECT DISTINCT queue AS q FROM {TRANSITION_TABLE}) AS inserted_queues;\n"
        "    RETURN NULL;\n"
        "END;\n"
    )
    if BODY_TAG in body:  # only a table name could put it there
        raise ValueError(f"table name {table!r} must not contain {BODY_TAG!r}")
    return (
        f"CREATE OR REPLACE FUNCTION {qualified_name(n.notify_function, schema)}() "
        f"RETURNS trigger LANGUAGE plpgsql AS {BODY_TAG}\n{body}{BODY_TAG}"
    )


def drop_notify_function(table: str, schema: str | None = None) -> str:
    """``DROP FUNCTION IF EXISTS`` of the trigger function (drop the trigger first)."""
    return f"DROP FUNCTION IF EXISTS {qualified_name(names(table).notify_function, schema)}()"


def create_notify_trigger(table: str, schema: str | None = None) -> str:
    """``CREATE TRIGGER``: after each INSERT statement, run the notify function once."""
    n = names(table)
    return (
        f"CREATE TRIGGER {quote(n.notify_trigger)} "
        f"AFTER INSERT ON {qualified_name(table, schema)} "
        f"REFERENCING NEW TABLE AS {TRANSITION_TABLE} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {qualified_name(n.notify_function, schema)}()"
    )


def drop_notify_trigger(table: str, schema: str | None = None) -> str:
    """``DROP TRIGGER IF EXISTS`` of the notify trigger."""
    n = names(table)
    return f"DROP TRIGGER IF EXISTS {quote(n.notify_trigger)} ON {qualified_name(table, schema)}"


def set_storage_parameters(table: str, schema: str | None = None) -> str:
    """``ALTER TABLE ... SET (...)`` with :data:`STORAGE_PARAMETERS`.

    Takes a ``SHARE UPDATE EXCLUSIVE`` lock (``fillfactor`` too), so it does not block
    claims; the new fillfactor applies to pages written from then on.
    """
    options = ", ".join(f"{key} = {value}" for key, value in STORAGE_PARAMETERS.items())
    return f"ALTER TABLE {qualified_name(table, schema)} SET ({options})"


def reset_storage_parameters(table: str, schema: str | None = None) -> str:
    """``ALTER TABLE ... RESET (...)``: back to the server's defaults."""
    return f"ALTER TABLE {qualified_name(table, schema)} RESET ({', '.join(STORAGE_PARAMETERS)})"


def executable(sql: str) -> DDL:
    """Wrap SQL text from this module for ``Connection.execute`` or ``op.execute``.

    A :class:`~sqlalchemy.schema.DDL` element rather than ``text()``: its text is not scanned
    for ``:name`` bind parameters, and ``%`` in a quoted identifier is escaped.
    """
    return DDL(sql.replace("%", "%%"))  # type: ignore[no-untyped-call]
