"""The job tables of tests/models.py to schema version 3: the trace_context column.

A nullable column, added without a table rewrite (sqla_jobs.migrations.add_trace_context).

Revision ID: 0003_trace_context
Revises: 0002_claim_indexes
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0003_trace_context"
down_revision: str | Sequence[str] | None = "0002_claim_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_trace_context("email_jobs")
    jobs.add_trace_context("report_jobs")


def downgrade() -> None:
    jobs.drop_trace_context("report_jobs")
    jobs.drop_trace_context("email_jobs")
