"""The Queries of sqla_jobs._queries.admin, each run on PostgreSQL with its record of
parameters and read by its row's field names: a Query checks its record and its row the first
time it runs (QueryDefinitionError), so each one runs here, also those whose callers have not
moved into the layer yet (the worker's start-up and shutdown, queue.admin's)."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from conftest import through_pgbouncer
from models import ArchiveJob, EmailJob

from sqla_jobs._queries import admin
from sqla_jobs.ddl import qualified_name
from sqla_jobs.history import history_table
from sqla_jobs.schema import names

EMAIL: sa.Table = EmailJob.__table__  # type: ignore[assignment]
ARCHIVE: sa.Table = ArchiveJob.__table__  # type: ignore[assignment]


@pytest.fixture
def connection(queue_engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection in a transaction that is rolled back, with one pending job of
    EmailJob's in the default queue."""
    with queue_engine.connect() as connection, connection.begin() as transaction:
        yield connection
        transaction.rollback()


def _pending_job(connection: sa.Connection, table: sa.Table = EMAIL) -> int:
    job_id: int = connection.execute(
        sa.insert(table).values(task="t").returning(table.c.id)
    ).scalar_one()
    return job_id


def test_status_of_reads_a_jobs_status_by_name(connection: sa.Connection) -> None:
    job_id = _pending_job(connection)
    assert admin.STATUS_OF.one(connection, EMAIL, {"job_id": job_id}) == ("pending",)
    row = admin.STATUS_OF.one(connection, EMAIL, {"job_id": job_id})
    assert row is not None
    assert row.status == "pending"
    assert admin.STATUS_OF.one(connection, EMAIL, {"job_id": job_id + 1}) is None


def test_prune_counts_the_jobs_it_deleted(connection: sa.Connection) -> None:
    _pending_job(connection)  # not finished: never pruned
    result = admin.PRUNE.result(connection, EMAIL, {"older_than_seconds": 0.0, "limit": 10})
    assert result.rowcount == 0


@pytest.mark.parametrize(
    ("table", "history"), [(EMAIL, False), (ARCHIVE, False), (ARCHIVE, True)], ids=str
)
def test_queue_stats_and_dead_jobs_read_by_name(
    connection: sa.Connection, table: sa.Table, history: bool
) -> None:
    _pending_job(connection, table)
    options: dict[str, Any] = {"history": history_table(table)} if history else {}
    (stat,) = admin.QUEUE_STATS.rows(connection, table, {}, **options)
    assert (stat.status, stat.total, stat.runnable, stat.expired) == ("pending", 1, 1, 0)
    assert isinstance(stat.oldest_runnable_seconds, float)
    assert admin.DEAD_JOBS.rows(connection, table, {"limit": 5}, **options) == []


def test_table_statistics_and_the_oldest_snapshot_read_by_name(connection: sa.Connection) -> None:
    (stats,) = admin.TABLE_STATS.rows(connection, EMAIL, {})
    assert stats.table_bytes is not None
    assert stats.pending_index_bytes is not None
    (dead,) = admin.DEAD_ROWS.rows(connection, EMAIL, {})
    assert dead.dead_rows >= 0
    holders = admin.OLDEST_XMIN.rows(connection, None, {})
    assert {holder.measure for holder in holders} <= {"seconds", "xids"}


def test_the_catalog_reads_of_a_worker_at_start(connection: sa.Connection) -> None:
    (layout,) = admin.TABLE_LAYOUT.rows(connection, EMAIL, {})
    assert {"id", "status", "run_at"} <= set(layout.columns)
    assert names(EMAIL.name).pending_index in layout.indexes
    (trigger,) = admin.WAKEUP_TRIGGER_EXISTS.rows(connection, EMAIL, {})
    assert trigger.exists is True


def test_may_keep_partitions_names_the_role_and_the_owner(connection: sa.Connection) -> None:
    history = history_table(ARCHIVE)
    name = qualified_name(history.name, history.schema)
    found = admin.MAY_KEEP_PARTITIONS.one(connection, None, {"history": name})
    assert found is not None
    # The tests' role created the tables: it is their owner.
    assert (found.role, found.acts_as_owner, found.may_create) == (found.owner, True, True)
    assert admin.MAY_KEEP_PARTITIONS.one(connection, None, {"history": "no_such_table"}) is None


def test_settings_are_set_and_reset(connection: sa.Connection) -> None:
    params: admin.SettingParams = {"name": "lock_timeout", "value": "1500ms"}
    assert admin.SET_SETTING.one(connection, None, params, local=True) == ("1500ms",)
    row = admin.SET_SETTING.one(connection, None, params, local=False)
    assert row is not None
    assert row.set_config == "1500ms"
    timeout = admin.STATEMENT_TIMEOUT.one(connection, None, {"timeout": "2000ms"})
    assert timeout is not None
    assert timeout.set_config == "2s"
    result = admin.RESET_SETTING.result(connection, None, {}, name="lock_timeout")
    assert not result.returns_rows


def test_the_backend_and_its_transaction(connection: sa.Connection) -> None:
    (backend,) = admin.BACKEND_TRANSACTION.rows(connection, None, {})
    driver = connection.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    # The same transaction, asked on the driver connection itself: the same backend.
    assert backend.pid == admin.driver_backend_pid(driver)
    assert isinstance(backend.xact_start, Decimal)
    # No backend runs a transaction that began at the epoch: nothing is ended.
    params: admin.TerminateParams = {"pids": str(backend.pid), "xact_starts": "0"}
    assert admin.TERMINATE_TRANSACTIONS.rows(connection, None, params) == []


@pytest.mark.skipif(through_pgbouncer(), reason="LISTEN needs a direct connection")
def test_listen_and_ping_on_a_driver_connection(queue_engine: sa.Engine) -> None:
    # As the listener does: a connection of its own, out of the pool, in autocommit.
    raw = queue_engine.raw_connection()
    driver = raw.driver_connection
    raw.detach()
    try:
        assert isinstance(driver, psycopg.Connection)
        driver.rollback()
        driver.autocommit = True
        admin.listen_on(driver, EMAIL)
        admin.ping_on(driver)
        channels = driver.execute("SELECT pg_listening_channels()").fetchall()
        assert channels == [(names(EMAIL.name).channel,)]
    finally:
        raw.close()
