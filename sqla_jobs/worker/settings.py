"""The worker's settings, in five groups: each setting's default, its limits and the check
that refuses a bad value with a :class:`~sqla_jobs.errors.ConfigurationError` are written
once, on its field, and run when the group is built, before the worker touches the database.

``claiming=`` :class:`ClaimSettings`
    which queues, how many jobs at once, how jobs are found and claimed
``timing=`` :class:`TimingSettings`
    how long shutdown, stalls and locks may take; whether commits wait for the WAL flush
``observability=`` :class:`ObservabilitySettings`
    the worker's name, its health file and its metrics server
``sessions=`` :class:`SessionSettings`
    the sessions lock-mode handlers write through
``maintenance=`` :class:`MaintenanceSettings`
    periodic tasks and the upkeep of the job history

Every field may also be given to the :class:`~sqla_jobs.worker.Worker` flat
(``Worker(registry, engine, concurrency=8)``, typed by :class:`WorkerOptions`): it is routed
into its group, with the same default and the same check. A group given whole and one of its
fields given flat is refused: one setting, one place it comes from.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypedDict, cast

from sqlalchemy import Engine

from sqla_jobs import validation
from sqla_jobs.errors import ConfigurationError, InvalidJobError
from sqla_jobs.pooler import POOLER_MODES
from sqla_jobs.queue import MAX_CLAIM_LIMIT

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "HISTORY_EVERY",
    "MAX_LOCK_TIMEOUT",
    "MAX_METRICS_MAX_AGE",
    "MAX_PREFETCH",
    "MIN_POLL_INTERVAL",
    "ClaimSettings",
    "MaintenanceSettings",
    "ObservabilitySettings",
    "SessionSettings",
    "TimingSettings",
    "WorkerOptions",
    "WorkerSettings",
    "int_in",
    "positive_int",
    "worker_settings",
]

#: Seconds between two runs of the history role (partitions, mover, retention).
HISTORY_EVERY: Final = 60.0
#: The default largest claim (``batch_size``), unless the concurrency is larger: the plain
#: loop's best batch in the bench's sweeps.
DEFAULT_BATCH_SIZE: Final = 500
#: The most jobs a worker may claim beyond its free slots (``prefetch``).
MAX_PREFETCH: Final = 10_000
#: The longest ``lock_timeout`` (exclusive), in seconds.
MAX_LOCK_TIMEOUT: Final = 3600.0
#: The longest ``metrics_max_age``, in seconds.
MAX_METRICS_MAX_AGE: Final = 3600.0
#: The shortest poll interval the worker keeps (a smaller one, 0 included, is raised to it).
MIN_POLL_INTERVAL: Final = 0.01


@dataclass(frozen=True, kw_only=True)
class ClaimSettings:
    """Which jobs the worker takes, and how it finds and claims them (``claiming=``)."""

    #: The queues to serve, deduplicated in order (default, or empty: every queue the
    #: registry has tasks in).
    queues: Iterable[str] | None = None
    #: How many jobs run at once: the handler threads. The engine's pool needs
    #: ``concurrency + 3`` connections, plus one for the listener.
    concurrency: int = 4
    #: The most jobs one claim takes, in [1, :data:`~sqla_jobs.queue.MAX_CLAIM_LIMIT`]
    #: (default: :data:`DEFAULT_BATCH_SIZE`, or ``concurrency`` if larger; see
    #: :attr:`largest_claim`). A claim takes no more jobs than there are free slots plus
    #: the prefetch.
    batch_size: int | None = None
    #: How many jobs the worker may claim beyond its free slots, in [0,
    #: :data:`MAX_PREFETCH`], to have the next job ready when a handler thread frees while
    #: the next claim runs (default: as many as the handlers run in about two claim round
    #: trips, at most ``batch_size``, following their rate; 0: none; see
    #: :mod:`sqla_jobs.worker.fetcher`).
    prefetch: int | None = None
    #: The longest a runnable job waits for an idle worker when no notification arrives,
    #: in seconds, not negative (a delayed job starts within one interval of its
    #: ``run_at``); below :data:`MIN_POLL_INTERVAL`, that.
    poll_interval: float = 1.0
    #: Whether new jobs wake the worker through LISTEN/NOTIFY (False: polling only).
    listen: bool = True
    #: An engine with a direct connection to the server, to LISTEN on when the worker's
    #: engine goes through a pooler in transaction mode (without one, such a worker polls).
    listen_engine: Engine | None = None
    #: ``"auto"`` finds out at start whether the engine goes through a pooler in
    #: transaction mode (:func:`sqla_jobs.pooler.behind_pooler`), ``"transaction"`` assumes
    #: it, ``"none"`` keeps the direct behaviour whatever the engine goes through.
    pooler: str = "auto"
    #: How many child processes run the handlers of process tasks (``process=True``:
    #: :mod:`sqla_jobs.worker.processes`), in [1, ``concurrency``] (each holds a handler
    #: thread while it runs a job); started with the worker when the registry has such a
    #: task. Default: the CPU count, at most ``concurrency``.
    processes: int | None = None

    def __post_init__(self) -> None:
        if self.queues is not None:
            if isinstance(self.queues, str):
                raise ConfigurationError(
                    f"queues must be a list of queue names, not the string {self.queues!r}"
                )
            names = (_checked("queues", validation.check_name, q) for q in self.queues)
            object.__setattr__(self, "queues", tuple(dict.fromkeys(names)))
        if not positive_int(self.concurrency):
            raise ConfigurationError(
                f"concurrency must be a positive integer, not {self.concurrency!r}"
            )
        if self.batch_size is not None and not int_in(self.batch_size, 1, MAX_CLAIM_LIMIT):
            raise ConfigurationError(
                f"batch_size must be an integer in [1, {MAX_CLAIM_LIMIT}], not {self.batch_size!r}"
            )
        if self.prefetch is not None and not int_in(self.prefetch, 0, MAX_PREFETCH):
            raise ConfigurationError(
                f"prefetch must be an integer in [0, {MAX_PREFETCH}], not {self.prefetch!r}"
            )
        _check_seconds("poll_interval", self.poll_interval)
        _check_bool("listen", self.listen)
        if self.listen_engine is not None and not isinstance(self.listen_engine, Engine):
            raise ConfigurationError(
                f"listen_engine must be a sync SQLAlchemy Engine, not {self.listen_engine!r}"
            )
        if self.pooler not in POOLER_MODES:
            raise ConfigurationError(f"pooler must be one of {POOLER_MODES}, not {self.pooler!r}")
        if self.processes is not None and not int_in(self.processes, 1, self.concurrency):
            raise ConfigurationError(
                f"processes must be an integer in [1, concurrency={self.concurrency}] (a "
                f"process handler holds a handler thread), not {self.processes!r}"
            )

    @property
    def largest_claim(self) -> int:
        """``batch_size``, or its default: :data:`DEFAULT_BATCH_SIZE`, or the concurrency if
        larger. A claim takes more jobs than there are free slots only through the prefetch,
        which follows the handlers' rate: slow jobs are claimed for free slots, quick ones
        in large batches whatever the concurrency (measured: docs/benchmarks.md)."""
        return self.batch_size or max(self.concurrency, DEFAULT_BATCH_SIZE)

    @property
    def poll_every(self) -> float:
        """``poll_interval``, at least :data:`MIN_POLL_INTERVAL`."""
        return max(self.poll_interval, MIN_POLL_INTERVAL)


@dataclass(frozen=True, kw_only=True)
class TimingSettings:
    """How long the worker lets things take, and how its own commits wait (``timing=``)."""

    #: Seconds running jobs may take to finish after a stop is asked for, not negative.
    grace: float = 30.0
    #: Seconds a stalled fetch loop, handler hand-off or outcome write may last before
    #: :meth:`~sqla_jobs.worker.Worker.health` reports the worker unhealthy, positive
    #: (default: 30, or three poll intervals if longer).
    stuck_after: float | None = None
    #: The ``lock_timeout`` of the worker's own connections, in seconds, in (0,
    #: :data:`MAX_LOCK_TIMEOUT`).
    lock_timeout: float = 5.0
    #: False lets the worker's own claim, outcome and heartbeat transactions commit without
    #: waiting for the WAL flush (``synchronous_commit = off``): after a server crash the
    #: last few of them may be lost, which only makes their jobs run again
    #: (docs/operations/deploying.md); lock-mode handler transactions stay durable.
    synchronous_commit: bool = True

    def __post_init__(self) -> None:
        _check_seconds("grace", self.grace)
        if self.stuck_after is not None:
            _check_seconds("stuck_after", self.stuck_after, positive=True)
        _check_seconds("lock_timeout", self.lock_timeout)
        if not 0 < self.lock_timeout < MAX_LOCK_TIMEOUT:
            raise ConfigurationError(
                f"lock_timeout must be in (0, {MAX_LOCK_TIMEOUT:g}) seconds, "
                f"not {self.lock_timeout!r}"
            )
        _check_bool("synchronous_commit", self.synchronous_commit)

    def stall_limit(self, poll_interval: float) -> float:
        """``stuck_after``, or its default: 30 seconds, or three poll intervals if longer."""
        return self.stuck_after or max(30.0, 3 * poll_interval)


@dataclass(frozen=True, kw_only=True)
class ObservabilitySettings:
    """How the worker is seen from outside: its name, health file and metrics
    (``observability=``)."""

    #: The name recorded on the jobs it holds and in its log lines and thread names
    #: (default: ``host:pid``).
    name: str | None = None
    #: A file touched every second while the worker is healthy, for a liveness probe.
    health_file: str | os.PathLike[str] | None = None
    #: Serve Prometheus metrics on this port (0: any free port) while the worker runs;
    #: needs the ``metrics`` extra. Default: none, and nothing imported for metrics.
    metrics_port: int | None = None
    #: The address the metrics are served on (``0.0.0.0``: every interface).
    metrics_host: str = "127.0.0.1"
    #: The longest the job table's health gauges are reused between scrapes, in seconds,
    #: in (0, :data:`MAX_METRICS_MAX_AGE`].
    metrics_max_age: float = 5.0

    def __post_init__(self) -> None:
        if self.name is not None and not isinstance(self.name, str):
            raise ConfigurationError(f"name must be a string, not {self.name!r}")
        if self.health_file is not None:
            if not isinstance(self.health_file, str | os.PathLike):
                raise ConfigurationError(f"health_file must be a path, not {self.health_file!r}")
            object.__setattr__(self, "health_file", Path(self.health_file))
        if self.metrics_port is None:
            return
        port = self.metrics_port
        if not int_in(port, 0, 65535):
            raise ConfigurationError(f"metrics_port must be an integer in [0, 65535], not {port!r}")
        host: object = self.metrics_host
        if not isinstance(host, str) or not host:
            raise ConfigurationError(
                f"metrics_host must be a host name or address, not {self.metrics_host!r}"
            )
        age = self.metrics_max_age
        number = not isinstance(age, bool) and isinstance(age, int | float)
        if not number or not 0 < age <= MAX_METRICS_MAX_AGE:
            raise ConfigurationError(
                f"metrics_max_age must be in (0, {MAX_METRICS_MAX_AGE:g}] seconds, not {age!r}"
            )
        if importlib.util.find_spec("prometheus_client") is None:
            raise ConfigurationError(
                "metrics_port needs prometheus_client: pip install 'sqla-jobs[metrics]'"
            )


@dataclass(frozen=True, kw_only=True)
class SessionSettings:
    """The sessions the handlers of lock-mode tasks write through, inside the transaction
    that holds their job's row lock (``sessions=``)."""

    #: Makes the :class:`~sqlalchemy.orm.Session` of a lock-mode handler (``ctx.session``),
    #: e.g. the application's ``sessionmaker``, configured like the rest of the application
    #: (default: a plain ``Session(engine)``).
    session_factory: Callable[[], Session] | None = None
    #: Makes the :class:`~sqlalchemy.ext.asyncio.AsyncSession` of a lock-mode coroutine
    #: function (``ctx.async_session``), e.g. an ``async_sessionmaker``.
    async_session_factory: Callable[[], AsyncSession] | None = None

    def __post_init__(self) -> None:
        for label in ("session_factory", "async_session_factory"):
            value = getattr(self, label)
            if value is not None and not callable(value):
                raise ConfigurationError(f"{label} must be callable, not {value!r}")


