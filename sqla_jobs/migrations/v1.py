"""Schema version 1, the base of the later ones: the job columns and constraints, the
result table, the one partial claim index and the NOTIFY trigger.

They are frozen copies of what the mixins declared in that version: tests/test_migrations.py
proves that the latest still matches the mixins; a change to the mixins needs a new version,
not an edit here.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.schema import SchemaItem

from sqla_jobs import ddl
from sqla_jobs.migrations.steps import _execute
from sqla_jobs.schema import names

_NAME_LENGTH = 200
_STATUSES = "'pending', 'running', 'succeeded', 'dead', 'cancelled'"

# Version 1: one claim index.
CLAIM_INDEX_COLUMNS = ("queue", "priority", "run_at", "id")
CLAIM_INDEX_PREDICATE = "status IN ('pending', 'running')"


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


def _result_table_items() -> list[SchemaItem]:
    return [
        sa.Column("job_id", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("task", sa.String(_NAME_LENGTH), nullable=False),
        sa.Column("value", JSONB, nullable=True),
        sa.Column(
            "finished_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
    ]


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
