"""The default job table to schema version 3: the trace_context column.

A nullable column, added without a table rewrite (sqla_jobs.migrations.add_trace_context).

Revision ID: sqla_jobs_0003_trace_context
Revises: sqla_jobs_0002
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "sqla_jobs_0003_trace_context"
down_revision: str | Sequence[str] | None = "sqla_jobs_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_trace_context("sqla_jobs")


def downgrade() -> None:
    jobs.drop_trace_context("sqla_jobs")
