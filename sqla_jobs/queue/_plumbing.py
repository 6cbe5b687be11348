"""What the queue operations share: their types (:class:`ClaimedJob`, ...), limits, and the
checks of their arguments (see :mod:`sqla_jobs.queue`). Their statements are built and run by
the query layer (:mod:`sqla_jobs._queries.run`)."""

from __future__ import annotations

import functools
import json
import json.scanner
import operator
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any, Final, NamedTuple
from uuid import UUID

from sqlalchemy import (
    Table,
)

from sqla_jobs import _queries as statements
from sqla_jobs import validation
from sqla_jobs._queries._sql import FenceParams
from sqla_jobs._queries.rows import CLAIM_ORDER, FENCE
from sqla_jobs.errors import (
    ConfigurationError,
    InvalidJobError,
)
from sqla_jobs.schema import (
    JobMixin,
    JobStatus,
)

MAX_CLAIM_LIMIT: Final = 10_000
DEFAULT_ENQUEUE_CHUNK: Final = 1_000
MAX_ENQUEUE_CHUNK: Final = 100_000
#: How long a claimed attempt owns its job unless heartbeated, when nobody says otherwise
#: (a registry's tasks, and so the worker, start from it too).
DEFAULT_LEASE: Final = timedelta(seconds=30)
MAX_ERROR_CHARS: Final = 16_000
#: Dead row versions at which :func:`vacuum` vacuums a job table by default: about 50k
#: claimed jobs (each leaves two), the interval at which a 1M-job drain kept the rate of a
#: 50k one.
VACUUM_DEAD_ROWS: Final = 100_000

_NO_RESULT: Final[Any] = object()

#: What the queue operations run on: an ORM session, or a Core connection (a worker's
#: background loops use connections, which cost less per transaction). Either way the
#: operation runs in the caller's current transaction and never commits it.


class ClaimedJob(NamedTuple):
    """One attempt at one job, as returned by :func:`claim`.

    Plain, immutable data, not an ORM object: it stays valid after the claiming session is
    gone. ``(id, attempt)`` is the fence that every later transition of this attempt
    carries. (A named tuple: a claim builds one per job, and a tuple is the cheapest
    immutable record Python has.)
    """

    model: type[JobMixin]
    id: int
    queue: str
    task: str
    args: dict[str, Any]
    priority: int
    attempt: int
    max_attempts: int
    #: None only for a row whose ``run_at`` Python's datetime cannot hold (``'-infinity'``, a
    #: year before 1: written by another program). A worker ends such a job dead before any
    #: handler sees it.
    run_at: datetime
    lease_expires_at: datetime
    #: The enqueuer's trace context (schema version 3), or None; see :mod:`sqla_jobs.tracing`.
    trace_context: dict[str, str] | None = None
    #: The job's own time limit (schema version 4), or None for its task's
    #: (:class:`~sqla_jobs.Task`'s ``time_limit``; a worker enforces the two).
    time_limit: timedelta | None = None

    @property
    def is_last_attempt(self) -> bool:
        """Whether a failure of this attempt makes the job dead."""
        return self.attempt >= self.max_attempts


@dataclass(frozen=True, slots=True)
class FailOutcome:
    """What :func:`fail` did: ``status`` is ``pending`` (a retry at ``run_at``) or ``dead``.
    ``run_at`` is None only when the row's ``run_at`` (kept by a dead job) lies outside what
    Python's datetime holds (written by another program)."""

    job_id: int
    status: JobStatus
    run_at: datetime | None

    @property
    def will_retry(self) -> bool:
        return self.status is JobStatus.PENDING


@dataclass(frozen=True, slots=True)
class QueueStat:
    """A row of :func:`queue_stats`: one queue's jobs in one live status.

    ``oldest_pending_seconds`` (pending rows only) is how long the oldest runnable pending
    job has waited past its ``run_at``, in database time, None when none is runnable;
    ``runnable`` (pending rows) how many pending jobs have reached their ``run_at``;
    ``expired_leases`` (running rows) how many running jobs' leases have run out (a crashed
    or stalled worker's; the next claim takes them over).
    """

    queue: str
    status: JobStatus
    count: int
    oldest_pending_seconds: float | None
    runnable: int = 0
    expired_leases: int = 0