@dataclass(frozen=True, kw_only=True)
class MaintenanceSettings:
    """What the worker keeps besides running jobs: periodic tasks and, for a model with
    ``partitioned_history``, its history (:mod:`sqla_jobs.worker.maintenance`)
    (``maintenance=``)."""

    #: Whether this worker enqueues the due slots of the registry's periodic tasks
    #: (``schedule=``; :mod:`sqla_jobs.periodic`), whichever queues it serves: every worker
    #: may, and the database lets exactly one enqueue each slot. False leaves that to the
    #: other workers.
    scheduler: bool = True
    #: Drop the history partitions older than this (a ``timedelta`` or seconds). Cannot go
    #: with ``history_partitions=False``.
    history_retention: timedelta | float | None = None
    #: Seconds between two runs of the history role (partitions, mover, retention),
    #: positive.
    history_every: float = HISTORY_EVERY
    #: False: the worker only moves finished jobs into the history, and leaves making and
    #: dropping partitions (DDL that PostgreSQL allows to the history table's owner only)
    #: to the owner's ``sqla-jobs history`` (docs/operations/privileges.md).
    history_partitions: bool = True

    def __post_init__(self) -> None:
        _check_bool("scheduler", self.scheduler)
        if self.history_retention is not None:
            retention = self.history_retention
            retention = _checked("history_retention", validation.check_duration, retention)
            object.__setattr__(self, "history_retention", retention)
        _check_seconds("history_every", self.history_every, positive=True)
        _check_bool("history_partitions", self.history_partitions)
        if not self.history_partitions and self.history_retention is not None:
            raise ConfigurationError(
                "history_retention drops partitions, which history_partitions=False leaves to "
                "the history table's owner: give the retention to its `sqla-jobs history "
                "--retention` instead"
            )

    @property
    def retention(self) -> timedelta | None:
        """``history_retention`` as a ``timedelta`` (the check made it one), or None."""
        return cast("timedelta | None", self.history_retention)


