"""The job tables of tests/models.py to schema version 2 (the pending and running indexes).

Built concurrently on the live tables; the version-1 claim indexes are dropped.

Revision ID: 0002_claim_indexes
Revises: 0001_user_tables
Create Date: 2025-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0002_claim_indexes"
down_revision: str | Sequence[str] | None = "0001_user_tables"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.upgrade_job_table_to_v2("email_jobs")
    jobs.upgrade_job_table_to_v2("report_jobs")


def downgrade() -> None:
    jobs.downgrade_job_table_to_v1("report_jobs")
    jobs.downgrade_job_table_to_v1("email_jobs")
