"""The rate table of email_jobs (tests/models.py's EMAIL_JOB_RATES): the recent starts of
its rate-limited queues. Optional, beside a job table of any schema version 4.

Revision ID: 0006_rate_table
Revises: 0005_schema_v4
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_jobs import migrations as jobs

revision: str = "0006_rate_table"
down_revision: str | Sequence[str] | None = "0005_schema_v4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    jobs.create_rate_table("email_jobs")


def downgrade() -> None:
    jobs.drop_rate_table("email_jobs")
