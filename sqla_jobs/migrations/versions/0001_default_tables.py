"""The default job and result tables of sqla_jobs.models (schema version 1).

Revision ID: sqla_jobs_0001
Revises:
Create Date: 2025-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "sqla_jobs_0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = ("sqla_jobs",)
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.create_job_table("sqla_jobs")
    jobs.create_result_table("sqla_jobs_results")


def downgrade() -> None:
    jobs.drop_result_table("sqla_jobs_results")
    jobs.drop_job_table("sqla_jobs")
