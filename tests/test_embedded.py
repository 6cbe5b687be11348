"""The embedded PostgreSQL server (sqla_jobs.embedded) really works."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from sqla_jobs.embedded import EmbeddedPostgres
from sqla_jobs.errors import EmbeddedPostgresError


def _settings(server: EmbeddedPostgres) -> tuple[str, dict[str, str]]:
    engine = sa.create_engine(server.url(), poolclass=sa.NullPool)
    with engine.connect() as conn:
        version = conn.execute(sa.text("SELECT version()")).scalar_one()
        rows = conn.execute(
            sa.text(
                "SELECT name, setting FROM pg_settings WHERE name IN"
                " ('fsync', 'full_page_writes', 'max_connections', 'listen_addresses')"
            )
        )
        settings = {str(name): str(setting) for name, setting in rows}
    engine.dispose()
    return str(version), settings


def test_server_is_postgresql_18(embedded_server: EmbeddedPostgres) -> None:
    assert embedded_server.version == 18
    version, settings = _settings(embedded_server)
    assert version.startswith("PostgreSQL 18.")
    # The suite's server: settings given to the constructor win (conftest.pg_server).
    assert settings == {
        "fsync": "off",
        "full_page_writes": "off",
        "max_connections": "200",
        "listen_addresses": "127.0.0.1",
    }


def test_url_shape(embedded_server: EmbeddedPostgres) -> None:
    port = embedded_server.port
    assert embedded_server.url() == f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    url = sa.make_url(embedded_server.url("some_db"))
    assert (url.drivername, url.username, url.host, url.port, url.database) == (
        "postgresql+psycopg",
        "postgres",
        "127.0.0.1",
        port,
        "some_db",
    )


def test_url_needs_a_port() -> None:
    with pytest.raises(EmbeddedPostgresError, match="start"):
        EmbeddedPostgres().url()


def test_restart_keeps_data_and_port(embedded_server: EmbeddedPostgres) -> None:
    name = "restart_check"
    embedded_server.create_database(name)
    engine = sa.create_engine(embedded_server.url(name))
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE kept (value int)"))
        conn.execute(sa.text("INSERT INTO kept VALUES (42)"))
    port, data_dir = embedded_server.port, embedded_server.data_dir

    embedded_server.restart()

    assert embedded_server.running
    assert (embedded_server.port, embedded_server.data_dir) == (port, data_dir)
    # The pooled connection died with the old server ...
    with pytest.raises(sa.exc.OperationalError), engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    # ... and a new one sees the committed data.
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT value FROM kept")).scalar_one() == 42
    engine.dispose()


def test_kill_then_start_recovers(embedded_server: EmbeddedPostgres) -> None:
    embedded_server.kill()
    assert not embedded_server.running
    embedded_server.start()
    engine = sa.create_engine(embedded_server.url(), poolclass=sa.NullPool)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    engine.dispose()


def test_stop_deletes_data_dir() -> None:
    with EmbeddedPostgres() as server:
        data_dir = server.data_dir
        assert data_dir is not None
        assert (data_dir / "PG_VERSION").read_text().strip() == "18"
        # By default as durable as PostgreSQL's own defaults.
        assert _settings(server)[1] == {
            "fsync": "on",
            "full_page_writes": "on",
            "max_connections": "200",
            "listen_addresses": "127.0.0.1",
        }
    assert not server.running
    assert not data_dir.exists()
    server.stop()  # idempotent


def test_failed_start_reports_the_server_log() -> None:
    server = EmbeddedPostgres(settings={"shared_buffers": "not a size"})
    with pytest.raises(EmbeddedPostgresError) as excinfo:
        server.start()
    try:
        message = str(excinfo.value)
        assert "\n" not in message
        assert re.search(r"shared_buffers", message), message
    finally:
        server.stop()
