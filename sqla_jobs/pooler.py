"""Connection poolers between sqla_jobs and PostgreSQL (PgBouncer in transaction mode).

A pooler in transaction mode hands each transaction to whichever server connection is free,
so nothing may rely on the state of a session. What sqla_jobs does about each kind:

* ``LISTEN``: the worker listens on a direct connection of its own
  (``Worker(listen_engine=...)``, ``sqla-jobs worker --listen-url``), or polls.
* ``lock_timeout``: the worker's kept connections set it in each transaction
  (``set_config(..., true)``, like ``SET LOCAL``) instead of once per session.
* Prepared statements: psycopg prepares a statement once it ran ``prepare_threshold`` times
  (5) on a connection, and a pooler before PgBouncer 1.21 cannot route them. An engine
  behind one needs ``connect_args={"prepare_threshold": None}``; the driver path of
  :func:`sqla_jobs.claim` respects it, and the command line sets it itself
  (:func:`unprepared_behind_pooler`).
* Advisory locks: only transaction-scoped try-locks (``pg_try_advisory_xact_lock``: keyed
  claims, limited queues, history partition maintenance; docs/privileges.md lists them),
  released when their transaction ends, so a pooler may hand the connection on; never a
  session-level ``pg_advisory_lock``.
* Temporary tables, session ``SET``: none that outlives a transaction (settings are made
  with ``set_config(..., true)``, like ``SET LOCAL``).

How the worker and the command line know they are behind a pooler: :func:`behind_pooler`.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import Engine, event

from sqla_jobs._queries.admin import driver_backend_pid

__all__ = ["POOLER_MODES", "behind_pooler", "unprepared_behind_pooler"]

#: ``auto``: find out at connect (:func:`behind_pooler`); ``transaction``: a pooler in
#: transaction mode is assumed; ``none``: a direct connection is assumed.
POOLER_MODES: Final = ("auto", "transaction", "none")


def behind_pooler(dbapi_connection: Any) -> bool:
    """Whether this psycopg connection reaches PostgreSQL through a connection pooler.

    At login PostgreSQL tells the client its backend's pid (with the key that cancels its
    queries). A pooler cannot pass that on, since the client's transactions go to several
    backends, and sends a key of its own: behind a pooler the pid psycopg was told differs
    from ``pg_backend_pid()``; on a direct connection it is the same. One round trip, in
    the connection's current transaction (or a new one, which the caller ends). A pooler
    in session mode looks the same as one in transaction mode. False for a connection that
    is not psycopg's (nothing to compare).
    """
    told = getattr(getattr(dbapi_connection, "info", None), "backend_pid", None)
    if not isinstance(told, int):
        return False
    pid = driver_backend_pid(dbapi_connection)
    return pid is not None and pid != told


def unprepared_behind_pooler(engine: Engine) -> None:
    """Make the new connections of ``engine`` that go through a pooler prepare nothing.

    Each new connection is checked once with :func:`behind_pooler` and, behind a pooler,
    gets ``prepare_threshold = None``; direct connections keep psycopg's prepared
    statements. The command line does this with its engines; an application that knows
    its URL goes through PgBouncer passes ``connect_args={"prepare_threshold": None}``
    instead.
    """

    @event.listens_for(engine, "connect")
    def _unprepared(dbapi_connection: Any, _record: Any) -> None:
        try:
            if behind_pooler(dbapi_connection):
                dbapi_connection.prepare_threshold = None
        finally:
            dbapi_connection.rollback()
