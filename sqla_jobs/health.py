"""Health gauges of a job table, cheap at any size of history, and thresholds on them.

:func:`read_gauges` answers "is the queue keeping up, and will the table stay fast" in a few
index reads: job counts by queue and live status, the oldest runnable job's age, the expired
leases, the rate limits' windows, the fairly shared queues' tenants (given the fair shares)
and the dead jobs (from the claim's partial indexes and the dead index, never from
the finished history; for a model with ``partitioned_history``, also from its history
table's dead index), the oldest snapshot on the server that holds back vacuum, and the job
table's dead tuples and sizes (from PostgreSQL's statistics). Every age is measured by the
database's clock. ``sqla-jobs status`` prints them, ``sqla-jobs health`` checks them against
:class:`Thresholds`, the worker's metrics endpoint exports them, and a dashboard can reuse
:class:`GaugeCache`, which keeps a slow database from hanging whoever asks::

    with Session(engine) as session:
        gauges = read_gauges(session, EmailJob)
    problems = Thresholds(max_oldest_runnable=60, max_dead=100).problems(gauges)

Read from a read replica (a streaming standby), the same gauges are as old as its replay:
:func:`read_replica_lag`, in the same transaction, says how old (:class:`ReplicaLag`; it
lives in :mod:`sqla_jobs.replicas` and is exported here). On a standby the job table's
dead row versions and last vacuum are the standby's own statistics, not the primary's
(PostgreSQL does not replicate them), and the oldest snapshot is one of the standby's
backends.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any, Final, Generic, TypeVar, overload

from sqlalchemy import Connection

from sqla_jobs._queries.admin import OLDEST_XMIN, STATEMENT_TIMEOUT, TABLE_STATS
from sqla_jobs._queries.history import DATABASE_NOW
from sqla_jobs.errors import ConfigurationError, InvalidJobError, InvalidThresholdError
from sqla_jobs.events import describe
from sqla_jobs.queue import Executor, paused_queues, queue_stats, rate_usage
from sqla_jobs.queue.rating import DEFAULT_TOP_TENANTS, checked_fair_shares, tenant_depths
from sqla_jobs.replicas import ReplicaLag, read_replica_lag
from sqla_jobs.schema import JobMixin, JobStatus
from sqla_jobs.validation import FairShare

__all__ = [
    "GaugeCache",
    "GaugeReading",
    "Gauges",
    "QueueGauges",
    "ReplicaLag",
    "TableGauges",
    "Thresholds",
    "XminHolder",
    "read_gauges",
    "read_replica_lag",
]

#: The longest a :class:`GaugeCache` read may take (seconds), and the longest time its
#: values may be kept.
MAX_TIMEOUT: Final = 300.0
MAX_AGE: Final = 3600.0


@dataclass(frozen=True, slots=True)
class QueueGauges:
    """One queue's live jobs. ``oldest_runnable_seconds``: how long the oldest pending job
    whose ``run_at`` has come has waited since (None when none has). ``paused``: the queue
    is paused (:func:`sqla_jobs.pause_queue`), for ``paused_seconds``: its runnable jobs
    wait for the resume (a paused queue with no job is listed too). ``rate_limit`` per
    ``rate_window_seconds``: the queue's rate limit as its claims logged it
    (:func:`sqla_jobs.rate_usage`; None without one), ``rate_started`` the attempts its
    window holds now (None for a limit per key), ``rate_full_keys`` the keys whose windows
    are full (a limit per key). ``fair_column``: the column a fairly shared queue is shared
    by (:class:`~sqla_jobs.FairShare`, as given to :func:`read_gauges`; None for any other
    queue), ``fair_tenants`` how many tenants have pending jobs without an ordering key,
    ``fair_deepest_pending`` the deepest one's count (None when none has any), and
    ``fair_deepest`` the deepest tenants, ``(tenant, pending)`` each, most first
    (:func:`sqla_jobs.tenant_depths`)."""

    queue: str
    pending: int = 0
    runnable: int = 0
    running: int = 0
    expired_leases: int = 0
    dead: int = 0
    oldest_runnable_seconds: float | None = None
    paused: bool = False
    paused_seconds: float | None = None
    rate_limit: int | None = None
    rate_window_seconds: float | None = None
    rate_started: int | None = None
    rate_full_keys: int = 0
    fair_column: str | None = None
    fair_tenants: int | None = None
    fair_deepest_pending: int | None = None
    fair_deepest: tuple[tuple[Any, int], ...] = ()


@dataclass(frozen=True, slots=True)
class TableGauges:
    """The job table as PostgreSQL's statistics and catalog see it (None: not known, or
    no such index). ``estimated_rows`` is the planner's estimate of all rows, history
    included; ``vacuum_age_seconds`` the time since the last vacuum of the table."""

    table: str
    live_tuples: int | None
    dead_tuples: int | None
    estimated_rows: int | None
    table_bytes: int | None
    indexes_bytes: int | None
    pending_index_bytes: int | None
    running_index_bytes: int | None
    dead_index_bytes: int | None
    vacuum_age_seconds: float | None


@dataclass(frozen=True, slots=True)
class XminHolder:
    """A transaction snapshot that keeps vacuum from removing dead rows anywhere on the
    server: ``kind`` ``backend`` (an open transaction or running query; ``holder`` is its
    pid, application and state), ``prepared`` (a prepared transaction's gid) or ``slot``
    (a replication slot's name, which has no start time)."""

    kind: str
    holder: str
    age_seconds: float | None
    age_xids: int | None

    def __str__(self) -> str:
        age = "" if self.age_seconds is None else f", open {self.age_seconds:.1f}s"
        xids = "" if self.age_xids is None else f", {self.age_xids} xids old"
        return f"{self.kind} {self.holder}{age}{xids}"


@dataclass(frozen=True, slots=True)
class Gauges:
    """What :func:`read_gauges` read, at ``taken_at`` (the database's clock)."""

    queues: tuple[QueueGauges, ...]
    table: TableGauges
    #: The holder open the longest, and the one with the oldest xmin (often the same).
    oldest_xmin: XminHolder | None
    oldest_xmin_by_xids: XminHolder | None
    taken_at: datetime

    @property
    def pending(self) -> int:
        return sum(q.pending for q in self.queues)

    @property
    def runnable(self) -> int:
        return sum(q.runnable for q in self.queues)

    @property
    def running(self) -> int:
        return sum(q.running for q in self.queues)

    @property
    def expired_leases(self) -> int:
        return sum(q.expired_leases for q in self.queues)

    @property
    def dead(self) -> int:
        return sum(q.dead for q in self.queues)

    @property
    def paused(self) -> tuple[str, ...]:
        """The paused queues, by name."""
        return tuple(q.queue for q in self.queues if q.paused)

    @property
    def oldest_runnable_seconds(self) -> float | None:
        ages = [q.oldest_runnable_seconds for q in self.queues]
        known = [age for age in ages if age is not None]
        return max(known) if known else None

    @property
    def xmin_age_seconds(self) -> float | None:
        holder = self.oldest_xmin
        return None if holder is None else holder.age_seconds


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def read_gauges(
    session: Executor,
    model: type[JobMixin],
    *,
    fair_shares: Mapping[str, FairShare] | None = None,
) -> Gauges:
    """Read every health gauge of ``model``'s job table, in the caller's transaction.

    Five statements (seven with a rate table), none of which reads the finished history:
    :func:`~sqla_jobs.queue_stats` (the pending, running and dead partial indexes, and the
    history's dead index for a model with ``partitioned_history``),
    :func:`~sqla_jobs.paused_queues` (the pause table), :func:`~sqla_jobs.rate_usage` (the
    rate table, when there is one),
    :func:`sqla_jobs._queries.table_stats`
    (statistics and catalog), :func:`sqla_jobs._queries.oldest_xmin` (``pg_stat_activity``,
    ``pg_prepared_xacts``, ``pg_replication_slots``) and the database's clock; and with
    ``fair_shares`` (queue names to :class:`~sqla_jobs.FairShare`: a registry's
    :attr:`~sqla_jobs.Registry.fair_shares`), :func:`~sqla_jobs.tenant_depths` per fairly
    shared queue (its fair index; the :data:`~sqla_jobs.queue.rating.DEFAULT_TOP_TENANTS`
    deepest tenants), each of them listed with or without jobs. Takes no lock. Bad
    ``fair_shares`` raise :class:`~sqla_jobs.errors.InvalidJobError` before any SQL.
    """
    # First: the fair shares are checked before any statement runs.
    depths = tenant_depths(session, model, fair_shares, top=DEFAULT_TOP_TENANTS)
    counts: dict[str, dict[str, Any]] = {}
    for stat in queue_stats(session, model):  # checks the model first
        queue = counts.setdefault(stat.queue, {"queue": stat.queue})
        if stat.status is JobStatus.PENDING:
            queue["pending"] = stat.count
            queue["runnable"] = stat.runnable
            queue["oldest_runnable_seconds"] = stat.oldest_pending_seconds
        elif stat.status is JobStatus.RUNNING:
            queue["running"] = stat.count
            queue["expired_leases"] = stat.expired_leases
        elif stat.status is JobStatus.DEAD:
            queue["dead"] = stat.count
    for pause in paused_queues(session, model):
        queue = counts.setdefault(pause.queue, {"queue": pause.queue})
        queue["paused"], queue["paused_seconds"] = True, pause.paused_seconds
    for rate in rate_usage(session, model):
        queue = counts.setdefault(rate.queue, {"queue": rate.queue})
        queue["rate_limit"], queue["rate_window_seconds"] = rate.limit, rate.window_seconds
        queue["rate_started"], queue["rate_full_keys"] = rate.started, rate.full_keys
    for depth in depths:
        queue = counts.setdefault(depth.queue, {"queue": depth.queue})
        queue["fair_column"], queue["fair_tenants"] = depth.column, depth.tenants
        queue["fair_deepest_pending"], queue["fair_deepest"] = depth.deepest_pending, depth.deepest
    table = model.__table__  # type: ignore[attr-defined]
    (row,) = TABLE_STATS.rows(session, table, {})
    holders: dict[str, XminHolder] = {}
    for holder in OLDEST_XMIN.rows(session, None, {}):
        holders[holder.measure] = XminHolder(
            kind=holder.kind,
            holder=holder.holder,
            age_seconds=_float(holder.age_seconds),
            age_xids=_int(holder.age_xids),
        )
    (now,) = DATABASE_NOW.rows(session, None, {})
    return Gauges(
        queues=tuple(QueueGauges(**counts[name]) for name in sorted(counts)),
        table=TableGauges(
            table=table.fullname,
            live_tuples=_int(row.live_tuples),
            dead_tuples=_int(row.dead_tuples),
            estimated_rows=_int(row.estimated_rows),
            table_bytes=_int(row.table_bytes),
            indexes_bytes=_int(row.indexes_bytes),
            pending_index_bytes=_int(row.pending_index_bytes),
            running_index_bytes=_int(row.running_index_bytes),
            dead_index_bytes=_int(row.dead_index_bytes),
            vacuum_age_seconds=_float(row.vacuum_age_seconds),
        ),
        oldest_xmin=holders.get("seconds"),
        oldest_xmin_by_xids=holders.get("xids"),
        taken_at=now.statement_timestamp,
    )


# -- thresholds ---------------------------------------------------------------------------


def _count(field: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidThresholdError(field, f"must be an integer >= 0, got {value!r}")
    return value


def _seconds(field: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidThresholdError(
            field, f"must be a timedelta or a number of seconds, not {type(value).__name__}"
        )
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InvalidThresholdError(field, f"must be a finite duration >= 0, got {value!r}")
    return seconds


def _age(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.1f}m"


@dataclass(frozen=True)
class Thresholds:
    """Limits for :func:`read_gauges`'s values; ``None`` (the default) checks nothing.
    A value strictly above its limit is a problem.

    ``max_oldest_runnable``
        the longest any runnable job may wait past its ``run_at`` (timedelta or seconds)
    ``max_runnable``
        the most runnable jobs any one queue may have (its backlog)
    ``max_expired_leases``
        the most running jobs whose lease ran out (crashed or stalled workers)
    ``max_dead``
        the most dead jobs in the table
    ``max_xmin_age``
        the longest a snapshot anywhere on the server may hold back vacuum
    ``max_dead_tuples``
        the most dead row versions in the job table (vacuum not keeping up)

    Bad values raise :class:`~sqla_jobs.errors.InvalidThresholdError` at construction,
    before anything reads the database.
    """

    max_oldest_runnable: timedelta | float | None = None
    max_runnable: int | None = None
    max_expired_leases: int | None = None
    max_dead: int | None = None
    max_xmin_age: timedelta | float | None = None
    max_dead_tuples: int | None = None

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in ("max_oldest_runnable", "max_xmin_age"):
                _seconds(item.name, value)
            else:
                _count(item.name, value)

    def problems(self, gauges: Gauges) -> list[str]:
        """What crosses a limit, one short sentence each (empty: healthy)."""
        found: list[str] = []
        oldest = _seconds("max_oldest_runnable", self.max_oldest_runnable)
        if oldest is not None:
            for queue in gauges.queues:
                age = queue.oldest_runnable_seconds
                if age is not None and age > oldest:
                    found.append(
                        f"queue {queue.queue}: the oldest runnable job has waited {_age(age)} "
                        f"(max {_age(oldest)})"
                    )
        if self.max_runnable is not None:
            found.extend(
                f"queue {queue.queue}: {queue.runnable} runnable jobs (max {self.max_runnable})"
                for queue in gauges.queues
                if queue.runnable > self.max_runnable
            )
        if self.max_expired_leases is not None and gauges.expired_leases > self.max_expired_leases:
            found.append(
                f"{gauges.expired_leases} running jobs with expired leases "
                f"(max {self.max_expired_leases})"
            )
        if self.max_dead is not None and gauges.dead > self.max_dead:
            found.append(f"{gauges.dead} dead jobs (max {self.max_dead})")
        xmin = _seconds("max_xmin_age", self.max_xmin_age)
        holder = gauges.oldest_xmin
        if xmin is not None and holder is not None and (holder.age_seconds or 0.0) > xmin:
            found.append(
                f"vacuum held back for {_age(holder.age_seconds or 0.0)} by {holder.kind} "
                f"{holder.holder} (max {_age(xmin)})"
            )
        dead_tuples = gauges.table.dead_tuples
        if (
            self.max_dead_tuples is not None
            and dead_tuples is not None
            and dead_tuples > self.max_dead_tuples
        ):
            found.append(
                f"{gauges.table.table}: {dead_tuples} dead row versions "
                f"(max {self.max_dead_tuples})"
            )
        return found


# -- a cache for scrapes and dashboards ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class GaugeReading:
    """What :meth:`GaugeCache.read` has: the last gauges read (None before the first
    success), how long ago they were read (monotonic seconds), and the error of the last
    attempt if it failed or did not finish within the timeout."""

    gauges: Gauges | None
    age_seconds: float | None
    error: str | None


def _fair_shares(model: type[JobMixin], value: object) -> dict[str, FairShare]:
    """``value`` as fair shares of ``model``'s queues (:func:`tenant_depths`'s checks), or
    :class:`~sqla_jobs.errors.ConfigurationError`: a setting, checked where it is given."""
    try:
        return checked_fair_shares(model, value)
    except InvalidJobError as exc:
        raise ConfigurationError(f"fair_shares: {exc.reason}") from None


class GaugeCache:
    """:func:`read_gauges` for callers that must answer quickly whatever the database does:
    a metrics scrape, a dashboard page.

    :meth:`read` returns the cached gauges while they are younger than ``max_age``
    seconds. Older, it starts one read (on a connection of ``engine``'s pool, in a thread
    of its own, under a ``statement_timeout`` of ``timeout``) and waits for it at most
    ``timeout`` seconds: a slow or unreachable database gives the last values (or none)
    with an ``error``, never a hang. Concurrent callers share one read. Thread-safe.
    ``fair_shares`` (a registry's :attr:`~sqla_jobs.Registry.fair_shares`) adds the fairly
    shared queues' tenants (:func:`read_gauges`); bad ones raise
    :class:`~sqla_jobs.errors.ConfigurationError` here.
    """

    # Two forms for the type checker: a caller that passes its timings as ``**settings`` of
    # floats (with no fair shares among them) still type-checks.
    @overload
    def __init__(
        self, engine: Any, model: type[JobMixin], *, max_age: float = ..., timeout: float = ...
    ) -> None: ...

    @overload
    def __init__(
        self,
        engine: Any,
        model: type[JobMixin],
        *,
        max_age: float = ...,
        timeout: float = ...,
        fair_shares: Mapping[str, FairShare] | None,
    ) -> None: ...

    def __init__(
        self,
        engine: Any,
        model: type[JobMixin],
        *,
        max_age: float = 5.0,
        timeout: float = 2.0,
        fair_shares: Mapping[str, FairShare] | None = None,
    ) -> None:
        for field, value, top in (("max_age", max_age, MAX_AGE), ("timeout", timeout, MAX_TIMEOUT)):
            seconds = _seconds(field, value)
            if seconds is None or not 0 < seconds <= top:
                raise InvalidThresholdError(
                    field, f"must be in (0, {top:g}] seconds, got {value!r}"
                )
        self.engine = engine
        self.model = model
        self.fair_shares = _fair_shares(model, fair_shares)
        self.max_age = float(max_age)
        self.timeout = float(timeout)
        shares = self.fair_shares
        self._reads = CachedRead(
            engine,
            lambda connection: read_gauges(connection, model, fair_shares=shares),
            max_age=self.max_age,
            timeout=self.timeout,
            what="the gauges",
        )

    def read(self) -> GaugeReading:
        gauges, error, age = self._reads.read(time.monotonic() + self.timeout)
        return GaugeReading(gauges, age, error)


_T = TypeVar("_T")


class CachedRead(Generic[_T]):
    """The rules of :class:`GaugeCache`, for any read: ``read(connection)`` on a connection
    of ``engine``'s pool, at most once per ``max_age`` seconds, in a thread of its own,
    under a ``statement_timeout`` of ``timeout``; concurrent callers share one read, and a
    caller never waits past its deadline: it gets the last value read (None before the
    first), how old it is, and the last attempt's error (``"reading <what> took more
    than ...``" when it did not finish in time). Thread-safe. The metrics' workflow gauges
    use it beside :class:`GaugeCache`."""

    def __init__(
        self,
        engine: Any,
        read: Callable[[Connection], _T],
        *,
        max_age: float,
        timeout: float,
        what: str,
    ) -> None:
        self.engine = engine
        self.max_age = max_age
        self.timeout = timeout
        self._read = read
        self._what = what
        self._lock = threading.Lock()
        self._value: _T | None = None
        self._taken = 0.0
        self._error: str | None = None
        self._done: threading.Event | None = None

    def start(self) -> threading.Event | None:
        """Begin a read unless the value is fresh (or one is under way); what to wait on
        (None: fresh)."""
        with self._lock:
            if self._value is not None and time.monotonic() - self._taken < self.max_age:
                return None
            if self._done is None:
                self._done = threading.Event()
                threading.Thread(
                    target=self._refresh,
                    args=(self._done,),
                    # sqla-jobs-gauges, sqla-jobs-workflow-gauges
                    name="sqla-jobs-" + self._what.removeprefix("the ").replace(" ", "-"),
                    daemon=True,
                ).start()
            return self._done

    def read(self, deadline: float) -> tuple[_T | None, str | None, float | None]:
        """The value, the last error and the value's age (seconds; None before the first
        value), waiting for a read under way until ``deadline`` (``time.monotonic()``) at
        most."""
        done = self.start()
        if done is not None and not done.wait(max(deadline - time.monotonic(), 0.0)):
            with self._lock:
                self._error = f"reading {self._what} took more than {self.timeout:g}s"
        with self._lock:
            age = None if self._value is None else time.monotonic() - self._taken
            return self._value, self._error, age

    def _refresh(self, done: threading.Event) -> None:
        try:
            with self.engine.connect() as connection, connection.begin():
                millis = max(1, round(self.timeout * 1000))
                STATEMENT_TIMEOUT.one(connection, None, {"timeout": f"{millis}ms"})
                value = self._read(connection)
        except Exception as exc:
            with self._lock:
                self._error = describe(exc)
                self._done = None
        else:
            with self._lock:
                self._value, self._taken, self._error = value, time.monotonic(), None
                self._done = None
        finally:
            done.set()
