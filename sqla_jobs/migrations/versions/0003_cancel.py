"""The default job table to schema version 3, cancel feature: ``cancel_requested_at``.

Adds the nullable column in place (sqla_jobs.migrations.add_cancel): no table rewrite.

Revision ID: sqla_jobs_0003_cancel
Revises: sqla_jobs_0002
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "sqla_jobs_0003_cancel"
down_revision: str | Sequence[str] | None = "sqla_jobs_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_cancel("sqla_jobs")


def downgrade() -> None:
    jobs.drop_cancel("sqla_jobs")
