"""Schema version 4: job control (time limits, snoozes, progress, attempt starts: four
columns) and the pause table beside each job table (:mod:`sqla_jobs.migrations.pauses`),
with the in-place helpers for a live version-3 table (and its history table, if it has
one), and the upgrade.

A frozen copy of what the mixins declared in that version, like :mod:`~sqla_jobs.migrations.v3`:
a change to the mixins needs a new version, not an edit here.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from sqla_jobs import ddl
from sqla_jobs.migrations.pauses import create_pause_table, drop_pause_table
from sqla_jobs.migrations.steps import _execute
from sqla_jobs.schema.history import history_names

# Version 4 (job control): the job's own time limit, how often it snoozed, its progress.
TIME_LIMIT_COLUMN = "time_limit"
SNOOZES_COLUMN = "snoozes"
PROGRESS_COLUMN = "progress"
ATTEMPTED_AT_COLUMN = "attempted_at"


def _job_control_columns() -> list[sa.Column[Any]]:
    """The version-4 columns as the job table has them."""
    return [
        sa.Column(TIME_LIMIT_COLUMN, sa.Interval(), nullable=True),
        sa.Column(SNOOZES_COLUMN, sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(PROGRESS_COLUMN, JSONB, nullable=True),
        sa.Column(ATTEMPTED_AT_COLUMN, sa.DateTime(timezone=True), nullable=True),
    ]


def _history_job_control_columns() -> list[sa.Column[Any]]:
    """The version-4 columns as a history table has them: the same (the history keeps the
    default of ``snoozes``: :func:`sqla_jobs.schema.history.history_table`)."""
    return _job_control_columns()


def add_job_control(table_name: str, *, schema: str | None = None) -> None:
    """Upgrade a version-3 job table to version 4 in place: add the ``time_limit``,
    ``snoozes``, ``progress`` and ``attempted_at`` columns, to the job table and to its
    partitioned history table if it has one.

    Three nullable columns without a default, and ``snoozes integer NOT NULL DEFAULT 0``:
    PostgreSQL (11 and later) adds all four without rewriting the table or reading a row,
    under a brief ``ACCESS EXCLUSIVE`` lock (set a ``lock_timeout`` in the revision on a busy
    table). Deploy the revision before the code that declares the columns: the claim
    returns ``time_limit`` and sets ``attempted_at``. Re-runnable (``IF NOT EXISTS``).

    A revision of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.add_job_control("email_jobs")

        def downgrade() -> None:
            jobs.drop_job_control("email_jobs")
    """
    job = ddl.qualified_name(table_name, schema)
    history = ddl.qualified_name(history_names(table_name, schema).table, schema)
    _execute(
        f"ALTER TABLE {job} ADD COLUMN IF NOT EXISTS {TIME_LIMIT_COLUMN} interval, "
        f"ADD COLUMN IF NOT EXISTS {SNOOZES_COLUMN} integer NOT NULL DEFAULT 0, "
        f"ADD COLUMN IF NOT EXISTS {PROGRESS_COLUMN} jsonb, "
        f"ADD COLUMN IF NOT EXISTS {ATTEMPTED_AT_COLUMN} timestamptz"
    )
    _execute(
        f"ALTER TABLE IF EXISTS {history} ADD COLUMN IF NOT EXISTS {TIME_LIMIT_COLUMN} interval, "
        f"ADD COLUMN IF NOT EXISTS {SNOOZES_COLUMN} integer NOT NULL DEFAULT 0, "
        f"ADD COLUMN IF NOT EXISTS {PROGRESS_COLUMN} jsonb, "
        f"ADD COLUMN IF NOT EXISTS {ATTEMPTED_AT_COLUMN} timestamptz"
    )


def drop_job_control(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`add_job_control`: drop the four columns (with the jobs' time limits,
    snooze counts, progress and attempt starts), from the history table too."""
    columns = (TIME_LIMIT_COLUMN, SNOOZES_COLUMN, PROGRESS_COLUMN, ATTEMPTED_AT_COLUMN)
    drops = ", ".join(f"DROP COLUMN IF EXISTS {column}" for column in columns)
    history = ddl.qualified_name(history_names(table_name, schema).table, schema)
    _execute(f"ALTER TABLE IF EXISTS {history} {drops}")
    _execute(f"ALTER TABLE {ddl.qualified_name(table_name, schema)} {drops}")


def upgrade_job_table_to_v4(table_name: str, *, schema: str | None = None) -> None:
    """Upgrade a live version-3 job table (and its history table) to version 4: job control
    (:func:`add_job_control`) and the pause table
    (:func:`~sqla_jobs.migrations.create_pause_table`, a new empty table). No rewrite, no
    index; each step can run again. A revision of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.upgrade_job_table_to_v4("email_jobs")

        def downgrade() -> None:
            jobs.downgrade_job_table_to_v3("email_jobs")
    """
    add_job_control(table_name, schema=schema)
    create_pause_table(table_name, schema=schema)


def downgrade_job_table_to_v3(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`upgrade_job_table_to_v4` (the pauses go with their table: every queue
    runs again)."""
    drop_pause_table(table_name, schema=schema)
    drop_job_control(table_name, schema=schema)
