"""The job tables of tests/models.py to schema version 3, and the schedule table of their
periodic tasks.

Every version-3 feature is added in place (sqla_jobs.migrations.upgrade_job_table_to_v3):
nullable columns without a rewrite, indexes built concurrently on the live tables.

Revision ID: 0003_schema_v3
Revises: 0002_claim_indexes
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0003_schema_v3"
down_revision: str | Sequence[str] | None = "0002_claim_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.upgrade_job_table_to_v3("email_jobs")
    jobs.upgrade_job_table_to_v3("report_jobs")
    jobs.create_schedule_table("email_job_schedules")


def downgrade() -> None:
    jobs.drop_schedule_table("email_job_schedules")
    jobs.downgrade_job_table_to_v2("report_jobs")
    jobs.downgrade_job_table_to_v2("email_jobs")
