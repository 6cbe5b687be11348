"""The default job table to schema version 3: ordering keys.

Adds the ordering_key and key_limit columns (no rewrite), builds the keyed indexes and
replaces the pending index concurrently on the live table
(sqla_jobs.migrations.add_ordering_keys).

Revision ID: sqla_jobs_0003_ordering_keys
Revises: sqla_jobs_0002
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "sqla_jobs_0003_ordering_keys"
down_revision: str | Sequence[str] | None = "sqla_jobs_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.add_ordering_keys("sqla_jobs")


def downgrade() -> None:
    jobs.drop_ordering_keys("sqla_jobs")