class WorkerOptions(TypedDict, total=False):
    """The worker's settings given flat, as keywords of :class:`~sqla_jobs.worker.Worker`:
    each is the field of the same name of one group, where its default, limits and
    meaning are written (tests/test_worker_settings.py keeps the two lists equal)."""

    # ClaimSettings
    queues: Iterable[str] | None
    concurrency: int
    batch_size: int | None
    prefetch: int | None
    poll_interval: float
    listen: bool
    listen_engine: Engine | None
    pooler: str
    processes: int | None
    # TimingSettings
    grace: float
    stuck_after: float | None
    lock_timeout: float
    synchronous_commit: bool
    # ObservabilitySettings
    name: str | None
    health_file: str | os.PathLike[str] | None
    metrics_port: int | None
    metrics_host: str
    metrics_max_age: float
    # SessionSettings
    session_factory: Callable[[], Session] | None
    async_session_factory: Callable[[], AsyncSession] | None
    # MaintenanceSettings
    scheduler: bool
    history_retention: timedelta | float | None
    history_every: float
    history_partitions: bool


class WorkerSettings(NamedTuple):
    """A worker's five groups of settings, each checked."""

    claiming: ClaimSettings
    timing: TimingSettings
    observability: ObservabilitySettings
    sessions: SessionSettings
    maintenance: MaintenanceSettings


