"""The partitioned history table beside a version-3 job table (:mod:`sqla_jobs.history`)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.schema import SchemaItem

from sqla_jobs.migrations.steps import _execute
from sqla_jobs.migrations.v1 import _job_table_items
from sqla_jobs.migrations.v3 import (
    DEAD_INDEX_PREDICATE,
    _cancel_column,
    _ordering_key_columns,
    _trace_context_column,
    _unique_columns,
)
from sqla_jobs.schema.history import (
    PARTITION_KEY,
    RESULT_COLUMN,
    create_default_partition,
    history_names,
)


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
    history``); the day partitions are made by the maintenance too, and until they
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
