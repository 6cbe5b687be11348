"""Schema version 3, feature by feature: the dead index, unique jobs, cancel, ordering keys
(and the claim indexes of version 2 or 3) and the trace context, each with its in-place
helper for a live version-2 table, and the upgrade that runs them all.

They are frozen copies of what the mixins declared in that version: tests/test_migrations.py
proves that the latest still matches the mixins; a change to the mixins needs a new version,
not an edit here.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from sqla_jobs import ddl
from sqla_jobs.migrations.steps import (
    _add_columns,
    _create_index,
    _drop_columns,
    _drop_index,
    _execute,
)
from sqla_jobs.migrations.v2 import (
    PENDING_INDEX_COLUMNS,
    PENDING_INDEX_PREDICATE,
    RUNNING_INDEX_COLUMNS,
    RUNNING_INDEX_PREDICATE,
    _v2_indexes,
)
from sqla_jobs.naming import identifier, names

# Version 3: the dead index (health), and unique jobs (two nullable columns and the unique
# index).
DEAD_INDEX_COLUMNS = ("queue", "finished_at", "id")
DEAD_INDEX_PREDICATE = "status = 'dead'"
UNIQUE_INDEX_COLUMNS = ("unique_key",)
UNIQUE_INDEX_PREDICATE = "unique_key IS NOT NULL AND status = ANY (unique_statuses)"
_UNIQUE_KEY_LENGTH = 255

# Version 3 (cancel): the cancel request column.
CANCEL_REQUESTED_COLUMN = "cancel_requested_at"

# Version 3 (ordering keys): two columns, the keyed pending index and the key index, and the
# pending index without the keyed jobs.
ORDERING_KEY_LENGTH = 200
PENDING_INDEX_PREDICATE_V3 = "status = 'pending' AND ordering_key IS NULL"
KEYED_PENDING_INDEX_COLUMNS = ("queue", "priority", "run_at", "id")
KEYED_PENDING_INDEX_PREDICATE = "status = 'pending' AND ordering_key IS NOT NULL"
KEY_INDEX_COLUMNS = ("ordering_key", "status", "attempts", "priority", "run_at", "id")
KEY_INDEX_PREDICATE = "ordering_key IS NOT NULL AND status IN ('pending', 'running')"

# Version 3 (trace context): one nullable column.
TRACE_CONTEXT_COLUMN = "trace_context"


def _unique_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("unique_key", sa.String(_UNIQUE_KEY_LENGTH), nullable=True),
        sa.Column("unique_statuses", sa.ARRAY(sa.String(16)), nullable=True),
    ]


def _cancel_column() -> sa.Column[Any]:
    return sa.Column(CANCEL_REQUESTED_COLUMN, sa.DateTime(timezone=True), nullable=True)


def _ordering_key_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("ordering_key", sa.String(ORDERING_KEY_LENGTH), nullable=True),
        sa.Column("key_limit", sa.SmallInteger(), nullable=True),
    ]


def _trace_context_column() -> sa.Column[Any]:
    return sa.Column(TRACE_CONTEXT_COLUMN, JSONB, nullable=True)


def _claim_indexes(table_name: str, version: int) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    if version == 2:
        return _v2_indexes(table_name)
    if version == 3:
        n = names(table_name)
        return (
            (n.pending_index, PENDING_INDEX_COLUMNS, PENDING_INDEX_PREDICATE_V3),
            (n.running_index, RUNNING_INDEX_COLUMNS, RUNNING_INDEX_PREDICATE),
            *_v3_indexes(table_name),
        )
    raise ValueError(f"the claim indexes are of schema version 2 or 3, not {version!r}")


def create_claim_indexes(
    table_name: str, *, schema: str | None = None, concurrently: bool = False, version: int = 2
) -> None:
    """Create the partial indexes the claim statements use: with ``version=2`` (the default,
    as when this helper was written) the pending index and the running index; with
    ``version=3`` those (the pending index without keyed jobs) and the keyed pending index
    and the key index.

    :func:`create_job_table`, :func:`upgrade_job_table_to_v2` and :func:`add_ordering_keys`
    already create them; call this to rebuild them after :func:`drop_claim_indexes`.
    ``concurrently=True`` builds them with ``CREATE INDEX CONCURRENTLY`` in Alembic's
    ``autocommit_block()``, as :func:`create_claim_index` describes.
    """
    indexes = _claim_indexes(table_name, version)
    if not concurrently:
        for name, columns, predicate in indexes:
            _create_index(name, table_name, columns, predicate, schema=schema, concurrently=False)
        return
    with op.get_context().autocommit_block():
        for name, columns, predicate in indexes:
            _create_index(name, table_name, columns, predicate, schema=schema, concurrently=True)


def drop_claim_indexes(
    table_name: str, *, schema: str | None = None, concurrently: bool = False, version: int = 2
) -> None:
    """Drop the claim indexes of schema version 2 or 3 (``concurrently`` and ``version`` as
    for :func:`create_claim_indexes`)."""
    indexes = _claim_indexes(table_name, version)
    if not concurrently:
        for name, _, _ in indexes:
            _drop_index(name, table_name, schema=schema, concurrently=False)
        return
    with op.get_context().autocommit_block():
        for name, _, _ in indexes:
            _drop_index(name, table_name, schema=schema, concurrently=True)


def upgrade_job_table_to_v3(table_name: str, *, schema: str | None = None) -> None:
    """Upgrade a live version-2 job table to version 3, feature by feature, without a table
    rewrite (nullable columns without defaults) and without blocking its users (indexes
    ``CONCURRENTLY``, in Alembic's ``autocommit_block()``, which commits what the revision
    did before). Each step can run again after an interrupted one (columns ``ADD COLUMN IF
    NOT EXISTS``; an index left invalid is dropped and built again).

    A revision of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.upgrade_job_table_to_v3("email_jobs")

        def downgrade() -> None:
            jobs.downgrade_job_table_to_v2("email_jobs")
    """
    add_dead_index(table_name, schema=schema)
    add_unique_keys(table_name, schema=schema)
    add_cancel(table_name, schema=schema)
    add_ordering_keys(table_name, schema=schema)
    add_trace_context(table_name, schema=schema)


def downgrade_job_table_to_v2(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`upgrade_job_table_to_v3`, feature by feature, in reverse order."""
    drop_trace_context(table_name, schema=schema)
    drop_ordering_keys(table_name, schema=schema)
    drop_cancel(table_name, schema=schema)
    drop_unique_keys(table_name, schema=schema)
    drop_dead_index(table_name, schema=schema)


