"""Jobs in every state, for the dashboard's tests (tests/models.py's EmailJob table)."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from models import EmailJob, EmailJobResult

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "tasks.py", line 12, in charge\n'
    "    raise ValueError(msg)\n"
    "ValueError: card <declined> & 'refused'\n"
)


@dataclass(frozen=True)
class Seeded:
    pending: int
    running: int
    succeeded: int
    dead: int
    cancelled: int


def seed(engine: sa.Engine) -> Seeded:
    """One job in each state; the succeeded one has a stored result."""
    now = sa.func.now()

    def add(connection: sa.Connection, **values: object) -> int:
        values.setdefault("queue", "email")
        values.setdefault("task", "send_receipt")
        job_id: int = connection.execute(
            sa.insert(EmailJob).values(**values).returning(EmailJob.id)
        ).scalar_one()
        return job_id

    with engine.begin() as connection:
        pending = add(connection, args={"order": 1, "note": "<b>bold</b>"})
        running = add(
            connection,
            status="running",
            attempts=1,
            leased_by="host:1",
            lease_expires_at=now + sa.text("interval '1 hour'"),
            attempted_at=now - sa.text("interval '20 seconds'"),
            time_limit=sa.text("interval '1 minute'"),
            progress={"value": 0.4, "message": "4 of 10 pages"},
        )
        succeeded = add(
            connection,
            queue="billing",
            task="charge",
            status="succeeded",
            attempts=1,
            finished_at=now,
        )
        dead = add(
            connection,
            queue="billing",
            task="charge",
            args={"order": 4, "amount": 12.5},
            status="dead",
            attempts=3,
            max_attempts=3,
            finished_at=now,
            last_error=TRACEBACK,
        )
        cancelled = add(connection, status="cancelled", finished_at=now)
        connection.execute(
            sa.insert(EmailJobResult).values(
                job_id=succeeded, task="charge", value={"receipt": "R-77"}
            )
        )
    return Seeded(pending, running, succeeded, dead, cancelled)


def statuses(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as connection:
        rows = connection.execute(sa.select(EmailJob.id, EmailJob.status)).all()
    return {row[0]: row[1] for row in rows}
