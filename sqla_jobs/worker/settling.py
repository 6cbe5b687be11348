"""The ``with`` block every attempt runs in once a handler thread takes it
(:class:`Settling`), and the log fields of an attempt (:func:`job_extra`): shared by the
runner (:mod:`sqla_jobs.worker.runner`), its lock groups (:mod:`sqla_jobs.worker.locked`) and
the outcome writer, below all three."""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any, Final

from sqla_jobs import tracing
from sqla_jobs.context import Snooze
from sqla_jobs.worker.state import Attempt, Kind, Outcome, State

__all__ = ["ENDED_UNEXPECTEDLY", "Settling", "ended_by", "job_extra"]

logger = logging.getLogger("sqla_jobs.worker")

#: The outcome of an attempt whose :class:`Settling` block ended without one.
ENDED_UNEXPECTEDLY: Final = Outcome(Kind.RELEASE, why="its handler thread ended unexpectedly")


def job_extra(attempt: Attempt, action: str, **more: Any) -> dict[str, Any]:
    job = attempt.job
    return {
        "action": action,
        "job_id": job.id,
        "task": job.task,
        "queue": job.queue,
        "attempt": job.attempt,
        **more,
    }


def ended_by(exc: BaseException) -> Outcome:
    """The outcome of an attempt whose handler raised ``exc``: a snooze for a
    :class:`~sqla_jobs.Snooze` (after its delay, no attempt spent), else a failure."""
    if isinstance(exc, Snooze):
        return Outcome(Kind.SNOOZE, result=exc.delay)
    return Outcome(Kind.FAIL, error=exc)


class Settling:
    """The ``with`` block an attempt runs in, from the moment a handler thread takes it: at
    its end the attempt is settled (:meth:`State.settle
    <sqla_jobs.worker.state.State.settle>`) with :attr:`outcome`, whatever happened. That
    is a release until the block sets the real one; an exception that ends the block (the
    handler's error, whatever it is) makes it a failure, and goes no further. The attempt's
    trace span is current inside. :meth:`Runner.run` runs every attempt in one, and a lock
    group enters one for each attempt it takes (:meth:`Runner.take_queued`)."""

    __slots__ = ("_span", "_state", "attempt", "outcome")

    def __init__(self, state: State, attempt: Attempt) -> None:
        self._state = state
        self.attempt = attempt
        self.outcome = ENDED_UNEXPECTEDLY

    def __enter__(self) -> Settling:
        # A no-op unless OpenTelemetry is loaded: it records an error that escapes, and is
        # told the outcome of an attempt that ends without one. Entering it must not fail:
        # an exception here would skip __exit__, and the attempt would never be settled.
        try:
            self._span = tracing.attempt_span(self.attempt.job).__enter__()
        except Exception:
            logger.warning(
                "job %d: its trace span could not be started; it runs untraced",
                self.attempt.job.id,
                exc_info=True,
                extra=job_extra(self.attempt, "trace_span_failed"),
            )
            self._span = tracing.attempt_span(None)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        try:
            if exc is None:
                outcome = self.outcome
                # _value_, not value: the same string, without Enum's Python-level property.
                self._span.settled(outcome.kind._value_, outcome.error)
            self._span.__exit__(exc_type, exc, traceback)
        except BaseException as error:
            exc = exc or error
        finally:
            if exc is not None:
                self.outcome = ended_by(exc)
            self._state.settle(self.attempt, self.outcome)
        return True
