"""The job tables of tests/models.py to schema version 3 (unique jobs), and the schedule
table of their periodic tasks.

The unique columns are added without a rewrite and the unique index is built concurrently
on the live tables.

Revision ID: 0003_unique_jobs
Revises: 0002_claim_indexes
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0003_unique_jobs"
down_revision: str | Sequence[str] | None = "0002_claim_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_unique_keys("email_jobs")
    jobs.add_unique_keys("report_jobs")
    jobs.create_schedule_table("email_job_schedules")


def downgrade() -> None:
    jobs.drop_schedule_table("email_job_schedules")
    jobs.drop_unique_keys("report_jobs")
    jobs.drop_unique_keys("email_jobs")
