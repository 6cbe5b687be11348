"""SIGTERM and SIGINT for the call that owns the process (:meth:`Worker.run`,
:meth:`WorkerGroup.run`): the first asks for a graceful stop, a second exits at once with
status 128 + the signal number (its jobs come back when their leases run out)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["StopSignals"]

logger = logging.getLogger("sqla_jobs.worker")


class StopSignals:
    """``on_first(signum)`` at the first SIGTERM or SIGINT; an exit at the second.

    ``on_first`` runs in the main thread between two bytecodes: it may only set flags
    (taking a lock the interrupted code holds would deadlock)."""

    def __init__(self, on_first: Callable[[int], None]) -> None:
        self._on_first = on_first
        self._count = 0
        self._previous: dict[int, Any] = {}

    def install(self, owner: str, stop_call: str) -> None:
        """Install the handlers; off the main thread, where Python cannot, log once that
        the signals do not stop ``owner`` (``stop_call`` does)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "the %s runs off the main thread (%s), where Python cannot install signal "
                "handlers: SIGTERM and SIGINT do not stop it; call %s",
                owner,
                threading.current_thread().name,
                stop_call,
                extra={"action": "signals_not_handled"},
            )
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self._count += 1
        if self._count > 1:
            # Not through logging: a handler lock held by the interrupted code would deadlock.
            name = signal.Signals(signum).name
            os.write(2, f"sqla-jobs: second {name}: exiting at once\n".encode())
            os._exit(128 + signum)
        self._on_first(signum)
