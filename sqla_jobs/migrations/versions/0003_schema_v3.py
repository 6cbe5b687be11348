"""The default job table to schema version 3, and the default schedule table of periodic
tasks (sqla_jobs_schedules).

Every version-3 feature is added in place (sqla_jobs.migrations.upgrade_job_table_to_v3):
nullable columns without a rewrite, indexes built concurrently on the live table.

Revision ID: sqla_jobs_0003
Revises: sqla_jobs_0002
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "sqla_jobs_0003"
down_revision: str | Sequence[str] | None = "sqla_jobs_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.upgrade_job_table_to_v3("sqla_jobs")
    jobs.create_schedule_table("sqla_jobs_schedules")


def downgrade() -> None:
    jobs.drop_schedule_table("sqla_jobs_schedules")
    jobs.downgrade_job_table_to_v2("sqla_jobs")
