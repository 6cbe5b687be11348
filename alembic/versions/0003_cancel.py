"""The job tables of tests/models.py to schema version 3, cancel feature (the
``cancel_requested_at`` column), added in place.

Revision ID: 0003_cancel
Revises: 0002_claim_indexes
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0003_cancel"
down_revision: str | Sequence[str] | None = "0002_claim_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_cancel("email_jobs")
    jobs.add_cancel("report_jobs")


def downgrade() -> None:
    jobs.drop_cancel("report_jobs")
    jobs.drop_cancel("email_jobs")
