"""The ORM INSERT of a job sends only the columns the caller set; the database fills in the
rest, and the flush reads those defaults back (RETURNING), with no extra query."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from models import EmailJob
from sqlalchemy import event
from sqlalchemy.orm import Session

from sqla_jobs.models import Job, metadata
from sqla_jobs.validation import DEFAULT_MAX_ATTEMPTS

_INSERT = re.compile(r"\s*INSERT INTO (\w+) \(([^)]*)\)", re.IGNORECASE)


@pytest.fixture(scope="module")
def job_engine(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    """A database with the library's own tables (sqla_jobs.models); tests roll back."""
    engine = sa.create_engine(fresh_database("sqla_jobs_orm"))
    metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def recorded(engine: sa.Engine) -> Iterator[list[tuple[str, Any]]]:
    """Every (statement, parameters) sent to the driver inside the block."""
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", record)


def inserts(sent: list[tuple[str, Any]], table: str) -> list[tuple[list[str], Any]]:
    """The column list and parameters of each INSERT INTO ``table`` that was sent."""
    found = []
    for statement, parameters in sent:
        match = _INSERT.match(statement)
        if match and match.group(1) == table:
            found.append(([name.strip() for name in match.group(2).split(",")], parameters))
    return found


def parameter_count(parameters: Any) -> int:
    if isinstance(parameters, dict):
        return len(parameters)
    return sum(parameter_count(p) for p in parameters) if isinstance(parameters, list) else 1


def test_insert_sends_only_the_columns_that_were_set(job_engine: sa.Engine) -> None:
    with Session(job_engine) as session, session.begin():
        with recorded(job_engine) as sent:
            session.add(Job(task="send_receipt", args={"order": 7}))
            session.flush()
        ((columns, parameters),) = inserts(sent, "sqla_jobs")
        assert columns == ["task", "args"]
        assert parameter_count(parameters) == 2

        with recorded(job_engine) as sent:
            session.add_all([Job(task="t", args={"i": i}) for i in range(50)])
            session.add(Job(task="t", args={}, queue="email", priority=5))
            session.add(Job(task="only_task"))
            session.flush()
        # Rows are grouped by the set of columns they carry; each group sends its own.
        found = inserts(sent, "sqla_jobs")
        assert sorted(columns for columns, _ in found) == [
            ["queue", "task", "args", "priority"],
            ["task"],
            ["task", "args"],
        ]
        assert sum(parameter_count(parameters) for _, parameters in found) == 50 * 2 + 4 + 1
        session.rollback()


def test_a_models_own_columns_follow_sqlalchemys_rules(queue_engine: sa.Engine) -> None:
    # The mixin's columns are left out when unset; a model's own nullable column without a
    # default is still sent as NULL (SQLAlchemy's behaviour, not ours to change).
    with Session(queue_engine) as session, session.begin():
        with recorded(queue_engine) as sent:
            session.add(EmailJob(task="send_receipt", args={"order": 7}))
            session.flush()
        ((columns, _parameters),) = inserts(sent, "email_jobs")
        assert columns == ["order_id", "task", "args"]
        session.rollback()


def test_unset_columns_read_none_before_the_flush_and_defaults_after(
    job_engine: sa.Engine,
) -> None:
    with Session(job_engine) as session, session.begin():
        job = Job(task="send_receipt", args={"order": 7})
        bare = Job(task="no_args")
        unset = ("queue", "status", "priority", "run_at", "attempts", "max_attempts", "created_at")
        assert [getattr(job, key) for key in unset] == [None] * len(unset)
        assert sa.inspect(bare).attrs.args.value is None
        session.add_all([job, bare])
        session.flush()
        db_now = session.execute(sa.select(sa.func.now())).scalar_one()

        # The flush read every default back: reading them now sends nothing.
        with recorded(job_engine) as sent:
            for row in (job, bare):
                assert row.id is not None
                assert row.status == "pending"
                assert row.queue == "default"
                assert (row.attempts, row.max_attempts, row.priority) == (
                    0,
                    DEFAULT_MAX_ATTEMPTS,
                    0,
                )
                assert isinstance(row.run_at, datetime)
                assert row.run_at == row.created_at == db_now  # the transaction's clock
                assert row.lease_expires_at is None
                assert row.leased_by is None
                assert row.last_error is None
                assert row.finished_at is None
            assert job.args == {"order": 7}
            assert bare.args == {}
        assert sent == []
        session.rollback()


def test_what_the_flush_read_back_is_what_the_database_stored(job_engine: sa.Engine) -> None:
    with Session(job_engine) as session, session.begin():
        job = Job(task="send_receipt", args={"order": 7}, max_attempts=3)
        session.add(job)
        session.flush()
        seen = {c.key: getattr(job, c.key) for c in sa.inspect(Job).column_attrs}
        table = Job.__table__
        stored = session.execute(sa.select(table).where(table.c.id == job.id)).one()
        assert seen == dict(stored._mapping)
        assert seen["max_attempts"] == 3
        session.rollback()
