"""The partitioned history table beside a version-3 or 4 job table (:mod:`sqla_jobs.history`)."""

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
from sqla_jobs.migrations.v4 import _history_job_control_columns
from sqla_jobs.schema.history import (
    PARTITION_KEY,
    RESULT_COLUMN,
    SNOOZES_COLUMN,
    create_default_partition,
    history_names,
)


def _history_items(
    table_name: str, extra: tuple[SchemaItem, ...], version: int
) -> list[SchemaItem]:
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
    if version >= 4:
        v3_columns += _history_job_control_columns()
    for item in (*_job_table_items(table_name), *v3_columns, *extra):
        if isinstance(item, sa.Column):
            nullable = False if item.name in ("id", PARTITION_KEY) else item.nullable
            # Without defaults, but the snooze count's (version 4; see history_table).
            kept = item.server_default if item.name == SNOOZES_COLUMN else None
            default = kept.arg if isinstance(kept, sa.DefaultClause) else None
            assert default is None or isinstance(default, str | sa.TextClause)
            columns.append(
                sa.Column(item.name, item.type, nullable=bool(nullable), server_default=default)
            )
    columns.append(sa.Column(RESULT_COLUMN, JSONB, nullable=True))
    columns.append(
        sa.PrimaryKeyConstraint("id", PARTITION_KEY, name=history_names(table_name).primary_key)
    )
    return columns


def add_history(
    table_name: str, *extra: SchemaItem, schema: str | None = None, version: int = 3
) -> sa.Table:
    """Create the partitioned history table of job table ``table_name`` (of schema
    ``version`` 3, as when this helper was written, or 4: the job table's version), with its
    ``DEFAULT`` partition, for a model with ``partitioned_history = True``.

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
    if version not in (3, 4):
        raise ValueError(f"a history table is of schema version 3 or 4, not {version!r}")
    n = history_names(table_name, schema)
    table = op.create_table(
        n.table,
        *_history_items(table_name, extra, version),
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
