"""The job table of tests/models.py's ArchiveJob, with its partitioned history (version 3).

Revision ID: 0004_history
Revises: 0003_schema_v3
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from sqla_jobs import migrations as jobs

revision: str = "0004_history"
down_revision: str | Sequence[str] | None = "0003_schema_v3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.create_job_table(
        "archive_jobs", sa.Column("tenant", sa.String(50), nullable=True), version=3, history=True
    )


def downgrade() -> None:
    jobs.drop_history("archive_jobs")
    jobs.drop_job_table("archive_jobs")
