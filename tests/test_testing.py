"""The helpers users get for their own tests, used as a user would, in a rolled-back session."""

from __future__ import annotations

import pytest
from models import EmailJob, Order
from sqlalchemy.orm import Session

from sqla_jobs.testing import assert_enqueued, assert_not_enqueued, enqueued


def checkout(session: Session, order_id: int) -> None:
    """Business code under test: commits an order and its receipt job together."""
    with session.begin_nested() if session.in_transaction() else session.begin():
        order = Order(id=order_id, customer="ada")
        session.add(order)
        session.add(EmailJob(task="send_receipt", args={"order": order_id}, order=order))


def test_assert_enqueued_sees_the_jobs_of_the_transaction(db_session: Session) -> None:
    checkout(db_session, 7)
    (job,) = assert_enqueued(db_session, EmailJob, task="send_receipt", args={"order": 7})
    assert job.order_id == 7
    assert_enqueued(db_session, EmailJob, queue="default", count=1)
    assert_not_enqueued(db_session, EmailJob, task="send_invoice")
    assert enqueued(db_session, EmailJob, args={"order": 8}) == []


def test_assert_enqueued_explains_what_it_found(db_session: Session) -> None:
    checkout(db_session, 9)
    with pytest.raises(AssertionError, match=r"found 0; pending: \[\('send_receipt'"):
        assert_enqueued(db_session, EmailJob, task="send_invoice")
    with pytest.raises(AssertionError, match="expected 2"):
        assert_enqueued(db_session, EmailJob, count=2)