def add_dead_index(table_name: str, *, schema: str | None = None) -> None:
    """Add the dead index of schema version 3 to a live version-2 job table, without
    blocking its users: ``CREATE INDEX CONCURRENTLY`` in Alembic's ``autocommit_block()``
    (which first commits whatever the revision did before). Re-runnable: an index an
    interrupted build left invalid is dropped and built again. The build reads the whole
    table once; the index itself holds only the dead jobs.

    A revision of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.add_dead_index("email_jobs")

        def downgrade() -> None:
            jobs.drop_dead_index("email_jobs")
    """
    name = names(table_name).dead_index
    with op.get_context().autocommit_block():
        _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)
        _create_index(
            name,
            table_name,
            DEAD_INDEX_COLUMNS,
            DEAD_INDEX_PREDICATE,
            schema=schema,
            concurrently=True,
        )


def drop_dead_index(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`add_dead_index` (``DROP INDEX CONCURRENTLY IF EXISTS``)."""
    with op.get_context().autocommit_block():
        _drop_index(
            names(table_name).dead_index,
            table_name,
            schema=schema,
            concurrently=True,
            if_exists=True,
        )


def _create_unique_index(table_name: str, *, schema: str | None, concurrently: bool) -> None:
    options: dict[str, Any] = {
        "schema": schema,
        "unique": True,
        "postgresql_where": sa.text(UNIQUE_INDEX_PREDICATE),
    }
    if concurrently:
        options["postgresql_concurrently"] = True
    op.create_index(
        names(table_name).unique_index, table_name, list(UNIQUE_INDEX_COLUMNS), **options
    )


def add_unique_keys(table_name: str, *, schema: str | None = None) -> None:
    """Add unique jobs (schema version 3) to a live version-2 job table, in place.

    Adds the nullable columns ``unique_key`` and ``unique_statuses`` (no default: a catalog
    change only, no table rewrite, under a brief ``ACCESS EXCLUSIVE`` lock; set a
    ``lock_timeout`` in the revision on a busy table), commits, then builds the unique index
    with ``CREATE UNIQUE INDEX CONCURRENTLY`` in Alembic's ``autocommit_block()``, which
    blocks no enqueue, claim or outcome. Every existing job has no key, so the build cannot
    fail on duplicates; it can be run again after an interrupted build (an invalid index
    left behind is dropped first).

    A revision of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.add_unique_keys("email_jobs")

        def downgrade() -> None:
            jobs.drop_unique_keys("email_jobs")
    """
    _add_columns(
        table_name,
        schema,
        f"unique_key VARCHAR({_UNIQUE_KEY_LENGTH})",
        "unique_statuses VARCHAR(16)[]",
    )
    with op.get_context().autocommit_block():
        _drop_index(
            names(table_name).unique_index,
            table_name,
            schema=schema,
            concurrently=True,
            if_exists=True,
        )
        _create_unique_index(table_name, schema=schema, concurrently=True)


def drop_unique_keys(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`add_unique_keys`: drop the unique index concurrently, then the columns
    (dropping a column does not rewrite the table either)."""
    with op.get_context().autocommit_block():
        _drop_index(
            names(table_name).unique_index,
            table_name,
            schema=schema,
            concurrently=True,
            if_exists=True,
        )
    _drop_columns(table_name, schema, "unique_statuses", "unique_key")


def add_cancel(table_name: str, *, schema: str | None = None) -> None:
    """Add what cancelling a running job needs (schema version 3's cancel feature) to a
    version-2 job table in place: the nullable ``cancel_requested_at`` column.

    ``ALTER TABLE ... ADD COLUMN`` of a nullable column without a default rewrites nothing
    and holds the table's ``ACCESS EXCLUSIVE`` lock only for a moment (but it waits, and
    makes every later claim wait, behind a transaction using the table: a lock-held
    worker's long handler; set ``lock_timeout`` in your migration environment). Deploy the
    code that reads the column after the revision has run. A revision of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.add_cancel("email_jobs")

        def downgrade() -> None:
            jobs.drop_cancel("email_jobs")
    """
    _add_columns(table_name, schema, f"{CANCEL_REQUESTED_COLUMN} TIMESTAMP WITH TIME ZONE")


def drop_cancel(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`add_cancel`: drop the ``cancel_requested_at`` column."""
    _drop_columns(table_name, schema, CANCEL_REQUESTED_COLUMN)


def _v3_indexes(table_name: str) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    n = names(table_name)
    return (
        (n.keyed_pending_index, KEYED_PENDING_INDEX_COLUMNS, KEYED_PENDING_INDEX_PREDICATE),
        (n.key_index, KEY_INDEX_COLUMNS, KEY_INDEX_PREDICATE),
    )


def _swap_pending_index(table_name: str, predicate: str, *, schema: str | None) -> None:
    """Replace the pending index by one with ``predicate``, under the same name, in an
    ``autocommit_block()``: the new one is built concurrently beside the old under a
    temporary name, the two are renamed (each a brief catalog change), and the old one is
    dropped concurrently, so the claim has a pending index all along. Re-runnable after an
    interruption."""
    n = names(table_name)
    new = identifier(table_name, "pending_new_idx")
    old = identifier(table_name, "pending_old_idx")
    for name in (new, old):
        _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)
    _create_index(
        new, table_name, PENDING_INDEX_COLUMNS, predicate, schema=schema, concurrently=True
    )
    _execute(
        f"ALTER INDEX IF EXISTS {ddl.qualified_name(n.pending_index, schema)} "
        f"RENAME TO {ddl.quote(old)}"
    )
    _execute(
        f"ALTER INDEX {ddl.qualified_name(new, schema)} RENAME TO {ddl.quote(n.pending_index)}"
    )
    _drop_index(old, table_name, schema=schema, concurrently=True, if_exists=True)


def add_ordering_keys(table_name: str, *, schema: str | None = None) -> None:
    """Upgrade a version-2 job table to ordering keys (schema version 3) in place, on a live
    table.

    Adds the nullable columns ``ordering_key`` and ``key_limit`` (``ADD COLUMN IF NOT
    EXISTS``: no default, so nothing is rewritten; the table's ``ACCESS EXCLUSIVE`` lock is
    held only for the catalog change, but it queues behind open transactions on the table:
    set a ``lock_timeout`` in a revision for a busy table), then, in Alembic's
    ``autocommit_block()`` (which first commits what the revision did before), builds the
    keyed pending index and the key index ``CONCURRENTLY`` and replaces the pending index by
    one that leaves keyed jobs out: built concurrently beside the old one, renamed, and the
    old one dropped concurrently, so claims always have one. Enqueues, claims and outcomes go
    on meanwhile. Re-runnable after a failure. Deploy the code that claims with keys after
    the revision has run (the plain claim of the new code reads the new column)::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.add_ordering_keys("email_jobs")

        def downgrade() -> None:
            jobs.drop_ordering_keys("email_jobs")
    """
    _add_columns(
        table_name, schema, f"ordering_key VARCHAR({ORDERING_KEY_LENGTH})", "key_limit SMALLINT"
    )
    with op.get_context().autocommit_block():
        for name, columns, predicate in _v3_indexes(table_name):
            _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)
            _create_index(name, table_name, columns, predicate, schema=schema, concurrently=True)
        _swap_pending_index(table_name, PENDING_INDEX_PREDICATE_V3, schema=schema)


def drop_ordering_keys(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`add_ordering_keys`: the version-2 pending index back (concurrently, as
    there), the keyed indexes dropped concurrently, then the two columns. Jobs that had an
    ordering key lose it and become plain jobs."""
    with op.get_context().autocommit_block():
        _swap_pending_index(table_name, PENDING_INDEX_PREDICATE, schema=schema)
        for name, _, _ in _v3_indexes(table_name):
            _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)
    _drop_columns(table_name, schema, "key_limit", "ordering_key")


def add_trace_context(table_name: str, *, schema: str | None = None) -> None:
    """Upgrade a version-2 job table to version 3 in place: add the ``trace_context`` column.

    A nullable column without a default: PostgreSQL adds it without rewriting the table or
    reading a row, under a brief ``ACCESS EXCLUSIVE`` lock (set a ``lock_timeout`` in the
    revision on a busy table). Existing jobs have no trace context. Deploy the revision
    before the code that declares the column: the claim returns it.

    A revision of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.add_trace_context("email_jobs")

        def downgrade() -> None:
            jobs.drop_trace_context("email_jobs")
    """
    _add_columns(table_name, schema, f"{TRACE_CONTEXT_COLUMN} JSONB")


def drop_trace_context(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`add_trace_context`: drop the ``trace_context`` column (and the jobs'
    trace contexts with it)."""
    _drop_columns(table_name, schema, TRACE_CONTEXT_COLUMN)
