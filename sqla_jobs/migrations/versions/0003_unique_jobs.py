"""The default job table to schema version 3 (unique jobs), and the default schedule table
of periodic tasks (sqla_jobs_schedules).

Adds the unique columns without a rewrite and builds the unique index concurrently on the
live table (sqla_jobs.migrations.add_unique_keys).

Revision ID: sqla_jobs_0003_unique_jobs
Revises: sqla_jobs_0002
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "sqla_jobs_0003_unique_jobs"
down_revision: str | Sequence[str] | None = "sqla_jobs_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_unique_keys("sqla_jobs")
    jobs.create_schedule_table("sqla_jobs_schedules")


def downgrade() -> None:
    jobs.drop_schedule_table("sqla_jobs_schedules")
    jobs.drop_unique_keys("sqla_jobs")
