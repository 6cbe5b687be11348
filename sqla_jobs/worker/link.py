"""A pool connection that one worker thread keeps from one transaction to the next.

A checkout from the pool and an ORM Session around it cost more CPU than the claim or
completion statement they carry, so the fetch loop, the outcome writer and the heartbeat
each keep a Core connection of their own. Every transaction on it runs at READ COMMITTED
whatever the engine's default (a claim under REPEATABLE READ would raise serialization
failures instead of skipping locked rows) and with a ``lock_timeout`` (SKIP LOCKED skips row
locks only: a claim behind a migration's table lock would otherwise wait without end), and,
when the worker is asked for it, ``synchronous_commit = off``. They are restored when the
connection goes back to the pool. Behind a connection pooler in transaction mode
(``pooled``), where a session setting would stay on a server connection that other clients
get next, they are set in each transaction instead: one more statement per setting and
transaction, and nothing to restore.

A direct kept connection also runs with ``plan_cache_mode = force_generic_plan``: its
statements are the queue's own, each prepared once by psycopg and run thousands of times,
and a generic plan is planned once per connection. Left to PostgreSQL's default, the claim,
whose ``LIMIT`` is a parameter, loses the comparison of plan costs to a custom plan on every
run once the table has statistics of a backlog (a generic plan must assume a tenth of it per
``LIMIT``), and is planned anew for each claim: 142-150 µs of server CPU per claim of 50
(``pg_stat_statements``, the bench's ``keys`` loop on an analyzed table of 20,000 jobs,
where the claim itself ran in 300 µs). The plan tests check the claims' generic plans
(``tests/test_plan.py``). Behind a pooler nothing is prepared, so the setting would only
cost its statement there.

A kept connection never sees the pool's ``pool_pre_ping``, so after a server restart its
first statement fails. :meth:`Link.transaction` stands in for the ping: a transaction that
fails because the connection is gone is tried once more, at once, on a fresh connection,
and only a second failure reaches the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final, TypeVar, cast

import psycopg
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sqla_jobs._queries.admin import RESET_SETTING, SET_SETTING
from sqla_jobs.events import describe
from sqla_jobs.observer import NO_OBSERVER, Observer

__all__ = ["Link", "as_session", "is_transient"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
ISOLATION: Final = "READ COMMITTED"


def as_session(connection: Connection) -> Session:
    """A Core connection where the queue functions take a session: they only call
    ``execute``, which a Connection has with the same signature (and the claim and complete
    statements take the driver path on it, :func:`sqla_jobs._queries.run.fetch`)."""
    return cast(Session, connection)


def is_transient(exc: BaseException) -> bool:
    """Whether a failed database call may succeed if simply tried again later: the
    connection or the server went away, a lock or statement timeout, a deadlock or
    serialization failure. Anything else (bad data, a constraint, a bug) would fail the
    same way again."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig or exc
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)


class Link:
    """One kept connection of ``engine``; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        *,
        lock_timeout: float,
        synchronous_commit: bool = True,
        pooled: bool = False,
        observer: Observer = NO_OBSERVER,
    ) -> None:
        self.engine = engine
        self.pooled = pooled
        self.observer = observer
        self.settings = {"lock_timeout": f"{max(1, round(lock_timeout * 1000))}ms"}
        if not synchronous_commit:
            self.settings["synchronous_commit"] = "off"
        if not pooled:
            self.settings["plan_cache_mode"] = "force_generic_plan"
        self.connection: Connection | None = None

    def _connect(self) -> Connection:
        connection = self.connection
        if connection is None or connection.closed or connection.invalidated:
            self.close()
            connection = self.engine.connect().execution_options(isolation_level=ISOLATION)
            self.connection = connection
            if self.pooled:  # no session state: transaction() sets the settings each time
                return connection
            try:
                with connection.begin():
                    for name, value in self.settings.items():
                        SET_SETTING.one(
                            connection, None, {"name": name, "value": value}, local=False
                        )
            except BaseException:
                self.close()
                raise
        return connection

    def transaction(self, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` in one transaction on the kept connection and commit it.

        On an error the transaction rolls back and the connection goes back to the pool;
        when the error was the connection being gone, ``work`` runs once more on a fresh
        one. ``work`` must be safe to run twice (every worker transition is fenced).
        """
        for last_try in (False, True):
            connection = self._connect()
            try:
                with connection.begin():
                    if self.pooled:
                        for name, value in self.settings.items():
                            SET_SETTING.one(
                                connection, None, {"name": name, "value": value}, local=True
                            )
                    return work(connection)
            except DBAPIError as exc:
                self.close()
                if last_try or not exc.connection_invalidated:
                    raise
                logger.debug(
                    "a kept connection was gone (%s); trying once more on a fresh one",
                    describe(exc),
                    extra={"action": "database_reconnect"},
                )
                self.observer.reconnected()
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Give the connection back to the pool, its session settings restored."""
        connection, self.connection = self.connection, None
        if connection is None:
            return
        try:
            if not (connection.closed or connection.invalidated):
                if connection.in_transaction():
                    connection.rollback()
                if not self.pooled:
                    with connection.begin():
                        for name in self.settings:
                            RESET_SETTING.result(connection, None, {}, name=name)
            connection.close()
        except Exception as exc:  # a broken connection: the pool discards it
            logger.debug(
                "closing a kept connection failed: %s",
                describe(exc),
                extra={"action": "database_error"},
            )
            try:
                connection.invalidate()
                connection.close()
            except Exception:  # it is gone either way
                logger.debug("discarding a broken connection failed", exc_info=True)
