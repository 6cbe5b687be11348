"""The job tables of tests/models.py to schema version 4 (job control), the history table of
archive_jobs with them.

Added in place (sqla_jobs.migrations.upgrade_job_table_to_v4): four columns, no rewrite,
and the empty pause table.

Revision ID: 0005_schema_v4
Revises: 0004_history
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0005_schema_v4"
down_revision: str | Sequence[str] | None = "0004_history"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.upgrade_job_table_to_v4("email_jobs")
    jobs.upgrade_job_table_to_v4("report_jobs")
    jobs.upgrade_job_table_to_v4("archive_jobs")


def downgrade() -> None:
    jobs.downgrade_job_table_to_v3("archive_jobs")
    jobs.downgrade_job_table_to_v3("report_jobs")
    jobs.downgrade_job_table_to_v3("email_jobs")
