"""``repr()`` of a job never loads anything: no SQL, no DetachedInstanceError."""

from __future__ import annotations

import sqlalchemy as sa
from models import EmailJob
from no_sql import no_sql
from sqlalchemy.orm import Session


def test_repr_of_an_expired_job_after_its_session_closed(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        job = EmailJob(task="send_receipt", queue="email")
        session.add(job)
        session.flush()
        job_id = job.id
    # committed (every attribute expired) and detached: reading job.task would raise
    # DetachedInstanceError
    with no_sql(queue_engine):
        assert repr(job) == f"<EmailJob id={job_id}>"


def test_repr_of_a_loaded_job(queue_engine: sa.Engine) -> None:
    with Session(queue_engine, expire_on_commit=False) as session, session.begin():
        job = EmailJob(task="send_receipt", queue="email")
        session.add(job)
    with no_sql(queue_engine):
        assert repr(job) == (
            f"<EmailJob id={job.id} task='send_receipt' queue='email' status=pending attempts=0/20>"
        )


def test_repr_of_a_partly_expired_job_in_a_session_loads_nothing(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t", queue="q"))
    with Session(queue_engine) as session:
        job = session.scalars(sa.select(EmailJob)).one()
        session.expire(job, ["status", "attempts"])
        with no_sql(queue_engine):
            assert repr(job) == f"<EmailJob id={job.id} task='t' queue='q' attempts=?/20>"


def test_repr_of_a_new_job_shows_what_was_set() -> None:
    assert repr(EmailJob(task="t", max_attempts=3)) == "<EmailJob id=None task='t' attempts=?/3>"
