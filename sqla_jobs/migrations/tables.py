"""Alembic operations for job and result tables, called from your own revisions: the job
table at any schema version, and the schedule table.

Each helper renders one schema version of the tables, from a frozen copy kept in this package
(one module per version: :mod:`~sqla_jobs.migrations.v1`, :mod:`~sqla_jobs.migrations.v2`,
:mod:`~sqla_jobs.migrations.v3`, :mod:`~sqla_jobs.migrations.v4`; the history table in
:mod:`~sqla_jobs.migrations.history_table`, the lease columns in
:mod:`~sqla_jobs.migrations.leases`), never from your live models: a revision must build
the same tables next year as it does today.
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
3. Version 2 plus unique jobs:
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

4. (What :class:`~sqla_jobs.schema.JobMixin` declares today.) Version 3 plus job control:
   the nullable ``time_limit`` interval (a job's own time limit), ``snoozes integer NOT NULL
   DEFAULT 0`` (how often it snoozed), the nullable ``progress`` JSONB (its handler's
   latest progress) and the nullable ``attempted_at`` timestamptz (when its latest attempt
   started, set by the claim), on the job table and its history table (:func:`add_job_control`, in
   :mod:`~sqla_jobs.migrations.v4`), and the pause table beside the job table
   (``<table>_pauses``, :func:`create_pause_table`). :func:`create_job_table` builds it
   with ``version=4``; :func:`upgrade_job_table_to_v4` upgrades a live version-3 table
   without a rewrite, and :func:`downgrade_job_table_to_v3` undoes it.

The result table has not changed since version 1. The schedule table of periodic jobs
(:class:`~sqla_jobs.schema.ScheduleMixin`) is made by :func:`create_schedule_table`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.schema import SchemaItem

from sqla_jobs import ddl
from sqla_jobs.migrations.history_table import add_history
from sqla_jobs.migrations.pauses import create_pause_table, drop_pause_table
from sqla_jobs.migrations.steps import _create_index, _execute
from sqla_jobs.migrations.v1 import (
    _NAME_LENGTH,
    _job_table_items,
    create_claim_index,
    create_notify_trigger,
    drop_notify_trigger,
)
from sqla_jobs.migrations.v3 import (
    DEAD_INDEX_COLUMNS,
    DEAD_INDEX_PREDICATE,
    _cancel_column,
    _create_unique_index,
    _ordering_key_columns,
    _trace_context_column,
    _unique_columns,
    create_claim_indexes,
)
from sqla_jobs.migrations.v4 import _job_control_columns
from sqla_jobs.schema import names
from sqla_jobs.schema.history import history_names
from sqla_jobs.worker import table_version

# One source for the worker's check at start (sqla_jobs.worker.table_version) and this.
SCHEMA_VERSION = table_version.SCHEMA_VERSION
"""The latest version of the job and result tables: the one the mixins declare."""


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
    passes ``version=4``, the version :class:`~sqla_jobs.schema.JobMixin` declares. Without
    it the table is version 1, as it was when the revisions already written called this
    helper; upgrade such a table with :func:`upgrade_job_table_to_v2`, then
    :func:`upgrade_job_table_to_v3` and :func:`upgrade_job_table_to_v4`.

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
                version=4,
            )
            jobs.create_result_table("email_job_results")

        def downgrade() -> None:
            jobs.drop_result_table("email_job_results")
            jobs.drop_job_table("email_jobs")
    """
    if version not in (1, 2, 3, 4):
        raise ValueError(f"schema version must be 1, 2, 3 or 4, not {version!r}")
    if history and version < 3:
        raise ValueError("history=True needs version=3 or 4 (the partitioned history)")
    items = _job_table_items(table_name)
    if version >= 3:
        items += _unique_columns()
        items.append(_cancel_column())
        items += _ordering_key_columns()
        items.append(_trace_context_column())
    if version >= 4:
        items += _job_control_columns()
    table = op.create_table(table_name, *items, *extra, schema=schema)
    if version == 1:
        create_claim_index(table_name, schema=schema)
    else:
        # Version 4 changed no index: its claim indexes are version 3's.
        create_claim_indexes(table_name, schema=schema, version=min(version, 3))
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
    if version >= 4:
        create_pause_table(table_name, schema=schema)
    if history:
        add_history(table_name, *extra, schema=schema, version=version)
    return table


def drop_job_table(table_name: str, *, schema: str | None = None) -> None:
    """Drop a job table with its trigger and trigger function (whether or not it had them),
    its pause table (if it has one), and its partitioned history table with its partitions,
    if it has one (``DROP TABLE IF EXISTS``: so that it undoes ``create_job_table(...,
    history=True)`` whole, and a downgrade that called :func:`drop_history` first still
    runs)."""
    drop_notify_trigger(table_name, schema=schema)
    history = sa.Table(history_names(table_name, schema).table, sa.MetaData(), schema=schema)
    op.execute(sa.schema.DropTable(history, if_exists=True))
    drop_pause_table(table_name, schema=schema)
    op.drop_table(table_name, schema=schema)


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
