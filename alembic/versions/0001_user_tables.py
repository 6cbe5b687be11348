"""Orders, and the job and result tables of tests/models.py.

Revision ID: 0001_user_tables
Revises:
Create Date: 2025-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from sqla_jobs import migrations as jobs

revision: str = "0001_user_tables"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "orders",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("customer", sa.String(100), nullable=False),
    )
    jobs.create_job_table(
        "email_jobs",
        sa.Column("order_id", sa.Integer(), sa.ForeignKey("orders.id"), nullable=True),
    )
    jobs.create_result_table("email_job_results")
    jobs.create_job_table("report_jobs")
    jobs.create_result_table("report_job_results")


def downgrade() -> None:
    jobs.drop_result_table("report_job_results")
    jobs.drop_job_table("report_jobs")
    jobs.drop_result_table("email_job_results")
    jobs.drop_job_table("email_jobs")
    op.drop_table("orders")
