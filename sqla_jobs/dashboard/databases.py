"""The dashboard of several databases (:func:`~sqla_jobs.dashboard.create_multi_app`): each
database's name and checks, and its line on the list of databases, read apart from the
others so that one that is down shows as such while the others answer."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from sqla_jobs import queue
from sqla_jobs._queries.admin import STATEMENT_TIMEOUT
from sqla_jobs.errors import ConfigurationError, SqlaJobsError
from sqla_jobs.schema import JobMixin, JobStatus
from sqla_jobs.urls import server_hosts, server_label

__all__ = ["COUNTS_TIMEOUT", "database_name"]

#: Seconds each database's counts may take on the databases page of
#: :func:`create_multi_app` (a ``statement_timeout``); a slower one shows as an error.
COUNTS_TIMEOUT: Final = 5.0
#: A database's name in :func:`create_multi_app`: the ``/db/{name}`` of its pages, so only
#: letters, digits, ``-``, ``_``, ``.`` and ``~`` (URL-safe as they are), not starting with a
#: dot, at most 255 characters.
_NAME: Final = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9._~-]{0,254}")


@dataclass(frozen=True)
class Database:
    """One database the dashboard shows: where its pages read and its actions write."""

    name: str | None  # its /db/{name} in a dashboard of several; None: the only one
    engine: Engine | None  # the primary: the actions write here (None: read-only)
    reader: Engine  # the pages read here: the replica's, else the primary's
    replica: bool  # the reader is a replica: each page reads and shows its lag
    server: str  # host:port/database, never the user or the password


@dataclass(frozen=True)
class Summary:
    """A database's line on the databases page: its counts, or why it has none.

    ``state`` is ``ok``; ``unreachable`` (no connection: ``error`` is why); or ``error``
    (connected, but the reads failed: no job table, the statement timeout)."""

    name: str
    server: str
    state: str
    error: str | None = None
    pending: int = 0
    runnable: int = 0
    running: int = 0
    expired_leases: int = 0
    dead: int = 0
    oldest_runnable: float | None = None  # seconds, by the database's clock
    paused: tuple[str, ...] = ()


def summary(database: Database, model: type[JobMixin]) -> Summary:
    """``database``'s counts (:func:`~sqla_jobs.queue_stats`, the paused queues) in one
    transaction under a ``statement_timeout``, or what kept them from being read."""
    assert database.name is not None  # the databases page: every one has a name
    name, server = database.name, database.server
    try:
        connection = database.reader.connect()
    except (SQLAlchemyError, SqlaJobsError) as exc:
        return Summary(name, server, "unreachable", first_line(exc))
    try:
        with connection, connection.begin():
            timeout = f"{round(COUNTS_TIMEOUT * 1000)}ms"
            STATEMENT_TIMEOUT.one(connection, None, {"timeout": timeout})
            stats = queue.queue_stats(connection, model)
            paused = queue.paused_queues(connection, model)
    except (SQLAlchemyError, SqlaJobsError) as exc:
        lost = isinstance(exc, DBAPIError) and exc.connection_invalidated
        return Summary(name, server, "unreachable" if lost else "error", first_line(exc))
    counts = dict.fromkeys(JobStatus, 0)
    runnable = expired = 0
    oldest: float | None = None
    for stat in stats:
        counts[stat.status] += stat.count
        runnable += stat.runnable
        expired += stat.expired_leases
        if stat.oldest_pending_seconds is not None:
            oldest = max(oldest or 0.0, stat.oldest_pending_seconds)
    return Summary(
        name,
        server,
        "ok",
        pending=counts[JobStatus.PENDING],
        runnable=runnable,
        running=counts[JobStatus.RUNNING],
        expired_leases=expired,
        dead=counts[JobStatus.DEAD],
        oldest_runnable=oldest,
        paused=tuple(pause.queue for pause in paused),
    )


def first_line(exc: BaseException) -> str:
    """The first line of a database error (the driver's own message when there is one)."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def database_name(url: URL | str) -> str:
    """The name :func:`create_multi_app` can give the database of ``url``: its host, its
    port (when the URL has one) and its database, joined by ``-``, each character that is
    not URL-safe made a ``-`` (``postgresql://app:pw@db-eu:5433/app`` is ``db-eu-5433-app``;
    the hosts of a URL that lists them in its query, ``?host=db1:5432&host=db2:5432``, all
    of them). Never the user or the password. ``sqla-jobs dashboard`` names its databases
    so."""
    parsed = make_url(url) if isinstance(url, str) else url
    parts = [server_hosts(parsed), parsed.port, parsed.database]
    name = "-".join(str(part) for part in parts if part not in (None, ""))
    name = re.sub(r"[^A-Za-z0-9._~-]", "-", name)
    return "-" + name[1:] if name.startswith(".") else name


def databases_of(engines: object) -> list[Database]:
    """``create_multi_app``'s ``engines``, checked (:class:`ConfigurationError`)."""
    if not isinstance(engines, Mapping):
        raise ConfigurationError(
            f"engines must be a mapping of database names to engines, not {type(engines).__name__}"
        )
    if not engines:
        raise ConfigurationError("engines is empty: give at least one database's engine")
    databases: list[Database] = []
    by_name: dict[str, str] = {}
    by_server: dict[str, str] = {}
    for name, engine in engines.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigurationError(
                f"the database name {name!r} is not URL-safe: use letters, digits, '-', '_', "
                "'.' and '~' (not starting with a dot, at most 255 characters); it is the "
                "/db/NAME of its pages"
            )
        if not isinstance(engine, Engine):
            raise ConfigurationError(
                f"engines[{name!r}] must be a sqlalchemy Engine, not {type(engine).__name__}"
            )
        same = by_name.setdefault(name.casefold(), name)
        if same != name:
            raise ConfigurationError(
                f"the database names {same!r} and {name!r} differ only by case: give each "
                "database a name of its own"
            )
        server = server_label(engine.url)
        twice = by_server.setdefault(server, name)
        if twice != name:
            raise ConfigurationError(
                f"engines[{twice!r}] and engines[{name!r}] are the same database ({server}): "
                "give each database once"
            )
        databases.append(Database(name, engine, engine, False, server))
    return databases
