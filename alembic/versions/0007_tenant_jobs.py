"""tenant_jobs (tests/models.py's TenantJob): a job table of schema version 4 with a tenant
column of its own, and the fair index its fair claims read (FairShare("tenant")).

Revision ID: 0007_tenant_jobs
Revises: 0006_rate_table
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from sqla_jobs import migrations as jobs

revision: str = "0007_tenant_jobs"
down_revision: str | Sequence[str] | None = "0006_rate_table"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.create_job_table("tenant_jobs", sa.Column("tenant", sa.String(50)), version=4)
    jobs.create_fair_index("tenant_jobs", "tenant")


def downgrade() -> None:
    jobs.drop_fair_index("tenant_jobs", "tenant")
    jobs.drop_job_table("tenant_jobs")
