"""The claim and completion on a Core Connection run their compiled SQL on the psycopg
connection itself (the worker's hot path). Same statements, same transaction, same results
as through an ORM Session; and never outside a transaction SQLAlchemy knows of."""

from __future__ import annotations

import decimal
import json
import weakref
from functools import partial
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from models import EmailJob
from psycopg.types.json import set_json_loads
from sqlalchemy.orm import Session

import sqla_jobs
from sqla_jobs import JobStatus


def enqueue(engine: sa.Engine, count: int, **values: Any) -> list[int]:
    with Session(engine) as session, session.begin():
        jobs = [EmailJob(task="send", args={"n": n}, **values) for n in range(count)]
        session.add_all(jobs)
        session.flush()
        return [job.id for job in jobs]


def statuses(engine: sa.Engine) -> dict[int, tuple[str, int]]:
    with engine.connect() as connection:
        rows = connection.execute(sa.text("SELECT id, status, attempts FROM email_jobs"))
        return {row.id: (row.status, row.attempts) for row in rows}


def count_driver_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the SQL that the fast path hands to psycopg directly: the statements run on
    cursors opened with an explicit row factory, which SQLAlchemy's own cursors are not."""
    calls: list[str] = []
    ours: weakref.WeakSet[Any] = weakref.WeakSet()
    original_cursor = psycopg.Connection.cursor
    original_execute = psycopg.Cursor.execute

    def cursor(self: psycopg.Connection[Any], *args: Any, **kwargs: Any) -> Any:
        opened = original_cursor(self, *args, **kwargs)
        if "row_factory" in kwargs:
            ours.add(opened)
        return opened

    def execute(self: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        if self in ours:
            calls.append(str(query))
        return original_execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "cursor", cursor)
    monkeypatch.setattr(psycopg.Cursor, "execute", execute)
    return calls