#: Each group's :class:`~sqla_jobs.worker.Worker` keyword and class, in signature order.
GROUPS: Final[Mapping[str, type[Any]]] = {
    "claiming": ClaimSettings,
    "timing": TimingSettings,
    "observability": ObservabilitySettings,
    "sessions": SessionSettings,
    "maintenance": MaintenanceSettings,
}
#: Each setting's group keyword.
HOMES: Final[Mapping[str, str]] = {
    field.name: keyword for keyword, group in GROUPS.items() for field in dataclasses.fields(group)
}


def worker_settings(groups: Mapping[str, object], flat: Mapping[str, object]) -> WorkerSettings:
    """The five groups from the :class:`~sqla_jobs.worker.Worker` keywords: each group as
    given (``groups``, None for its defaults) or built from the flat keywords that belong
    to it; a ConfigurationError for a keyword no group has, a group that is not its
    class, or a group given both ways."""
    for keyword in flat:
        if keyword not in HOMES:
            close = difflib.get_close_matches(keyword, [*HOMES, *GROUPS], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigurationError(f"the worker has no setting {keyword!r}{hint}")
    built: dict[str, Any] = {}
    for keyword, group in GROUPS.items():
        given = groups.get(keyword)
        fields = {name: value for name, value in flat.items() if HOMES[name] == keyword}
        if given is None:
            built[keyword] = group(**fields)
            continue
        if not isinstance(given, group):
            raise ConfigurationError(f"{keyword} must be a {group.__name__}, not {given!r}")
        if fields:
            names = ", ".join(sorted(fields))
            raise ConfigurationError(
                f"{names} belong to {keyword}={group.__name__}(...), which was given too: "
                f"set them there"
            )
        built[keyword] = given
    return WorkerSettings(**built)


def positive_int(value: object) -> bool:
    return int_in(value, 1, None)


def int_in(value: object, low: int, high: int | None) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= low
        and (high is None or value <= high)
    )


def _check_seconds(label: str, value: object, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{label} must be a number of seconds, not {value!r}")
    if positive and not value > 0:
        raise ConfigurationError(f"{label} must be positive, not {value!r}")
    if not value >= 0:  # NaN too
        raise ConfigurationError(f"{label} must not be negative, got {value!r}")


def _check_bool(label: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{label} must be True or False, not {value!r}")


def _checked(label: str, check: Callable[[str, Any], Any], value: object) -> Any:
    # validation's checks raise the job's error; a worker setting is configuration.
    try:
        return check(label, value)
    except InvalidJobError as exc:
        raise ConfigurationError(str(exc)) from None
