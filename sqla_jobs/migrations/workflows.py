"""Alembic operations for workflows (:mod:`sqla_jobs.schema.workflows`): the workflow table,
and the step columns, index, status check and trigger on a job table.

A frozen copy of what the mixins declare (workflow schema version 1), like the job table's
versions: a later change ships as new helpers, never as a change to what these build.

A revision of yours, for ``OrderWorkflow(WorkflowMixin, Base)`` and ``OrderJob(StepMixin,
JobMixin, Base)`` on an existing job table::

    from sqla_jobs import migrations as jobs

    def upgrade() -> None:
        jobs.create_workflow_table(
            "order_workflows", sa.Column("order_id", sa.Integer, sa.ForeignKey("orders.id"))
        )
        jobs.add_workflow_steps("order_jobs", "order_workflows")

    def downgrade() -> None:
        jobs.drop_workflow_steps("order_jobs", "order_workflows")
        jobs.drop_workflow_table("order_workflows")
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.schema import SchemaItem

from sqla_jobs import ddl
from sqla_jobs.migrations.steps import (
    _add_columns,
    _drop_columns,
    _drop_index,
    _execute,
    _unattached_partitions,
)
from sqla_jobs.naming import identifier, names
from sqla_jobs.schema.history import history_names
from sqla_jobs.schema.workflows import (
    drop_step_trigger_sql,
    step_trigger_sql,
    workflow_names,
)

__all__ = [
    "add_history_steps",
    "add_workflow_steps",
    "create_workflow_table",
    "drop_history_steps",
    "drop_workflow_steps",
    "drop_workflow_table",
]

# Frozen: the workflow table's columns and indexes, and the step columns, as version 1.
_NAME_LENGTH = 200
_UNIQUE_KEY_LENGTH = 255
_STEP_COLUMNS = (
    "workflow_id bigint",
    "step varchar(200)",
    "depends_on bigint[]",
    "dependents bigint[]",
    "waiting_for integer",
    "if_dependency_fails varchar(8)",
    "blocked_by bigint",
)
_STEP_INDEX_COLUMNS = ("workflow_id", "step")
_STEP_INDEX_PREDICATE = "workflow_id IS NOT NULL"
_HISTORY_INDEX_COLUMN = "workflow_id"
_PLAIN_STATUSES = ("pending", "running", "succeeded", "dead", "cancelled")
_STEP_STATUSES = ("waiting", *_PLAIN_STATUSES)
_WORKFLOW_STATUSES = ("running", "succeeded", "failed", "cancelled")


def _statuses(statuses: tuple[str, ...]) -> str:
    return ", ".join(f"'{status}'" for status in statuses)


def create_workflow_table(
    table_name: str, *extra: SchemaItem, schema: str | None = None
) -> sa.Table:
    """Create the table of a :class:`~sqla_jobs.schema.workflows.WorkflowMixin` model, with
    its unique index (one running workflow per unique key), its index of finished
    workflows, and its status check. ``extra``: your model's own columns and constraints."""
    running = "status = 'running'"
    table = op.create_table(
        table_name,
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("name", sa.String(_NAME_LENGTH), server_default="", nullable=False),
        sa.Column("status", sa.String(16), server_default="running", nullable=False),
        sa.Column("steps_total", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("steps_left", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("steps_failed", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("unique_key", sa.String(_UNIQUE_KEY_LENGTH), nullable=True),
        sa.Column(
            "trace_context",
            JSONB(),  # type: ignore[no-untyped-call, unused-ignore]
            nullable=True,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),
            nullable=False,
        ),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            f"status IN ({_statuses(_WORKFLOW_STATUSES)})",
            name=workflow_names("", table_name).workflow_status_check,
        ),
        *extra,
        schema=schema,
    )
    n = workflow_names("", table_name)
    op.create_index(
        n.workflow_unique_index,
        table_name,
        ["unique_key"],
        unique=True,
        schema=schema,
        postgresql_where=sa.text(f"unique_key IS NOT NULL AND {running}"),
    )
    op.create_index(
        n.workflow_finished_index,
        table_name,
        ["finished_at", "id"],
        schema=schema,
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    return table


def drop_workflow_table(table_name: str, *, schema: str | None = None) -> None:
    """Drop a workflow table (drop its job table's steps first:
    :func:`drop_workflow_steps`)."""
    op.drop_table(table_name, schema=schema)


def add_workflow_steps(
    job_table: str,
    workflow_table: str,
    *,
    schema: str | None = None,
    workflow_schema: str | None = None,
    concurrently: bool = False,
    history: bool = False,
) -> None:
    """Let job table ``job_table``'s jobs be steps of the workflows in ``workflow_table``:
    add the seven step columns (nullable, no default: no rewrite), allow the ``waiting``
    status (the check is replaced ``NOT VALID``, then validated without blocking writes),
    build the step index (``concurrently``: in Alembic's ``autocommit_block()``, for a live
    table), and create the workflow trigger and its function. Re-runnable.

    ``history``: the table has a partitioned history (``partitioned_history = True``),
    which gets the step columns too, and its workflow index
    (:func:`add_history_steps`)."""
    n = names(job_table)
    w = workflow_names(job_table, workflow_table)
    table = ddl.qualified_name(job_table, schema)
    _add_columns(job_table, schema, *_STEP_COLUMNS)
    _execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {ddl.quote(n.status_check)}")
    _execute(
        f"ALTER TABLE {table} ADD CONSTRAINT {ddl.quote(n.status_check)} "
        f"CHECK (status IN ({_statuses(_STEP_STATUSES)})) NOT VALID"
    )
    _execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {ddl.quote(n.status_check)}")
    _create_step_index(job_table, w.step_index, schema=schema, concurrently=concurrently)
    for sql in drop_step_trigger_sql(job_table, workflow_table, schema=schema):
        _execute(sql)
    for sql in step_trigger_sql(
        job_table, workflow_table, schema=schema, workflow_schema=workflow_schema
    ):
        _execute(sql)
    if history:
        add_history_steps(job_table, schema=schema, concurrently=concurrently)


def add_history_steps(
    job_table: str, *, schema: str | None = None, concurrently: bool = False
) -> None:
    """Give the partitioned history of job table ``job_table`` the seven step columns (the
    partitions get them with the parent, no rewrite) and the workflow index, ``(workflow_id)
    WHERE workflow_id IS NOT NULL``, by which a retry brings an ended workflow's steps back.
    Re-runnable; :func:`add_workflow_steps` calls it with ``history=True``.

    A partitioned table cannot be indexed ``CONCURRENTLY``: with ``concurrently``, the
    parent's index is made ``ON ONLY`` (invalid, and copied onto every partition made from
    then on), each partition's is built concurrently in Alembic's ``autocommit_block()`` and
    attached, and the parent's turns valid with the last. Without, one ``CREATE INDEX``
    builds them all, while inserts into the history (completions of a model without steps,
    the mover) wait for it."""
    n = history_names(job_table, schema)
    history = ddl.qualified_name(n.table, schema)
    _add_columns(n.table, schema, *_STEP_COLUMNS)
    only = "ONLY " if concurrently else ""
    _execute(
        f"CREATE INDEX IF NOT EXISTS {ddl.quote(n.workflow_index)} ON {only}{history} "
        f"({_HISTORY_INDEX_COLUMN}) WHERE {_STEP_INDEX_PREDICATE}"
    )
    if not concurrently:
        return
    index = ddl.qualified_name(n.workflow_index, schema)
    with op.get_context().autocommit_block():
        for partition in _unattached_partitions(history, index):
            own = identifier(partition, "workflow_idx")
            _execute(
                f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {ddl.quote(own)} "
                f"ON {ddl.qualified_name(partition, schema)} "
                f"({_HISTORY_INDEX_COLUMN}) WHERE {_STEP_INDEX_PREDICATE}"
            )
            _execute(f"ALTER INDEX {index} ATTACH PARTITION {ddl.qualified_name(own, schema)}")


def drop_history_steps(job_table: str, *, schema: str | None = None) -> None:
    """Undo :func:`add_history_steps`: the workflow index (with its partitions' copies)
    and the step columns of the history of ``job_table``."""
    n = history_names(job_table, schema)
    _execute(f"DROP INDEX IF EXISTS {ddl.qualified_name(n.workflow_index, schema)}")
    _drop_columns(n.table, schema, *(column.split()[0] for column in _STEP_COLUMNS))


def _create_step_index(
    job_table: str, name: str, *, schema: str | None, concurrently: bool
) -> None:
    options: dict[str, Any] = {
        "schema": schema,
        "unique": True,
        "postgresql_where": sa.text(_STEP_INDEX_PREDICATE),
        "if_not_exists": True,
    }
    if not concurrently:
        op.create_index(name, job_table, list(_STEP_INDEX_COLUMNS), **options)
        return
    options["postgresql_concurrently"] = True
    with op.get_context().autocommit_block():
        op.create_index(name, job_table, list(_STEP_INDEX_COLUMNS), **options)


def drop_workflow_steps(
    job_table: str, workflow_table: str, *, schema: str | None = None, history: bool = False
) -> None:
    """Undo :func:`add_workflow_steps`: the trigger, the step index, the step columns, and
    the ``waiting`` status (fails while a job is waiting: cancel its workflow first);
    ``history``: the history's too (:func:`drop_history_steps`)."""
    if history:
        drop_history_steps(job_table, schema=schema)
    n = names(job_table)
    w = workflow_names(job_table, workflow_table)
    table = ddl.qualified_name(job_table, schema)
    for sql in drop_step_trigger_sql(job_table, workflow_table, schema=schema):
        _execute(sql)
    _drop_index(w.step_index, job_table, schema=schema, concurrently=False, if_exists=True)
    _drop_columns(job_table, schema, *(column.split()[0] for column in _STEP_COLUMNS))
    _execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {ddl.quote(n.status_check)}")
    _execute(
        f"ALTER TABLE {table} ADD CONSTRAINT {ddl.quote(n.status_check)} "
        f"CHECK (status IN ({_statuses(_PLAIN_STATUSES)}))"
    )