def _one_model(jobs: Sequence[ClaimedJob]) -> type[JobMixin]:
    model = jobs[0].model
    if any(job.model is not model for job in jobs):
        raise ConfigurationError("a batch must hold jobs of one model; split it by model")
    return model


def _fence_params(jobs: Sequence[ClaimedJob]) -> FenceParams:
    # Comma-separated text, split and cast by the statement (statements._sql._fences); built by
    # C-level iteration (map), as a worker's outcome writer does for every job it writes.
    return {
        "fence_ids": ",".join(map(str, map(_JOB_ID, jobs))),
        "fence_attempts": ",".join(map(str, map(_JOB_ATTEMPT, jobs))),
    }


_JOB_ID: Final = operator.attrgetter("id")
_JOB_ATTEMPT: Final = operator.attrgetter("attempt")
#: A claim row's (priority, run_at, id): the order of claimed jobs.
_EARLIEST: Final = datetime.min.replace(tzinfo=timezone.utc)


def _claim_order_with_unreadable(row: Sequence[Any]) -> tuple[int, datetime, int]:
    """:data:`~sqla_jobs._queries.rows.CLAIM_ORDER` for rows among which a ``run_at`` came
    back None (unreadable: :func:`sqla_jobs._queries._sql._readable_time`), which sorts
    first, as its ``'-infinity'`` or ancient time does in the claim's own order."""
    priority, run_at, job_id = CLAIM_ORDER(row)
    return (priority, run_at or _EARLIEST, job_id)


def _seconds(field: str, value: timedelta | float) -> float:
    # The statements take durations as float seconds (``:lease_seconds``, ...).
    return validation.check_duration(field, value).total_seconds()


def _check_count(field: str, value: object, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise InvalidJobError(field, f"must be an integer in [1, {maximum}], got {value!r}")


def _check_queues(queues: str | Iterable[str]) -> list[str]:
    names = [queues] if isinstance(queues, str) else list(queues)
    if not names:
        raise InvalidJobError("queues", "must name at least one queue")
    for name in names:
        validation.check_name("queues", name)
    return list(dict.fromkeys(names))


@functools.cache
def default_worker_name() -> str:
    """``host:pid``, recorded as ``leased_by`` on the jobs a process claims."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _fenced(rows: Iterable[Any]) -> set[tuple[int, int]]:
    """The ``(id, attempt)`` fences that a fenced statement's ``RETURNING`` matched."""
    # Every fenced statement's row starts with ``id, attempts`` (FenceRow; the rows' types
    # are held to it by tests/test_query_rows.py).
    return set(map(FENCE, rows))


def _lost(jobs: Sequence[ClaimedJob], kept: set[tuple[int, int]]) -> list[ClaimedJob]:
    # Keyed by (id, attempt), never by id alone: one batch may hold a stale attempt and the
    # current attempt of the same job.
    return [job for job in jobs if (job.id, job.attempt) not in kept]


# -- the model's own columns, as enqueue_many sends them ------------------------------------


_MIXIN_INPUTS: Final = frozenset(statements.ENQUEUE_COLUMNS)


def _json_default(value: object) -> object:
    # Values of the model's own columns that JSON has no type for; PostgreSQL parses the
    # text with the column type's input function.
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, Decimal | UUID):
        return str(value)
    if isinstance(value, timedelta):
        return f"{value.total_seconds()} seconds"
    raise TypeError(f"cannot send a {type(value).__name__} through enqueue_many")


_encode = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_json_default
).encode


@functools.lru_cache(maxsize=64)
def _own_columns(table: Table) -> frozenset[str]:
    return frozenset(statements.enqueue_columns(table)) - _MIXIN_INPUTS
