"""The one place the worker reports what happens to it, for metrics (or anything else).

The worker calls an :class:`Observer` at each event below. The base class does nothing, and
a worker without metrics holds that no-op instance, so the hot path pays one empty method
call per event and imports nothing. :class:`sqla_jobs.metrics.WorkerMetrics` implements it
with Prometheus counters and histograms; a subclass of your own may count elsewhere.

Methods are called from the worker's own threads (the fetch loop, the handler threads, the
outcome writer, any thread that meets a database error): an implementation must be
thread-safe, quick, and must not raise.

=================  ===========================================  ================================
method             when                                         called by
=================  ===========================================  ================================
``claimed``        a claim transaction committed (jobs may be   the fetch loop
                   none); ``seconds`` is its round trip
``started``        a handler is about to run an attempt         a handler thread
``finished``       an attempt's outcome is committed:           the outcome writer
                   ``succeeded``, ``failed`` (will retry),
                   ``dead``, ``released`` or ``lost``;
                   ``handler_seconds`` when a handler ran
``database_error`` a database call of the worker failed         the role that made it
                   (``operation``: claim, recording outcomes,
                   heartbeat, vacuum, ...)
``reconnected``    a kept connection was found gone and         the role that kept it
                   replaced (a server restart)
=================  ===========================================  ================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

from sqla_jobs.queue import ClaimedJob

__all__ = ["NO_OBSERVER", "Finish", "Observer"]

Finish = Literal["succeeded", "failed", "dead", "cancelled", "released", "lost", "snoozed"]


class Observer:
    """Receives the worker's events; every method does nothing here (see the module)."""

    def claimed(self, jobs: Sequence[ClaimedJob], seconds: float) -> None:
        """A claim committed with ``jobs`` (maybe none) after ``seconds``."""

    def started(self, job: ClaimedJob) -> None:
        """A handler starts ``job``'s attempt."""

    def finished(self, job: ClaimedJob, how: Finish, handler_seconds: float | None) -> None:
        """``job``'s attempt ended so, and that is committed."""

    def database_error(self, operation: str) -> None:
        """A database call failed during ``operation``; it is retried with backoff."""

    def reconnected(self) -> None:
        """A kept connection was gone and was replaced."""


#: What a worker without metrics reports to.
NO_OBSERVER: Final = Observer()
