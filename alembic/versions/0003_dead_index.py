"""The job tables of tests/models.py to schema version 3 (health): the dead index.

Built concurrently on the live tables (sqla_jobs.migrations.add_dead_index).

Revision ID: 0003_dead_index
Revises: 0002_claim_indexes
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0003_dead_index"
down_revision: str | Sequence[str] | None = "0002_claim_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_dead_index("email_jobs")
    jobs.add_dead_index("report_jobs")


def downgrade() -> None:
    jobs.drop_dead_index("report_jobs")
    jobs.drop_dead_index("email_jobs")
