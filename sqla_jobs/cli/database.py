"""The database a command works on: its URL (``--database-url`` or the environment), a read
replica's for the commands that only read (``--replica-url``), and the engine made for
each."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session

from sqla_jobs.cli.arguments import CommandError
from sqla_jobs.pooler import unprepared_behind_pooler
from sqla_jobs.urls import psycopg_url

DATABASE_URL_VARIABLE: Final = "SQLA_JOBS_DATABASE_URL"


LISTEN_URL_VARIABLE: Final = "SQLA_JOBS_LISTEN_URL"


REPLICA_URL_VARIABLE: Final = "SQLA_JOBS_REPLICA_URL"


def database_url(value: str | None, variable: str = DATABASE_URL_VARIABLE) -> URL:
    """The URL from ``--database-url`` or the environment, with the psycopg 3 driver."""
    raw = value or os.environ.get(variable, "").strip()
    if not raw:
        raise CommandError(
            f"no database URL: pass --database-url or set {variable} "
            "(e.g. postgresql://user@localhost/app)"
        )
    return _checked_url(raw)


def database_urls(values: list[str] | None, variable: str = DATABASE_URL_VARIABLE) -> list[URL]:
    """The URLs of ``--database-url`` given once per database, or the environment's one,
    each checked as :func:`database_url` checks one (before anything connects); the same
    database twice is refused."""
    given: list[str | None] = list(values) if values else [None]
    urls = [database_url(value, variable) for value in given]
    shown = [url.render_as_string(hide_password=True) for url in urls]
    twice = sorted({text for text in shown if shown.count(text) > 1})
    if twice:
        raise CommandError(f"--database-url names the same database twice: {', '.join(twice)}")
    return urls


def has_database_url(value: str | None, variable: str = DATABASE_URL_VARIABLE) -> bool:
    """Whether a database URL is given (``--database-url`` or the environment), well formed
    or not."""
    return bool(value or os.environ.get(variable, "").strip())


def replica_url(value: str | None) -> URL | None:
    """A read replica's URL from ``--replica-url`` or ``$SQLA_JOBS_REPLICA_URL``, with the
    psycopg 3 driver; None when neither is given. A malformed one is a
    :class:`~sqla_jobs.cli.arguments.CommandError` naming it (its password hidden), before
    anything connects."""
    raw = value or os.environ.get(REPLICA_URL_VARIABLE, "").strip()
    if not raw:
        return None
    try:
        return _checked_url(raw)
    except CommandError as exc:
        raise CommandError(
            f"the replica URL (--replica-url, {REPLICA_URL_VARIABLE}): {exc}"
        ) from None


def _checked_url(raw: str) -> URL:
    """``raw`` as a PostgreSQL URL with the psycopg 3 driver, or a one-line CommandError."""
    # Never print the password: an error shows the URL as hidden_password() leaves it.
    try:
        url = psycopg_url(raw)
        url.port  # noqa: B018  (parsed when read: a port that is not a number raises here)
    except (ArgumentError, ValueError):
        raise CommandError(f"{hidden_password(raw)!r} is not a database URL") from None
    if url.get_backend_name() != "postgresql":
        raise CommandError(f"sqla_jobs needs PostgreSQL, not {url.get_backend_name()!r}")
    if url.get_driver_name() != "psycopg":
        shown = url.render_as_string(hide_password=True)
        raise CommandError(f"use the psycopg (3) driver: postgresql+psycopg://, not {shown!r}")
    return url


_PASSWORD = re.compile(r"(://[^:/@?#]*:)[^@/?#]*@")


def hidden_password(raw: str) -> str:
    """``raw`` (a URL, perhaps malformed) with the password of its user part replaced by
    ``***``; the text as it is when it has none."""
    return _PASSWORD.sub(r"\1***@", raw)


def make_engine(
    url: URL,
    *,
    pool_size: int = 5,
    application_name: str = "sqla-jobs",
    pooler: str = "auto",
) -> Engine:
    """An engine for the command line's work: pre-ping (survives server restarts), TCP
    keepalives (notices a vanished server), a connect timeout. Behind a connection pooler
    (``pooler="transaction"``, or found at connect with ``"auto"``:
    :func:`sqla_jobs.pooler.unprepared_behind_pooler`), psycopg prepares no statements."""
    connect_args: dict[str, Any] = {
        "connect_timeout": 10,
        "application_name": application_name,
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    if pooler == "transaction":
        connect_args["prepare_threshold"] = None
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args=connect_args,
    )
    if pooler == "auto":
        unprepared_behind_pooler(engine)
    return engine


@contextmanager
def command_engine(args: argparse.Namespace, url: URL | None = None) -> Iterator[Engine]:
    """The engine of a one-shot command (``url``, by default ``--database-url``'s;
    ``--pooler``): one connection, disposed at the end."""
    if url is None:
        url = database_url(args.database_url)
    engine = make_engine(url, pool_size=1, pooler=args.pooler)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def command_session(args: argparse.Namespace, url: URL | None = None) -> Iterator[Session]:
    """A session of a one-shot command in one transaction, committed at the end (see
    :func:`command_engine`)."""
    with command_engine(args, url) as engine, Session(engine) as session, session.begin():
        yield session
