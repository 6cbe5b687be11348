"""sqla_jobs.commit: a connection lost while COMMIT is in flight is CommitUnknownError; every
other failure is raised as it was (the transaction did not commit)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from models import EmailJob
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

import sqla_jobs
import sqla_jobs.aio
from sqla_jobs import CommitUnknownError, ConfigurationError

pytestmark = pytest.mark.direct_only  # it terminates the server backend of its own session

GATE = "commit_gate"


@pytest.fixture
def gate(queue_engine: sa.Engine) -> Iterator[str]:
    """A table whose rows are checked at COMMIT: a deferred unique key, and a deferred
    constraint trigger that sleeps for the rows whose ``k`` is negative (a COMMIT that
    stays in flight long enough to lose its connection)."""
    with queue_engine.begin() as connection:
        connection.exec_driver_sql(
            f"CREATE TABLE {GATE} (k integer, UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)"
        )
        connection.exec_driver_sql(
            f"CREATE FUNCTION {GATE}_slow() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN IF NEW.k < 0 THEN PERFORM pg_sleep(60); END IF; RETURN NULL; END $$"
        )
        connection.exec_driver_sql(
            f"CREATE CONSTRAINT TRIGGER {GATE}_slow AFTER INSERT ON {GATE} "
            f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {GATE}_slow()"
        )
    try:
        yield GATE
    finally:
        with queue_engine.begin() as connection:
            connection.exec_driver_sql(f"DROP TABLE {GATE}")
            connection.exec_driver_sql(f"DROP FUNCTION {GATE}_slow()")


def jobs(engine: sa.Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(sa.select(sa.func.count()).select_from(EmailJob)) or 0)


def test_commit_commits_the_jobs_and_the_business_rows(queue_engine: sa.Engine, gate: str) -> None:
    with Session(queue_engine) as session:
        session.add(EmailJob(task="send", args={"to": "a@example.com"}))
        session.execute(sa.text(f"INSERT INTO {gate} VALUES (1)"))
        sqla_jobs.commit(session)
    assert jobs(queue_engine) == 1
    with queue_engine.connect() as connection:
        assert connection.scalar(sa.text(f"SELECT count(*) FROM {gate}")) == 1


def _terminate_when_committing(engine: sa.Engine, pid: int, done: threading.Event) -> None:
    """Terminate backend ``pid`` once it sleeps inside its COMMIT (the deferred trigger)."""
    deadline = time.monotonic() + 30
    with engine.connect() as connection:
        while time.monotonic() < deadline and not done.is_set():
            state = connection.execute(
                sa.text("SELECT query, wait_event FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            ).one_or_none()
            connection.rollback()
            if state is not None and state.query == "COMMIT" and state.wait_event == "PgSleep":
                connection.execute(sa.select(sa.func.pg_terminate_backend(pid)))
                return
            time.sleep(0.02)


def test_a_connection_lost_during_commit_is_commit_unknown(
    queue_engine: sa.Engine, gate: str
) -> None:
    done = threading.Event()
    with Session(queue_engine) as session:
        session.add(EmailJob(task="send", args={"to": "b@example.com"}))
        session.execute(sa.text(f"INSERT INTO {gate} VALUES (-1)"))  # sleeps at COMMIT
        pid = session.scalar(sa.select(sa.func.pg_backend_pid()))
        assert isinstance(pid, int)
        killer = threading.Thread(target=_terminate_when_committing, args=(queue_engine, pid, done))
        killer.start()
        try:
            with pytest.raises(CommitUnknownError, match="may or may not have committed") as info:
                sqla_jobs.commit(session)
        finally:
            done.set()
            killer.join()
        assert isinstance(info.value.__cause__, DBAPIError)
        assert info.value.__cause__.connection_invalidated
        # The session was rolled back, as after any failed commit, and works again.
        session.add(EmailJob(task="send", args={"to": "c@example.com"}))
        sqla_jobs.commit(session)
    # This COMMIT was cut off before its commit record: only the second job is there.
    with queue_engine.connect() as connection:
        assert connection.scalars(sa.select(EmailJob.args["to"].as_string())).all() == [
            "c@example.com"
        ]


def test_an_error_of_the_rows_is_raised_as_it_is_from_the_flush(
    queue_engine: sa.Engine,
) -> None:
    with Session(queue_engine) as session:
        session.add(EmailJob(task="send", args={}, order_id=424242))  # no such order
        with pytest.raises(IntegrityError, match="foreign key") as info:
            sqla_jobs.commit(session)
        assert info.value.statement is not None
        assert "INSERT" in info.value.statement
    assert jobs(queue_engine) == 0


def test_an_error_the_server_returns_for_the_commit_is_raised_as_it_is(
    queue_engine: sa.Engine, gate: str
) -> None:
    with Session(queue_engine) as session:
        session.add(EmailJob(task="send", args={}))
        session.execute(sa.text(f"INSERT INTO {gate} VALUES (7), (7)"))  # deferred: at COMMIT
        with pytest.raises(IntegrityError) as info:
            sqla_jobs.commit(session)
        assert not isinstance(info.value, CommitUnknownError)
    assert jobs(queue_engine) == 0


def test_commit_refuses_what_is_not_a_session_before_any_sql(queue_engine: sa.Engine) -> None:
    with queue_engine.connect() as connection:
        with pytest.raises(ConfigurationError, match=r"sqlalchemy\.orm\.Session"):
            sqla_jobs.commit(connection)  # type: ignore[arg-type]
        assert not connection.in_transaction()


async def test_aio_commit_commits(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session:
        session.add(EmailJob(task="send", args={"to": "d@example.com"}))
        await sqla_jobs.aio.commit(session)
    async with AsyncSession(queue_async_engine) as session:
        assert await session.scalar(sa.select(sa.func.count()).select_from(EmailJob)) == 1
