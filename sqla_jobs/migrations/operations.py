"""Alembic operations for job and result tables, called from your own revisions.

Each helper renders one schema version of the tables, from a frozen copy kept here, never
from your live models: a revision must build the same tables next year as it does today.
Names come from :func:`sqla_jobs.names`, like the mixins' names. A later schema version ships
as new helpers (or a new ``version`` a helper accepts) that a new revision of yours calls,
never as a change to what an existing call builds.

Schema versions:

1. The job columns, constraints, NOTIFY trigger, storage parameters, and one partial claim
   index ``(queue, priority, run_at, id) WHERE status IN ('pending', 'running')``.
2. The same table with two
   claim indexes instead of one: the pending index ``(queue, priority, run_at, id) WHERE
   status = 'pending'`` and the running index ``(queue, lease_expires_at) WHERE status =
   'running'``, so that a claim's cost grows neither with the number of queues it serves nor
   with the jobs in flight. :func:`create_job_table` builds it with ``version=2``; a
   version-1 table is upgraded in place, on a live table, by
   :func:`upgrade_job_table_to_v2`.
3. (What :class:`~sqla_jobs.schema.JobMixin` declares today.) Version 2 plus unique jobs:
   the nullable columns ``unique_key`` and ``unique_statuses`` and the partial unique index
   ``(unique_key) WHERE unique_key IS NOT NULL AND status = ANY (unique_statuses)``
   (:func:`add_unique_keys`); cancel: a nullable ``cancel_requested_at`` column (when
   :func:`sqla_jobs.cancel` asked a running job's worker to stop it; :func:`add_cancel`);
   traces: the nullable ``trace_context`` JSONB column (the enqueuer's trace context,
   :mod:`sqla_jobs.tracing`; :func:`add_trace_context`).
   :func:`create_job_table` builds it with ``version=3``.

   Version 3 also has the dead index ``(queue, finished_at, id) WHERE status = 'dead'``,
   from which health checks and ``sqla-jobs status`` count and list dead jobs without
   reading the finished history (alone: :func:`add_dead_index` / :func:`drop_dead_index`);
   ordering keys: two nullable columns, ``ordering_key`` and ``key_limit``, and the keyed
   claim's indexes: the keyed pending index ``(queue, priority, run_at, id) WHERE status =
   'pending' AND ordering_key IS NOT NULL`` and the key index ``(ordering_key, status,
   attempts, priority, run_at, id) WHERE ordering_key IS NOT NULL AND status IN ('pending',
   'running')``; the pending index leaves keyed jobs out (``... WHERE status = 'pending' AND
   ordering_key IS NULL``), so the plain claim never reads them (:func:`add_ordering_keys`).
   :func:`upgrade_job_table_to_v3` upgrades a live version-2 table with every version-3
   feature, each without a table rewrite and with indexes built concurrently;
   :func:`downgrade_job_table_to_v2` undoes it. A model that opts in to partitioned history
   (``partitioned_history = True``) also has a history table beside it
   (:mod:`sqla_jobs.history`): :func:`add_history` creates it, on a new table
   (``create_job_table(..., version=3, history=True)``) or beside a live version-2 or 3
   table without touching it, and :func:`drop_history` drops it.

The result table has not changed since version 1. The schedule table of periodic jobs
(:class:`~sqla_jobs.schema.ScheduleMixin`) is made by :func:`create_schedule_table`.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.schema import SchemaItem

from sqla_jobs import ddl
from sqla_jobs.history.schema import (
    PARTITION_KEY,
    RESULT_COLUMN,
    create_default_partition,
    history_names,
)
from sqla_jobs.leasing.schema import lease_index_elements, lease_names
from sqla_jobs.schema import _identifier, names

__all__ = [
    "CLAIM_INDEX_COLUMNS",
    "CLAIM_INDEX_PREDICATE",
    "DEAD_INDEX_COLUMNS",
    "DEAD_INDEX_PREDICATE",
    "LEASE_SCHEMA_VERSION",
    "PENDING_INDEX_COLUMNS",
    "PENDING_INDEX_PREDICATE",
    "RUNNING_INDEX_COLUMNS",
    "RUNNING_INDEX_PREDICATE",
    "SCHEMA_VERSION",
    "UNIQUE_INDEX_COLUMNS",
    "UNIQUE_INDEX_PREDICATE",
    "add_cancel",
    "add_dead_index",
    "add_history",
    "add_lease_columns",
    "add_ordering_keys",
    "add_trace_context",
    "add_unique_keys",
    "create_claim_index",
    "create_claim_indexes",
    "create_job_table",
    "create_lease_index",
    "create_notify_trigger",
    "create_result_table",
    "create_schedule_table",
    "downgrade_job_table_to_v1",
    "downgrade_job_table_to_v2",
    "drop_cancel",
    "drop_claim_index",
    "drop_claim_indexes",
    "drop_dead_index",
    "drop_history",
    "drop_job_table",
    "drop_lease_columns",
    "drop_lease_index",
    "drop_notify_trigger",
    "drop_ordering_keys",
    "drop_result_table",
    "drop_schedule_table",
    "drop_trace_context",
    "drop_unique_keys",
    "upgrade_job_table_to_v2",
    "upgrade_job_table_to_v3",
]

SCHEMA_VERSION = 3
"""The latest version of the job and result tables: the one the mixins declare."""

# Frozen copies of what the mixins declared in each version. tests/test_migrations.py proves
# that the latest still matches the mixins; a change to the mixins needs a new version, not an
# edit here.
# Version 1: one claim index.
CLAIM_INDEX_COLUMNS = ("queue", "priority", "run_at", "id")
CLAIM_INDEX_PREDICATE = "status IN ('pending', 'running')"
# Version 2: the pending index and the running index, instead of the claim index.
PENDING_INDEX_COLUMNS = ("queue", "priority", "run_at", "id")
PENDING_INDEX_PREDICATE = "status = 'pending'"
RUNNING_INDEX_COLUMNS = ("queue", "lease_expires_at")
RUNNING_INDEX_PREDICATE = "status = 'running'"
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
_NAME_LENGTH = 200
# Version 3 (trace context): one nullable column.
TRACE_CONTEXT_COLUMN = "trace_context"
_STATUSES = "'pending', 'running', 'succeeded', 'dead', 'cancelled'"


def _job_table_items(table_name: str) -> list[SchemaItem]:
    n = names(table_name)
    return [
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("queue", sa.String(_NAME_LENGTH), server_default="default", nullable=False),
        sa.Column("task", sa.String(_NAME_LENGTH), nullable=False),
        sa.Column("args", JSONB, server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("status", sa.String(16), server_default="pending", nullable=False),
        sa.Column("priority", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "run_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default=sa.text("20"), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("leased_by", sa.String(_NAME_LENGTH), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(f"status IN ({_STATUSES})", name=n.status_check),
        sa.CheckConstraint("priority BETWEEN -100 AND 100", name=n.priority_check),
        sa.CheckConstraint("attempts >= 0 AND max_attempts >= 1", name=n.attempts_check),
    ]


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


def _result_table_items() -> list[SchemaItem]:
    return [
        sa.Column("job_id", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("task", sa.String(_NAME_LENGTH), nullable=False),
        sa.Column("value", JSONB, nullable=True),
        sa.Column(
            "finished_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
    ]


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


def _v2_indexes(table_name: str) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    n = names(table_name)
    return (
        (n.pending_index, PENDING_INDEX_COLUMNS, PENDING_INDEX_PREDICATE),
        (n.running_index, RUNNING_INDEX_COLUMNS, RUNNING_INDEX_PREDICATE),
    )


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


def create_job_table(
    table_name: str,
    *extra: SchemaItem,
    schema: str | None = None,
    notify: bool = True,
    version: int = 1,
    history: bool = False,
) -> sa.Table:
    """Create a job table with its claim index(es), storage parameters and NOTIFY trigger.

    ``version`` is the schema version to build (see the module's docstring): a new revision
    passes ``version=3``, the version :class:`~sqla_jobs.schema.JobMixin` declares. Without
    it the table is version 1, as it was when the revisions already written called this
    helper; upgrade such a table with :func:`upgrade_job_table_to_v2`, then
    :func:`upgrade_job_table_to_v3`.

    ``extra`` are your model's own columns and constraints (``sa.Column``,
    ``sa.ForeignKeyConstraint``, ``sa.Index``, ...), added after the job columns.
    ``notify=False`` leaves out the trigger (workers then find jobs by polling only); add it
    later with :func:`create_notify_trigger`. Returns the table, e.g. for ``op.bulk_insert``.

    A revision for the model ``EmailJob(JobMixin, Base)`` with ``__tablename__ = "email_jobs"``
    and an ``order_id`` column::

        import sqlalchemy as sa
        from sqla_jobs import migrations as jobs

        revision = "3f1c0a9e2b7d"
        down_revision = "0001_orders"

        def upgrade() -> None:
            jobs.create_job_table(
                "email_jobs",
                sa.Column("order_id", sa.Integer, sa.ForeignKey("orders.id")),
                version=3,
            )
            jobs.create_result_table("email_job_results")

        def downgrade() -> None:
            jobs.drop_result_table("email_job_results")
            jobs.drop_job_table("email_jobs")
    """
    if version not in (1, 2, 3):
        raise ValueError(f"schema version must be 1, 2 or 3, not {version!r}")
    if history and version < 3:
        raise ValueError("history=True needs version=3 (the partitioned history)")
    items = _job_table_items(table_name)
    if version >= 3:
        items += _unique_columns()
        items.append(_cancel_column())
        items += _ordering_key_columns()
        items.append(_trace_context_column())
    table = op.create_table(table_name, *items, *extra, schema=schema)
    if version == 1:
        create_claim_index(table_name, schema=schema)
    else:
        create_claim_indexes(table_name, schema=schema, version=version)
    if version >= 3:
        _create_index(
            names(table_name).dead_index,
            table_name,
            DEAD_INDEX_COLUMNS,
            DEAD_INDEX_PREDICATE,
            schema=schema,
            concurrently=False,
        )
        _create_unique_index(table_name, schema=schema, concurrently=False)
    _execute(ddl.set_storage_parameters(table_name, schema))
    if notify:
        create_notify_trigger(table_name, schema=schema)
    if history:
        add_history(table_name, *extra, schema=schema)
    return table


def drop_job_table(table_name: str, *, schema: str | None = None) -> None:
    """Drop a job table with its trigger and trigger function (whether or not it had them).
    Its history table, if it has one, is dropped with :func:`drop_history`."""
    drop_notify_trigger(table_name, schema=schema)
    op.drop_table(table_name, schema=schema)


def _history_items(table_name: str, extra: tuple[SchemaItem, ...]) -> list[SchemaItem]:
    # Frozen copy of what sqla_jobs.history.history_table derives from a job model (schema
    # version 3): every job column, nullable as in the job table but id and finished_at,
    # without defaults, identity or foreign keys; then the result; the key (id, finished_at).
    columns: list[SchemaItem] = []
    v3_columns = [
        *_unique_columns(),
        _cancel_column(),
        *_ordering_key_columns(),
        _trace_context_column(),
    ]
    for item in (*_job_table_items(table_name), *v3_columns, *extra):
        if isinstance(item, sa.Column):
            nullable = False if item.name in ("id", PARTITION_KEY) else item.nullable
            columns.append(sa.Column(item.name, item.type, nullable=bool(nullable)))
    columns.append(sa.Column(RESULT_COLUMN, JSONB, nullable=True))
    columns.append(
        sa.PrimaryKeyConstraint("id", PARTITION_KEY, name=history_names(table_name).primary_key)
    )
    return columns


def add_history(table_name: str, *extra: SchemaItem, schema: str | None = None) -> sa.Table:
    """Create the partitioned history table of job table ``table_name`` (schema version 3),
    with its ``DEFAULT`` partition, for a model with ``partitioned_history = True``.

    ``extra`` are the same columns of yours that the job table has (as given to
    :func:`create_job_table`; constraints and indexes among them are left out, and foreign
    keys dropped from the copies). It creates a new table and touches nothing else: on a
    live version-2 table it takes no lock of the job table. The job table's finished rows
    stay where they are until the maintenance moves them in batches
    (:func:`sqla_jobs.history.move_finished`: the worker's ``history`` role, or ``sqla-jobs
    history maintain``); the day partitions are made by the maintenance too, and until they
    exist finished jobs land in the ``DEFAULT`` partition (the maintenance moves them into
    their day's partition when it creates it).

    A revision of yours, for a table created by an earlier revision::

        def upgrade() -> None:
            jobs.add_history("email_jobs", sa.Column("order_id", sa.Integer))

        def downgrade() -> None:
            jobs.drop_history("email_jobs")
    """
    n = history_names(table_name, schema)
    table = op.create_table(
        n.table,
        *_history_items(table_name, extra),
        schema=schema,
        postgresql_partition_by=f"RANGE ({PARTITION_KEY})",
    )
    # The dead jobs' partial index (on the still empty parent: a partitioned index that each
    # partition gets its own copy of), read by health (queue_stats, dead_jobs).
    op.create_index(
        n.dead_index,
        n.table,
        [PARTITION_KEY, "id", "queue"],
        schema=schema,
        postgresql_where=sa.text(DEAD_INDEX_PREDICATE),
    )
    _execute(create_default_partition(table_name, schema))
    return table


def drop_history(table_name: str, *, schema: str | None = None) -> None:
    """Drop the history table of ``table_name`` with all its partitions (and their rows)."""
    op.drop_table(history_names(table_name, schema).table, schema=schema)


def create_result_table(table_name: str, *extra: SchemaItem, schema: str | None = None) -> sa.Table:
    """Create a result table (see :class:`~sqla_jobs.schema.JobResultMixin`)."""
    return op.create_table(table_name, *_result_table_items(), *extra, schema=schema)


def drop_result_table(table_name: str, *, schema: str | None = None) -> None:
    """Drop a result table."""
    op.drop_table(table_name, schema=schema)


def create_claim_index(
    table_name: str, *, schema: str | None = None, concurrently: bool = False
) -> None:
    """Create the partial claim index of schema version 1.

    :func:`create_job_table` (version 1) already creates it; call this to rebuild it after
    :func:`drop_claim_index`. (Version 2 has two indexes instead:
    :func:`create_claim_indexes`.) With ``concurrently=True`` the index is built with
    ``CREATE INDEX CONCURRENTLY``, which does not block enqueues and claims on a live table
    but cannot run in a transaction: the helper runs it in Alembic's ``autocommit_block()``,
    which first commits everything the migration did before it. If it fails it leaves an
    invalid index behind, which :func:`~sqla_jobs.migrations.check_claim_indexes` reports;
    drop it and try again.
    """
    index_options: dict[str, Any] = {
        "schema": schema,
        "postgresql_where": sa.text(CLAIM_INDEX_PREDICATE),
    }
    index_name = names(table_name).claim_index
    if not concurrently:
        op.create_index(index_name, table_name, list(CLAIM_INDEX_COLUMNS), **index_options)
        return
    with op.get_context().autocommit_block():
        op.create_index(
            index_name,
            table_name,
            list(CLAIM_INDEX_COLUMNS),
            postgresql_concurrently=True,
            **index_options,
        )


def drop_claim_index(
    table_name: str, *, schema: str | None = None, concurrently: bool = False
) -> None:
    """Drop the claim index of schema version 1 (``concurrently`` as for
    :func:`create_claim_index`)."""
    index_name = names(table_name).claim_index
    if not concurrently:
        op.drop_index(index_name, table_name=table_name, schema=schema)
        return
    with op.get_context().autocommit_block():
        op.drop_index(
            index_name, table_name=table_name, schema=schema, postgresql_concurrently=True
        )


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


def upgrade_job_table_to_v2(table_name: str, *, schema: str | None = None) -> None:
    """Upgrade a version-1 job table to version 2 in place, without blocking its users.

    Builds the pending index and the running index with ``CREATE INDEX CONCURRENTLY``, then
    drops the version-1 claim index with ``DROP INDEX CONCURRENTLY``: enqueues, claims and
    outcomes go on meanwhile. Neither can run in a transaction, so all of it runs in
    Alembic's ``autocommit_block()``, which first commits whatever the revision did before.
    The columns, constraints, trigger and storage parameters are the same in both versions.

    Each build waits for the transactions already running when it starts (a lock-held
    worker's long handler transaction included), and reads the whole table. It can be run
    again after a failure: an index that an interrupted build left invalid is dropped and
    built again. Until the revision has run, a claim of the new code works on the old index
    (and an old worker's claim on the new ones), only more slowly: deploy both together.

    A revision of yours for tables your earlier revisions created with
    :func:`create_job_table` (``revision`` identifiers left out)::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.upgrade_job_table_to_v2("email_jobs")

        def downgrade() -> None:
            jobs.downgrade_job_table_to_v1("email_jobs")
    """
    with op.get_context().autocommit_block():
        for name, columns, predicate in _v2_indexes(table_name):
            _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)
            _create_index(name, table_name, columns, predicate, schema=schema, concurrently=True)
        _drop_index(
            names(table_name).claim_index,
            table_name,
            schema=schema,
            concurrently=True,
            if_exists=True,
        )


def downgrade_job_table_to_v1(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`upgrade_job_table_to_v2`: build the version-1 claim index concurrently,
    then drop the pending and running indexes concurrently (re-runnable in the same way)."""
    n = names(table_name)
    with op.get_context().autocommit_block():
        _drop_index(n.claim_index, table_name, schema=schema, concurrently=True, if_exists=True)
        _create_index(
            n.claim_index,
            table_name,
            CLAIM_INDEX_COLUMNS,
            CLAIM_INDEX_PREDICATE,
            schema=schema,
            concurrently=True,
        )
        for name, _, _ in _v2_indexes(table_name):
            _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)


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


def create_schedule_table(
    table_name: str, *extra: SchemaItem, schema: str | None = None
) -> sa.Table:
    """Create the table of a :class:`~sqla_jobs.schema.ScheduleMixin` model: one row per
    periodic task, the latest slot it was enqueued for."""
    return op.create_table(
        table_name,
        sa.Column("name", sa.String(_NAME_LENGTH), primary_key=True),
        sa.Column("last_slot", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        *extra,
        schema=schema,
    )


def drop_schedule_table(table_name: str, *, schema: str | None = None) -> None:
    """Drop a schedule table."""
    op.drop_table(table_name, schema=schema)


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
    new = _identifier(table_name, "pending_new_idx")
    old = _identifier(table_name, "pending_old_idx")
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


def create_notify_trigger(table_name: str, *, schema: str | None = None) -> None:
    """Create the NOTIFY trigger and its function on an existing job table.

    After each INSERT statement it notifies the table's channel
    (``names(table_name).channel``) once per distinct queue of the inserted rows; listeners
    hear of a job when its transaction commits, never before.
    """
    _execute(ddl.create_notify_function(table_name, schema))
    _execute(ddl.create_notify_trigger(table_name, schema))


def drop_notify_trigger(table_name: str, *, schema: str | None = None) -> None:
    """Drop the NOTIFY trigger and its function, if they exist."""
    _execute(ddl.drop_notify_trigger(table_name, schema))
    _execute(ddl.drop_notify_function(table_name, schema))


# -- lease columns (sqla_jobs.leasing) ------------------------------------------------------

LEASE_SCHEMA_VERSION = 1
"""The version of the lease columns and index that the lease helpers below create."""

# Frozen copies of what LeaseMixin declares (lease version 1); tests/test_leasing.py proves
# that they still match the mixin.
_LEASE_HOLDER_LENGTH = 200


def _lease_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("lease_holder", sa.String(_LEASE_HOLDER_LENGTH), nullable=True),
        sa.Column(
            "lease_expires_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),
            nullable=False,
        ),
        sa.Column("lease_fence", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    ]


def add_lease_columns(
    table_name: str,
    *,
    index_columns: tuple[str, ...] = (),
    primary_key: tuple[str, ...] = ("id",),
    schema: str | None = None,
    concurrently: bool = False,
) -> None:
    """Add the :class:`~sqla_jobs.LeaseMixin` columns and the lease index to an existing
    table of yours, from your own revision.

    ``index_columns`` is your model's ``lease_index_columns`` and ``primary_key`` its
    primary-key column names (in order), which end the index: together they must give the
    index the model declares, which autogenerate then compares. Every existing row becomes
    free, acquirable at once (``lease_expires_at`` is the migration's time, ``lease_fence``
    0). On PostgreSQL 11 and later the columns are added without rewriting the table (their
    defaults are not volatile), under a brief ``ACCESS EXCLUSIVE`` lock; set a
    ``lock_timeout`` in the revision on a busy table. With ``concurrently=True`` the index
    is built as :func:`create_lease_index` says.

    A revision for ``Seat(LeaseMixin, Base)`` with ``lease_index_columns = ("show_id",)``::

        from sqla_jobs import migrations

        def upgrade() -> None:
            migrations.add_lease_columns("seats", index_columns=("show_id",))

        def downgrade() -> None:
            migrations.drop_lease_columns("seats")
    """
    for column in _lease_columns():
        op.add_column(table_name, column, schema=schema)
    create_lease_index(
        table_name,
        index_columns=index_columns,
        primary_key=primary_key,
        schema=schema,
        concurrently=concurrently,
    )


def drop_lease_columns(table_name: str, *, schema: str | None = None) -> None:
    """Drop the lease index and columns (:func:`add_lease_columns` undone)."""
    drop_lease_index(table_name, schema=schema)
    for column in reversed(_lease_columns()):
        op.drop_column(table_name, column.name, schema=schema)


def create_lease_index(
    table_name: str,
    *,
    index_columns: tuple[str, ...] = (),
    primary_key: tuple[str, ...] = ("id",),
    schema: str | None = None,
    concurrently: bool = False,
) -> None:
    """Create the lease index: ``index_columns``, ``lease_expires_at``, ``primary_key``
    (see :func:`~sqla_jobs.leasing.schema.lease_index_elements`), named
    ``lease_names(table_name).index``.

    :func:`add_lease_columns` already creates it; call this to change a model's
    ``lease_index_columns`` (after :func:`drop_lease_index`). With ``concurrently=True`` it
    is built with ``CREATE INDEX CONCURRENTLY``, which does not block acquires on a live
    table but cannot run in a transaction: the helper runs it in Alembic's
    ``autocommit_block()``, which first commits everything the migration did before it. If
    that build fails it leaves an invalid index behind; drop it and try again.
    """
    name = lease_names(table_name).index
    columns = list(lease_index_elements(tuple(index_columns), tuple(primary_key)))
    if not concurrently:
        op.create_index(name, table_name, columns, schema=schema)
        return
    with op.get_context().autocommit_block():
        op.create_index(name, table_name, columns, schema=schema, postgresql_concurrently=True)


def drop_lease_index(
    table_name: str, *, schema: str | None = None, concurrently: bool = False
) -> None:
    """Drop the lease index (``concurrently`` as for :func:`create_lease_index`)."""
    name = lease_names(table_name).index
    if not concurrently:
        op.drop_index(name, table_name=table_name, schema=schema)
        return
    with op.get_context().autocommit_block():
        op.drop_index(name, table_name=table_name, schema=schema, postgresql_concurrently=True)
