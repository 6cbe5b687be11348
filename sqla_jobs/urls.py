"""Database URLs in the two forms sqla_jobs meets them.

SQLAlchemy needs the driver named (``postgresql+psycopg://``: a bare ``postgresql://``
would pick psycopg2), while libpq, and so ``psycopg.connect()``, takes the plain
``postgresql://`` form. The command line, the benchmark and the test harness convert here,
and nowhere else.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy.engine import URL, make_url

__all__ = [
    "ASYNCPG_DRIVER",
    "PSYCOPG_DRIVER",
    "asyncpg_url",
    "libpq_url",
    "psycopg_url",
    "server_hosts",
    "server_label",
]

PSYCOPG_DRIVER: Final = "postgresql+psycopg"
ASYNCPG_DRIVER: Final = "postgresql+asyncpg"
_PLAIN: Final = ("postgres", "postgresql")


def psycopg_url(url: str | URL) -> URL:
    """``url`` for SQLAlchemy with psycopg 3: ``postgres://`` and ``postgresql://`` become
    ``postgresql+psycopg://``; any other URL comes back unchanged (parsed).

    Raises :class:`sqlalchemy.exc.ArgumentError` for text that is not a URL.
    """
    parsed = make_url(url)
    if parsed.drivername in _PLAIN:
        return parsed.set(drivername=PSYCOPG_DRIVER)
    return parsed


def libpq_url(url: str | URL) -> str:
    """``url`` as libpq takes it (``postgresql://...``, password kept), for
    ``psycopg.connect()``; the reverse of :func:`psycopg_url`."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def asyncpg_url(url: str | URL) -> URL:
    """``url`` with the asyncpg driver (``postgresql+asyncpg://``), for
    ``create_async_engine``: host, port, user, password and database are kept. So is the
    query, as it is: asyncpg takes options of its own (``ssl=require``, not libpq's
    ``sslmode=require``)."""
    return make_url(url).set(drivername=ASYNCPG_DRIVER)


def server_hosts(url: URL) -> str:
    """``url``'s host; else the hosts its query lists (``?host=a:5432&host=b:5432``: a
    failover list, or a socket's directory), comma-separated; else ``localhost``."""
    if url.host:
        return url.host
    given = url.query.get("host")
    hosts = [given] if isinstance(given, str) else list(given or ())
    return ",".join(hosts) or "localhost"


def server_label(url: URL) -> str:
    """``host:port/database`` of ``url``: how sqla_jobs names a database where it shows or
    labels several (a worker group's metrics, the dashboard's list of databases); never the
    user or the password."""
    port = "" if url.port is None else f":{url.port}"
    return f"{server_hosts(url)}{port}/{url.database or ''}"
