"""What tracing reads of a job and what an attempt's span offers: the types both
:mod:`sqla_jobs.tracing` and its OpenTelemetry implementation (:mod:`sqla_jobs.tracing.otel`)
name, in a module that imports neither."""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

__all__ = ["AttemptSpan", "TracedJob"]


class TracedJob(Protocol):
    """What an attempt's span reads of its job (a :class:`~sqla_jobs.ClaimedJob` is one). A
    protocol, not the class: tracing sits below the queue, which stores trace contexts."""

    @property
    def id(self) -> int: ...
    @property
    def queue(self) -> str: ...
    @property
    def task(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def trace_context(self) -> dict[str, str] | None: ...


class AttemptSpan(Protocol):
    """What :func:`attempt_span` yields: the span of one attempt, told how it ended."""

    def settled(self, outcome: str, error: str | BaseException | None = None) -> None:
        """Record the attempt's outcome (``complete``, ``fail``, ``release``, ...); a failure's
        error is recorded as an exception event (when it is one) and sets error status."""

    def __enter__(self) -> AttemptSpan: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...
