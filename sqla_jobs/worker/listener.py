"""LISTEN for new-job notifications and wake the worker's fetch loop.

Enqueueing a job fires ``pg_notify(<table's channel>, <queue>)`` when its transaction
commits (the trigger in :mod:`sqla_jobs.ddl`), so an idle worker claims it at once instead of
at its next poll. Notifications are a hint, never the source of truth: those sent while the
listener is disconnected are lost, which is why every (re)connection triggers a catch-up
poll, and why the worker polls anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from sqlalchemy import Engine, Table

from sqla_jobs._queries.admin import listen_on, ping_on
from sqla_jobs.backoff import Backoff
from sqla_jobs.events import describe
from sqla_jobs.schema import names

__all__ = ["Notifier"]

logger = logging.getLogger(__name__)

#: A lost connection is connected again at once, unless the last reconnect was at once
#: too and its connection failed within this many seconds: then it waits a backoff step.
STEADY: Final = 1.0
#: While the server is down (it refuses connections, or says it is starting or shutting
#: down), a connect is tried this often (seconds), not on the growing backoff: such a try
#: costs the server nothing, and the first one after it is back reconnects the listener,
#: which wakes the fetch loop. Other failures (a wrong password, too many connections) wait
#: the backoff, so a fleet of workers does not press on a server that is up but refusing.
PROBE_EVERY: Final = 0.25
#: During an outage, the listener logs its first failure, then at most one line this often
#: (seconds).
LOG_EVERY: Final = 30.0
#: cannot_connect_now: the server is starting up, shutting down or in recovery.
_CANNOT_CONNECT_NOW: Final = "57P03"


#: What a connect's error says when the server is not there: no one listens at its address
#: (TCP, or its Unix socket), a pooled connection of before the outage is dead, or the
#: server is shutting down or starting up.
_DOWN_MESSAGES: Final = (
    "Connection refused",
    "No such file or directory",
    "server closed the connection",
    "terminating connection",
    # The server's own words for 57P03, which a failed connect carries without its code.
    "the database system is shutting down",
    "the database system is starting up",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
)


def _server_down(exc: Exception) -> bool:
    """Whether ``exc`` says the server is not there yet: no one listens at its address, it is
    starting up, shutting down or in recovery, or the connection was one of before."""
    cause: BaseException | None = exc
    while cause is not None:
        if getattr(cause, "sqlstate", None) == _CANNOT_CONNECT_NOW:
            return True
        text = str(cause)
        if any(message in text for message in _DOWN_MESSAGES):
            return True
        cause = cause.__cause__ or getattr(cause, "orig", None)
    return False


class Notifier:
    """A thread that LISTENs on a job table's channel, on a connection of its own.

    ``on_notify(payload)`` runs for each notification and ``on_connect()`` after each
    successful (re)connection; both run on the notifier's thread and must be quick. A lost
    connection is logged and connected again at once (a backend ended, a server
    restarted: the first claim after it comes within one connect, not one backoff step;
    ``on_connect`` wakes the fetch loop). While the server is down (refused, starting up),
    a connect is tried every :data:`PROBE_EVERY` seconds, so the first claim after it is
    back comes within one connect too; any other failed connect, or a connection made at
    once that failed again within :data:`STEADY` seconds, is retried with exponential
    backoff. A half-open connection is found by a ``SELECT 1`` every ``check_interval``
    seconds.
    """

    def __init__(
        self,
        engine: Engine,
        table: Table,
        *,
        on_notify: Callable[[str], None],
        on_connect: Callable[[], None],
        check_interval: float = 10.0,
        name: str = "sqla-jobs-notifier",
    ) -> None:
        self.engine = engine
        self.table = table
        self.channel = names(table.name).channel
        self.on_notify = on_notify
        self.on_connect = on_connect
        self.check_interval = check_interval
        self.connected = False
        self.last_activity = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._connection: Any = None
        self._lost = False  # a session failed before: the next connect is a reconnect
        # Whether the last reconnect was at once: the next one is too only after a session
        # that lasted STEADY seconds (never a reconnect loop at full speed).
        self._reconnected_at_once = False
        self._logged_at = -LOG_EVERY  # when a failure was last logged

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _connect(self) -> Any:
        # A pool connection detached for good: LISTEN is session state, and the pool must
        # never hand this connection to anyone else.
        raw = self.engine.raw_connection()
        connection: Any = raw.driver_connection
        raw.detach()
        connection.rollback()
        connection.autocommit = True
        listen_on(connection, self.table)
        return connection

    def _close(self) -> None:
        connection, self._connection = self._connection, None
        self.connected = False
        if connection is not None:
            try:
                connection.close()
            except Exception:  # closing a broken connection may fail too; it is gone anyway
                logger.debug("closing the listener connection failed", exc_info=True)

    def _run(self) -> None:
        backoff = Backoff(initial=0.2, cap=5.0)
        while not self._stop.is_set():
            exc, connected_at = self._session(backoff)
            self._close()
            if exc is not None and not self._stop.is_set():
                steady = connected_at is not None and time.monotonic() - connected_at >= STEADY
                if connected_at is not None and (steady or not self._reconnected_at_once):
                    # It was up: the server is likely there (a backend ended, a restart).
                    delay = 0.0
                    self._reconnected_at_once = True
                elif connected_at is None and _server_down(exc):
                    delay = PROBE_EVERY  # the first try after it is back reconnects
                else:
                    delay = backoff.next_delay()
                now = time.monotonic()
                logger.debug(
                    "listener connect failed (%s); next try in %.2fs", describe(exc), delay
                )
                if connected_at is not None or now - self._logged_at >= LOG_EVERY:
                    self._logged_at = now
                    logger.warning(
                        "listener connection failed (%s); reconnecting in %.1fs",
                        describe(exc),
                        delay,
                        extra={
                            "action": "listener_error",
                            "channel": self.channel,
                            "error": describe(exc),
                            "delay": round(delay, 3),
                        },
                    )
                self._lost = True
                self._stop.wait(delay)

    def _session(self, backoff: Backoff) -> tuple[Exception | None, float | None]:
        """Connect, LISTEN and deliver notifications until stopped or the connection fails.
        Returns the error that ended it, and when it connected (None: it did not)."""
        connected_at = None
        try:
            self._connection = self._connect()
            self.connected = True
            connected_at = time.monotonic()
            recovered = backoff.reset() or self._lost
            self._lost = False
            logger.info(
                "listening on channel %s%s",
                self.channel,
                " again" if recovered else "",
                extra={"action": "listener_connected", "channel": self.channel},
            )
            self.on_connect()
            self._listen(self._connection)
        except Exception as exc:
            return exc, connected_at
        return None, connected_at

    def _listen(self, connection: Any) -> None:
        last_check = time.monotonic()
        while not self._stop.is_set():
            self.last_activity = time.monotonic()
            for notify in connection.notifies(timeout=0.5):
                self.on_notify(notify.payload)
            if time.monotonic() - last_check >= self.check_interval:
                ping_on(connection)
                last_check = time.monotonic()