def test_core_connection_claims_and_completes_through_the_driver(
    queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = enqueue(queue_engine, 3, queue="mail", priority=1)
    calls = count_driver_calls(monkeypatch)
    with queue_engine.connect() as connection, connection.begin():
        jobs = sqla_jobs.claim(connection, EmailJob, queues="mail", limit=10, worker="w:1")
        lost = sqla_jobs.complete_many(connection, jobs)
    assert lost == []
    assert sorted(job.id for job in jobs) == ids
    # The rows carry the same Python values the ORM path hands out.
    assert [job.args for job in jobs] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert all(job.attempt == 1 and job.queue == "mail" and job.priority == 1 for job in jobs)
    assert all(job.run_at.tzinfo is not None for job in jobs)
    assert statuses(queue_engine) == dict.fromkeys(ids, (JobStatus.SUCCEEDED.value, 1))
    assert any("FOR UPDATE SKIP LOCKED" in sql for sql in calls)
    assert any(
        sql.startswith("UPDATE email_jobs SET status=CASE") and "'succeeded'" in sql
        for sql in calls
    )


def test_driver_path_is_fenced(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, 2)
    with queue_engine.connect() as connection, connection.begin():
        jobs = sqla_jobs.claim(connection, EmailJob, limit=2, lease=0.01)
    stale = jobs[0]
    with queue_engine.connect() as connection, connection.begin():
        connection.execute(
            sa.text("UPDATE email_jobs SET lease_expires_at = now() - interval '1 second'")
        )
    with queue_engine.connect() as connection, connection.begin():
        again = sqla_jobs.claim(connection, EmailJob, limit=2)
    assert sorted(job.attempt for job in again) == [2, 2]
    with queue_engine.connect() as connection, connection.begin():
        lost = sqla_jobs.complete_many(connection, [stale])
    assert lost == [stale]  # attempt 1 was taken over: its completion matches nothing
    assert statuses(queue_engine)[stale.id] == (JobStatus.RUNNING.value, 2)


def test_rolled_back_transaction_undoes_a_driver_path_claim(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, 1)
    with queue_engine.connect() as connection:
        transaction = connection.begin()
        (job,) = sqla_jobs.claim(connection, EmailJob)
        transaction.rollback()
    assert job.id == job_id
    assert statuses(queue_engine)[job_id] == (JobStatus.PENDING.value, 0)


def test_no_transaction_begun_goes_through_execute(
    queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without begin(), only SQLAlchemy's own execute starts the transaction that commit()
    # then commits; a claim sent past it would be rolled back when the connection closes.
    (job_id,) = enqueue(queue_engine, 1)
    calls = count_driver_calls(monkeypatch)
    with queue_engine.connect() as connection:
        (job,) = sqla_jobs.claim(connection, EmailJob)
        connection.commit()
    assert not any("SKIP LOCKED" in sql for sql in calls)
    assert statuses(queue_engine)[job_id] == (JobStatus.RUNNING.value, 1)
    assert job.attempt == 1


def test_orm_session_goes_through_execute(
    queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue(queue_engine, 1)
    calls = count_driver_calls(monkeypatch)
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(args[2])

    sa.event.listen(queue_engine, "before_cursor_execute", record)
    try:
        with Session(queue_engine) as session, session.begin():
            (job,) = sqla_jobs.claim(session, EmailJob)
            sqla_jobs.complete(session, job)
    finally:
        sa.event.remove(queue_engine, "before_cursor_execute", record)
    assert not any("SKIP LOCKED" in sql for sql in calls)
    assert any("SKIP LOCKED" in sql for sql in seen)


def test_driver_sql_is_compiled_once_per_table_and_dialect(queue_engine: sa.Engine) -> None:
    table = EmailJob.__table__
    first = sqla_jobs._queries.run.driver_sql(
        sqla_jobs._queries.claim, table, queue_engine.dialect, queue_count=1
    )
    again = sqla_jobs._queries.run.driver_sql(
        sqla_jobs._queries.claim, table, queue_engine.dialect, queue_count=1
    )
    assert first is again
    assert first is not None
    assert "%(queue_name)s" in first


def test_schema_translate_map_goes_through_execute(
    queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLAlchemy renders schema names at execution time; compiled text would miss the map.
    (job_id,) = enqueue(queue_engine, 1)
    calls = count_driver_calls(monkeypatch)
    options = {"schema_translate_map": {None: None}}
    with queue_engine.connect().execution_options(**options) as connection, connection.begin():
        (job,) = sqla_jobs.claim(connection, EmailJob)
    assert job.id == job_id
    assert calls == []


def test_prepare_threshold_none_is_respected(queue_engine: sa.Engine) -> None:
    # Behind PgBouncer in transaction mode users turn prepared statements off; so do we.
    enqueue(queue_engine, 12)
    engine = sa.create_engine(queue_engine.url, connect_args={"prepare_threshold": None})
    try:
        with engine.connect() as connection:
            for _ in range(12):
                with connection.begin():
                    jobs = sqla_jobs.claim(connection, EmailJob)
                    sqla_jobs.complete_many(connection, jobs)
            prepared = connection.execute(sa.text("SELECT count(*) FROM pg_prepared_statements"))
            assert prepared.scalar_one() == 0
    finally:
        engine.dispose()
    assert set(statuses(queue_engine).values()) == {(JobStatus.SUCCEEDED.value, 1)}


@pytest.mark.direct_only  # PgBouncer 1.18 in transaction mode cannot route prepared statements
def test_driver_path_prepares_after_the_threshold(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, 12)
    with queue_engine.connect() as connection:
        for _ in range(12):
            with connection.begin():
                jobs = sqla_jobs.claim(connection, EmailJob)
                sqla_jobs.complete_many(connection, jobs)
        prepared = connection.execute(
            sa.text("SELECT statement FROM pg_prepared_statements")
        ).scalars()
        assert any("SKIP LOCKED" in statement for statement in prepared)


def test_driver_errors_are_sqlalchemy_errors(queue_engine: sa.Engine) -> None:
    # Callers catch sqlalchemy.exc.DBAPIError around a claim; the driver path raises the same.
    (job_id,) = enqueue(queue_engine, 1)
    with queue_engine.connect() as connection:
        with connection.begin():
            connection.execute(sa.text("SET TRANSACTION READ ONLY"))
            with pytest.raises(sa.exc.DBAPIError) as info:
                sqla_jobs.claim(connection, EmailJob)
        assert isinstance(info.value.orig, psycopg.errors.ReadOnlySqlTransaction)
        assert "SKIP LOCKED" in str(info.value.statement)
        assert not info.value.connection_invalidated
        with connection.begin():  # the connection is still good for the next transaction
            (job,) = sqla_jobs.claim(connection, EmailJob)
    assert job.id == job_id


def test_a_lost_connection_is_invalidated(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, 1)
    with queue_engine.connect() as connection:
        transaction = connection.begin()
        pid = connection.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with queue_engine.connect() as other:
            other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(sa.exc.OperationalError) as info:
            sqla_jobs.claim(connection, EmailJob)
        transaction.rollback()
        assert info.value.connection_invalidated
        assert connection.invalidated
    with queue_engine.connect() as connection, connection.begin():  # the pool reconnects
        (job,) = sqla_jobs.claim(connection, EmailJob)
    assert job.id == job_id


def test_driver_path_reads_args_as_json_loads_does(queue_engine: sa.Engine) -> None:
    # The fast jsonb loader gives the same values the stock one does: nested, unicode, an
    # escaped surrogate pair, floats and integers, null.
    args = {"a": [1, 2.5, {"b": None}], "é": "ü\U0001f600", "big": 2**70, "t": True}
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="send", args=args))
    with queue_engine.connect() as connection, connection.begin():
        (job,) = sqla_jobs.claim(connection, EmailJob, limit=1)
    assert job.args == args


def test_driver_path_keeps_a_connections_own_json_loads(queue_engine: sa.Engine) -> None:
    # A connection given a loads of its own (here: floats as Decimal) reads args with it.
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="send", args={"price": 1.5}))
    with queue_engine.connect() as connection:
        driver = connection.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        set_json_loads(partial(json.loads, parse_float=decimal.Decimal), driver)
        try:
            with connection.begin():
                (job,) = sqla_jobs.claim(connection, EmailJob, limit=1)
        finally:
            connection.invalidate()  # the pool does not get the customised connection back
    assert job.args == {"price": decimal.Decimal("1.5")}
    assert isinstance(job.args["price"], decimal.Decimal)
