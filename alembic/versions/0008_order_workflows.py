"""order_workflows and order_jobs (tests/models.py's OrderWorkflow, OrderJob and
OrderJobResult): a workflow table with a foreign key to the order, and a job table of
schema version 4 whose jobs can be its steps.

Revision ID: 0008_order_workflows
Revises: 0007_tenant_jobs
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from sqla_jobs import migrations as jobs

revision: str = "0008_order_workflows"
down_revision: str | Sequence[str] | None = "0007_tenant_jobs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.create_workflow_table(
        "order_workflows", sa.Column("order_id", sa.Integer, sa.ForeignKey("orders.id"))
    )
    jobs.create_job_table(
        "order_jobs", sa.Column("order_id", sa.Integer, sa.ForeignKey("orders.id")), version=4
    )
    jobs.add_workflow_steps("order_jobs", "order_workflows")
    jobs.create_result_table("order_job_results")


def downgrade() -> None:
    jobs.drop_result_table("order_job_results")
    jobs.drop_workflow_steps("order_jobs", "order_workflows")
    jobs.drop_job_table("order_jobs")
    jobs.drop_workflow_table("order_workflows")
