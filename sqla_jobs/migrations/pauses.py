"""The pause table beside a job table (``sqla_jobs.schema.pauses``): the queues whose
jobs no claim starts (:func:`sqla_jobs.pause_queue`)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from sqla_jobs import ddl
from sqla_jobs.migrations.steps import _execute
from sqla_jobs.schema.pauses import pause_names

# A frozen copy of what sqla_jobs.schema.pauses.pause_table declares (schema version 4):
# a change there needs a new version, not an edit here.
_QUEUE_LENGTH = 200


def create_pause_table(table_name: str, *, schema: str | None = None) -> sa.Table:
    """Create the pause table of job table ``table_name`` (``<table>_pauses``: ``queue``
    varchar(200) primary key, ``paused_at`` timestamptz NOT NULL DEFAULT now(), ``reason``
    text), empty: no queue is paused. Part of schema version 4: every claim statement reads
    it, so it must exist before code of that version claims from the table.

    A new, empty table: it takes no lock of the job table, and can run on a live one.
    ``IF NOT EXISTS``: an upgrade interrupted after it can run again. A revision of yours,
    for a table created by an earlier revision::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.create_pause_table("email_jobs")

        def downgrade() -> None:
            jobs.drop_pause_table("email_jobs")
    """
    n = pause_names(table_name)
    return op.create_table(
        n.table,
        sa.Column("queue", sa.String(_QUEUE_LENGTH), nullable=False),
        sa.Column(
            "paused_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("queue", name=n.primary_key),
        schema=schema,
        if_not_exists=True,
    )


def drop_pause_table(table_name: str, *, schema: str | None = None) -> None:
    """Drop the pause table of ``table_name`` (its pauses with it: every queue runs again).
    ``IF EXISTS``: re-runnable, and safe in a downgrade of a table that never had one."""
    _execute(f"DROP TABLE IF EXISTS {ddl.qualified_name(pause_names(table_name).table, schema)}")
