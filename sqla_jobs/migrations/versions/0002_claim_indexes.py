"""The default job table to schema version 2: the pending and running claim indexes.

Builds them concurrently on the live table and drops the version-1 claim index
(sqla_jobs.migrations.upgrade_job_table_to_v2).

Revision ID: sqla_jobs_0002
Revises: sqla_jobs_0001
Create Date: 2025-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "sqla_jobs_0002"
down_revision: str | Sequence[str] | None = "sqla_jobs_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.upgrade_job_table_to_v2("sqla_jobs")


def downgrade() -> None:
    jobs.downgrade_job_table_to_v1("sqla_jobs")
