"""The default job table to schema version 4 (job control: time limits, snoozes, progress,
attempt starts).

Added in place (sqla_jobs.migrations.upgrade_job_table_to_v4): four columns, no rewrite,
and the empty pause table.

Revision ID: sqla_jobs_0004
Revises: sqla_jobs_0003
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "sqla_jobs_0004"
down_revision: str | Sequence[str] | None = "sqla_jobs_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.upgrade_job_table_to_v4("sqla_jobs")


def downgrade() -> None:
    jobs.downgrade_job_table_to_v3("sqla_jobs")
