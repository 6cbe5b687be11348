"""The job tables of tests/models.py to schema version 3: ordering keys.

The columns are added without a rewrite; the keyed indexes are built, and the pending index
replaced, concurrently on the live tables (sqla_jobs.migrations.add_ordering_keys).

Revision ID: 0003_ordering_keys
Revises: 0002_claim_indexes
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0003_ordering_keys"
down_revision: str | Sequence[str] | None = "0002_claim_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_ordering_keys("email_jobs")
    jobs.add_ordering_keys("report_jobs")


def downgrade() -> None:
    jobs.drop_ordering_keys("report_jobs")
    jobs.drop_ordering_keys("email_jobs")
