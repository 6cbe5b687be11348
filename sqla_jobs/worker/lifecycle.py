"""The worker's life: configuration, start, supervision, signals, shutdown and health.

The roles it starts, each a named thread (``sqla-jobs-<worker name>-<role>``):

``fetch``       claims jobs for free slots (:mod:`~sqla_jobs.worker.fetcher`)
``handler-N``   ``concurrency`` threads that run attempts (:mod:`~sqla_jobs.worker.runner`),
                plus ``event-loop`` once a handler returns an awaitable
``outcomes``    writes outcomes (:mod:`~sqla_jobs.worker.writer`)
``heartbeat``   extends leases (:mod:`~sqla_jobs.worker.heartbeat`)
``vacuum``      every 5,000 jobs this worker claims, :func:`sqla_jobs.vacuum` on the job
                table: a claim reads the pending index from its head, where claimed jobs
                leave dead entries until a vacuum, and autovacuum is too slow (or off) to
                keep a long drain as fast as a short one
``history``     for a model with ``partitioned_history``: its partitions, the move of
                finished jobs left in the job table, and retention
                (:mod:`~sqla_jobs.worker.maintenance`), at start and every minute
``notifier``    LISTENs for new jobs (:mod:`~sqla_jobs.worker.listener`)
``schedule``    enqueues the due slots of the registry's periodic tasks, when it has any
                (:mod:`~sqla_jobs.worker.scheduler`); every worker runs one, no leader

They share one :class:`~sqla_jobs.worker.state.State`, whose module states its locking
rules. The thread that calls :meth:`Worker.run` supervises them: a role thread that dies of
a bug is logged and restarted, and health is computed from what they report.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sqla_jobs import _queries as statements
from sqla_jobs._queries.admin import (
    STATUS_OF,
    TABLE_LAYOUT,
    TERMINATE_TRANSACTIONS,
    WAKEUP_TRIGGER_EXISTS,
    TerminateParams,
)
from sqla_jobs._queries.variant import tables_of
from sqla_jobs._queries.workflows import STEP_TRIGGERS
from sqla_jobs.backoff import Backoff
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.events import describe
from sqla_jobs.observer import NO_OBSERVER, Observer
from sqla_jobs.pooler import behind_pooler
from sqla_jobs.queue import default_worker_name, vacuum
from sqla_jobs.registry import Registry
from sqla_jobs.schema import has_steps
from sqla_jobs.worker.fetcher import Fetcher
from sqla_jobs.worker.health import WorkerHealth, assess
from sqla_jobs.worker.heartbeat import Heartbeat
from sqla_jobs.worker.link import Link, is_transient
from sqla_jobs.worker.listener import Notifier
from sqla_jobs.worker.maintenance import HistoryKeeper
from sqla_jobs.worker.roles import DatabaseWatch, Role
from sqla_jobs.worker.runner import Runner
from sqla_jobs.worker.scheduler import Scheduler
from sqla_jobs.worker.settings import (
    ClaimSettings,
    MaintenanceSettings,
    ObservabilitySettings,
    SessionSettings,
    TimingSettings,
    WorkerOptions,
    WorkerSettings,
    worker_settings,
)
from sqla_jobs.worker.signals import StopSignals
from sqla_jobs.worker.state import Attempt, State
from sqla_jobs.worker.table_version import (
    check_flow_control,
    check_steps,
    check_table_version,
)
from sqla_jobs.worker.writer import OutcomeWriter

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from sqla_jobs.metrics import MetricsServer

__all__ = ["Worker", "WorkerHealth"]

logger = logging.getLogger("sqla_jobs.worker")

_SUPERVISE_EVERY: Final = 0.1
_HEALTH_FILE_EVERY: Final = 1.0
_STUCK_LOG_EVERY: Final = 10.0
_DRAIN_TIMEOUT: Final = 5.0
# A connection refused by the server for good (not while it starts or stops): a wrong
# database, role or password. The server sends no SQLSTATE the driver exposes at connect.
_REFUSED_FOR_GOOD: Final = re.compile(
    r"does not exist|authentication failed|pg_hba\.conf|permission denied", re.IGNORECASE
)


def freeze_startup_heap() -> None:
    """Take every object the process holds so far out of the garbage collector's full
    collections (:func:`gc.freeze`), once the worker has started: its modules, mappers,
    registry, engines and pools live as long as the process, and a busy worker allocates
    a few objects per job, so the collector would walk them all again every few thousand
    jobs. Called by the calls that own the process (:meth:`Worker.run`,
    :meth:`WorkerGroup.run <sqla_jobs.WorkerGroup.run>`), not by :meth:`Worker.start`, which
    runs inside someone else's. Measured: a drain of 100,000 no-op jobs (one process,
    concurrency 200, embedded PostgreSQL 18) took 7.7 instead of 8.35 us of worker CPU per
    job (medians of 6 interleaved runs). Objects frozen stay alive even if they later become
    unreachable in a cycle: what the process made before its worker started."""
    gc.freeze()


class Worker:
    """Runs the jobs of ``registry`` from its queues (default: every queue it has tasks in).

    ``engine`` must be a PostgreSQL engine (psycopg 3) whose pool holds at least
    ``concurrency + 3`` connections (one per lock-mode handler, the fetch loop, the outcome
    writer, the heartbeat), plus one for the listener. The connections the worker keeps
    run at READ COMMITTED whatever the engine's isolation level, with ``lock_timeout``
    seconds as their ``lock_timeout``; after a server restart each is replaced at its first
    failure without an error logged.

    Its settings come in five groups (:mod:`sqla_jobs.worker.settings`), each a frozen
    dataclass whose fields carry their default, their limits and their check:

    ``claiming`` (:class:`~sqla_jobs.ClaimSettings`)
        ``queues``, ``concurrency``, ``batch_size``, ``prefetch``, ``poll_interval``,
        ``listen``, ``listen_engine``, ``pooler``, ``processes`` (the child processes of
        process tasks: :mod:`sqla_jobs.worker.processes`)
    ``timing`` (:class:`~sqla_jobs.TimingSettings`)
        ``grace``, ``stuck_after``, ``lock_timeout``, ``synchronous_commit``
    ``observability`` (:class:`~sqla_jobs.ObservabilitySettings`)
        ``name``, ``health_file``, ``metrics_port``, ``metrics_host``, ``metrics_max_age``
    ``sessions`` (:class:`~sqla_jobs.SessionSettings`)
        ``session_factory``, ``async_session_factory``: the sessions of lock-mode handlers
    ``maintenance`` (:class:`~sqla_jobs.MaintenanceSettings`)
        ``scheduler``, ``history_retention``, ``history_every``, ``history_partitions``

    Give a group whole (``claiming=ClaimSettings(queues=["email"], concurrency=8)``), or
    any of its fields flat (``Worker(registry, engine, concurrency=8)``, typed by
    :class:`~sqla_jobs.WorkerOptions`): either way the field's default and check apply, and
    a bad value raises :class:`~sqla_jobs.errors.ConfigurationError` here, before the
    worker touches the database. So does a setting no group has, a group given whole with
    one of its fields also given flat, and a group that is not its class. The settings as
    checked are :attr:`settings`.

    Run it in the foreground with :meth:`run` (the ``sqla-jobs worker`` command does):
    SIGTERM and SIGINT stop it gracefully, a second one at once. Or inside an application:
    in a background thread with :meth:`start` / :meth:`stop` or ``with worker:``, or on the
    application's event loop with ``async with worker:`` (coroutine handlers then run on
    that loop; FastAPI's lifespan, for example), which install no signal handler: the
    application owns its signals. ``handle_signals`` (default None: :meth:`run` yes, the
    embedding APIs no) says whether :meth:`run` installs them; Python lets only the main
    thread install them, so a :meth:`run` off the main thread that would logs once that it
    does not (``signals_not_handled``).

    For a model with ``partitioned_history``, the worker keeps its history
    (:mod:`sqla_jobs.history`): at start and every ``history_every`` seconds it makes the
    day partitions a week ahead and moves finished jobs left in the job table into the
    history, and with ``history_retention`` drops the partitions older than it. Every
    worker does it; runs of several never collide. A worker whose role PostgreSQL refuses
    the partition DDL says so once and only moves finished jobs until it restarts, as
    ``history_partitions=False`` asks from the start
    (:mod:`sqla_jobs.worker.maintenance`, docs/operations/privileges.md).

    Behind a connection pooler in transaction mode (PgBouncer), which ``pooler="auto"``
    finds out at start and ``"transaction"`` assumes, the worker keeps no session state:
    its connections set ``lock_timeout`` in each transaction, and it LISTENs on
    ``listen_engine``, or, without one, finds new jobs by polling only. Such an engine
    needs ``connect_args={"prepare_threshold": None}`` (the worker warns without).

    With a ``metrics_port``, the worker serves Prometheus metrics while it runs
    (:attr:`metrics_address` says where): its job counters and histograms
    (:class:`sqla_jobs.metrics.WorkerMetrics`) and the health gauges of its job table, read
    on scrape at most every ``metrics_max_age`` seconds. Without one (the default) it
    reports its events to a no-op observer and imports nothing for metrics.
    When the registry has periodic tasks (``schedule=``), the worker also enqueues their due
    slots (the ``schedule`` role; :mod:`sqla_jobs.periodic`) unless ``scheduler=False``.
    """

    def __init__(
        self,
        registry: Registry,
        engine: Engine,
        *,
        claiming: ClaimSettings | None = None,
        timing: TimingSettings | None = None,
        observability: ObservabilitySettings | None = None,
        sessions: SessionSettings | None = None,
        maintenance: MaintenanceSettings | None = None,
        handle_signals: bool | None = None,
        **settings: Unpack[WorkerOptions],
    ) -> None:
        if not isinstance(registry, Registry):
            raise ConfigurationError(f"expected a sqla_jobs Registry, not {registry!r}")
        if getattr(getattr(engine, "dialect", None), "is_async", False):
            raise ConfigurationError(
                f"the worker needs a sync engine (postgresql+psycopg), not {engine.url.drivername}"
                " (an async engine's sync_engine); its coroutine handlers may use an AsyncSession "
                "of their own on any driver, and async_session_factory gives lock-mode coroutines "
                "one"
            )
        if not isinstance(engine, Engine):
            raise ConfigurationError(f"expected a SQLAlchemy Engine, not {engine!r}")
        if handle_signals is not None and not isinstance(handle_signals, bool):
            raise ConfigurationError(
                f"handle_signals must be True, False or None, not {handle_signals!r}"
            )
        groups = worker_settings(
            {
                "claiming": claiming,
                "timing": timing,
                "observability": observability,
                "sessions": sessions,
                "maintenance": maintenance,
            },
            settings,
        )
        #: The worker's settings, each group as given or built from the flat keywords, and
        #: checked.
        self.settings: WorkerSettings = groups
        claim, times, seen, held, upkeep = groups
        self.metrics_port = seen.metrics_port
        self.metrics_host = seen.metrics_host
        self.metrics_max_age = seen.metrics_max_age
        self._metrics_server: MetricsServer | None = None
        #: Set by a WorkerGroup that serves its members' metrics: called with this worker's
        #: metrics registry when it starts, and with None when it stops.
        self._metrics_home: Callable[[Any], None] | None = None
        self._observer: Observer = NO_OBSERVER
        self.history_retention = upkeep.retention
        self.history_partitions = upkeep.history_partitions
        self.history_keeper: HistoryKeeper | None = None
        self.history_every = upkeep.history_every
        self.registry = registry
        self.engine = engine
        self.listen_engine = claim.listen_engine
        self.pooler = claim.pooler
        self.pooled = claim.pooler == "transaction"  # "auto": found out at start
        self.model = registry.model
        self.queues = list(claim.queues or registry.queues)
        if not self.queues:
            raise ConfigurationError("a worker needs at least one queue")
        self.concurrency = claim.concurrency
        self.batch_size = claim.largest_claim
        self.prefetch = claim.prefetch
        self.poll_interval = claim.poll_every
        self.grace = times.grace
        self.listen = claim.listen
        self.name = seen.name or default_worker_name()
        self.stuck_after = times.stall_limit(self.poll_interval)
        self.health_file = Path(seen.health_file) if seen.health_file is not None else None
        self.handle_signals = handle_signals
        self.lock_timeout = times.lock_timeout
        self.synchronous_commit = times.synchronous_commit
        #: Whether this worker enqueues the due slots of the registry's periodic tasks.
        self.scheduler = upkeep.scheduler and bool(registry.periodic_tasks)
        self._schedule_sessions = functools.partial(Session, engine)
        self._table = self.model.__table__  # type: ignore[attr-defined]
        self._prefix = f"sqla-jobs-{self.name}"

        self._state = State(self.concurrency)
        self._stopping = threading.Event()  # no more claims
        self._finished = threading.Event()  # the writer and the heartbeat end
        self._stop_requested = False
        self._stop_signal: int | None = None
        self._running = False
        self._database = DatabaseWatch()
        self._last_stuck_log = 0.0
        self._runner = Runner(
            self._state,
            registry,
            self.name,
            self._prefix,
            session_factory=held.session_factory or functools.partial(Session, engine),
            async_session_factory=held.async_session_factory,
            processes=claim.processes,
        )
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._exit: list[int | BaseException] = []
        self._fetcher: Fetcher | None = None
        self._roles: dict[str, Role] = {}
        self._notifier: Notifier | None = None
        self._heartbeat: Heartbeat | None = None

    # -- public -------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped; return the exit status (0 after a graceful stop).

        The call that owns the process: SIGTERM and SIGINT stop it gracefully (unless
        ``handle_signals=False``; see the class docstring), a second one at once.
        Raises :class:`~sqla_jobs.errors.ConfigurationError` at once when the database
        refuses the worker for good (no such database, role or table, a wrong password),
        and its :class:`~sqla_jobs.errors.SchemaVersionError` when the job table is at an
        older schema version (the message names the migration helpers that upgrade it);
        a server that is down or restarting is waited for. Once started, it takes the
        objects the process made so far out of the garbage collector's full collections
        (``gc.freeze()``): they live as long as the process, and a busy worker's collections
        would walk them again every few thousand jobs. :meth:`start` does not.
        """
        return self._run(embedded=False)

    def _run(self, *, embedded: bool) -> int:
        if self._running:
            raise ConfigurationError("this worker is already running")
        self._running = True
        try:
            self._preflight()
            self._start_metrics()
            signals = StopSignals(self._on_signal)
            wanted = self.handle_signals if self.handle_signals is not None else not embedded
            if wanted:
                signals.install("worker", "worker.stop()")
            try:
                self._start()
                if not embedded:
                    freeze_startup_heap()
                self._started.set()
                last_health_write = 0.0
                while not self._stop_requested:
                    time.sleep(_SUPERVISE_EVERY)
                    self._supervise()
                    now = time.monotonic()
                    if now - last_health_write >= _HEALTH_FILE_EVERY:
                        self._write_health_file()
                        last_health_write = now
                return self._shutdown()
            finally:
                signals.restore()
        finally:
            self._running = False
            self._stop_metrics()

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the metrics are served on while the worker runs, else None."""
        server = self._metrics_server
        return None if server is None else server.address

    def stop(self, *, graceful: bool = True, wait: bool = False) -> None:
        """Ask a running worker to stop (from any thread): like SIGTERM, or with
        ``graceful=False`` without the grace period (running jobs are released at once).
        With ``wait``, return once a worker started by :meth:`start` has stopped (and
        re-raise what ended it, if not a stop)."""
        if not graceful:
            self.grace = 0.0
        self._stop_requested = True
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()
            self._thread = None
            for outcome in self._exit:
                if isinstance(outcome, BaseException):
                    raise outcome

    def start(self) -> None:
        """Run the worker in a background thread of this process; return once it has
        started (the database answered), or raise what kept it from starting
        (:class:`~sqla_jobs.errors.ConfigurationError` for a database that refuses it).
        Stop it with :meth:`stop`; ``with worker:`` does both."""
        if self._thread is not None:
            raise ConfigurationError("this worker is already running")
        self._started.clear()
        self._exit.clear()
        self._stop_requested = False

        def main() -> None:
            try:
                self._exit.append(self._run(embedded=True))
            except BaseException as exc:
                self._exit.append(exc)

        thread = threading.Thread(target=main, name=f"{self._prefix}-main", daemon=True)
        self._thread = thread
        thread.start()
        while not self._started.wait(0.05):
            if not thread.is_alive():
                self._thread = None
                error = next((e for e in self._exit if isinstance(e, BaseException)), None)
                raise error or ConfigurationError("the worker stopped before it started")

    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(wait=True)

    async def __aenter__(self) -> Worker:
        """Start on the running event loop's application: coroutine handlers run on this
        loop; the worker's own threads claim, write outcomes and heartbeat."""
        self._runner.use_loop(asyncio.get_running_loop())
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # In a thread: coroutine handlers finishing within the grace need this loop free.
        await asyncio.to_thread(functools.partial(self.stop, wait=True))

    def health(self) -> WorkerHealth:
        """The worker's liveness; see :class:`WorkerHealth`."""
        now = time.monotonic()
        fetcher = self._fetcher
        age = now - fetcher.beat if fetcher is not None else 0.0
        dead = tuple(name for name, role in self._roles.items() if not role.alive())
        dead += tuple(t.name for t in self._runner.threads if not t.is_alive())
        if self._notifier is not None and not self._notifier.is_alive():
            dead += ("notifier",)
        return assess(
            now=now,
            running=self._running,
            started=fetcher is not None,
            stopping=self._stopping.is_set(),
            fetch_loop_age=age,
            stuck_after=self.stuck_after,
            dead=dead,
            held=self._state.snapshot(),
            database_ok=self._database.ok,
            listening=self._notifier is not None and self._notifier.connected,
            unreadable_jobs=self._runner.unreadable,
            overrunning=self._state.overruns(),
        )

    def is_healthy(self) -> bool:
        """Whether the worker runs and nothing in it is stuck (see :class:`WorkerHealth`)."""
        return self.health().healthy

    # -- start ----------------------------------------------------------------------------

    def _start_metrics(self) -> None:
        home = self._metrics_home
        if self.metrics_port is None and home is None:
            return
        from sqla_jobs.health import GaugeCache  # only with metrics: never for a plain worker
        from sqla_jobs.metrics import LabelValues, MetricsServer, WorkerMetrics

        metrics = WorkerMetrics(
            in_flight=lambda: len(self._state.snapshot()),
            overrunning=self._state.overruns,
            gauges=GaugeCache(
                self.engine,
                self.model,
                max_age=self.metrics_max_age,
                fair_shares=self.registry.fair_shares or None,
            ),
            # Bounded label values: the registry's tasks, the queues served or registered.
            labels=LabelValues(
                tasks=self.registry, queues=frozenset((*self.queues, *self.registry.queues))
            ),
        )
        if home is not None:  # its group serves it, with the other databases'
            home(metrics.registry)
            self._observer = self._runner.observer = self._database.observer = metrics
            return
        assert self.metrics_port is not None
        try:
            self._metrics_server = MetricsServer(
                metrics.registry, self.metrics_host, self.metrics_port
            )
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {self.metrics_host}:{self.metrics_port}: {describe(exc)}"
            ) from exc
        self._observer = self._runner.observer = self._database.observer = metrics
        host, port = self._metrics_server.address
        logger.info(
            "serving metrics on http://%s:%d/metrics",
            host,
            port,
            extra={"action": "metrics_serving", "host": host, "port": port},
        )

    def _stop_metrics(self) -> None:
        if self._metrics_home is not None and self._observer is not NO_OBSERVER:
            self._metrics_home(None)
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.close()
        self._observer = self._runner.observer = self._database.observer = NO_OBSERVER

    def _preflight(self) -> None:
        """Fail at once on a database that refuses the worker for good, or on a job table
        of an older schema version (:mod:`~sqla_jobs.worker.table_version`); wait for one
        that is down (a worker may start before its server)."""
        backoff = Backoff(initial=0.2, cap=5.0)
        while True:
            try:
                with self.engine.connect() as connection:
                    STATUS_OF.one(connection, self._table, {"job_id": 0})  # the table is there
                    driver: Any = connection.connection.driver_connection
                    if self.pooler == "auto":
                        self.pooled = behind_pooler(driver)
                    (trigger,) = WAKEUP_TRIGGER_EXISTS.rows(connection, self._table, {})
                    (layout,) = TABLE_LAYOUT.rows(connection, self._table, {})
                    steps = has_steps(self.model)
                    if steps:
                        (triggers,) = STEP_TRIGGERS.rows(connection, self._table, {})
                break
            except DBAPIError as exc:
                message = str(exc.orig or exc)
                if not is_transient(exc) or _REFUSED_FOR_GOOD.search(message):
                    raise ConfigurationError(
                        f"the worker cannot use {self.model.__name__}'s table "
                        f"{self._table.name!r}: {describe(exc)}"
                    ) from exc
                delay = backoff.next_delay()
                logger.warning(
                    "cannot reach the database (%s); retrying in %.1fs",
                    describe(exc),
                    delay,
                    extra={"action": "database_error", "operation": "start", "delay": delay},
                )
                if self._stop_requested:
                    raise
                time.sleep(delay)
        # A table of an older schema version: refuse, naming the helpers that upgrade it.
        check_table_version(self._table, layout.columns, layout.indexes, pauses=layout.pauses)
        check_flow_control(
            self.model.__name__, self._table, self.registry, layout.indexes, rates=layout.rates
        )
        if steps:
            check_steps(self.model, self._table, layout.columns, triggers.names)
        if self.pooled:
            self._log_pooled(getattr(driver, "prepare_threshold", None))
        if self.listen and not trigger.exists:
            logger.warning(
                "table %s has no wake-up trigger: new jobs wait up to the poll interval "
                "(%.1fs) instead of starting at once; add it with the migration helper "
                "sqla_jobs.migrations.create_notify_trigger (docs/how-to/migrations.md)",
                self._table.name,
                self.poll_interval,
                extra={"action": "wakeup_trigger_missing", "table": self._table.name},
            )

    def _log_pooled(self, prepare_threshold: int | None) -> None:
        listens = self.listen and self.listen_engine is not None
        if listens:
            wakeups = "LISTEN goes to the listen engine's own connection"
        else:
            wakeups = f"no LISTEN: new jobs are found by polling every {self.poll_interval:g}s"
            if self.listen:
                wakeups += " (a direct listen engine, --listen-url, would LISTEN)"
        logger.info(
            "the engine goes through a connection pooler: lock_timeout is set in each "
            "transaction; %s",
            wakeups,
            extra={"action": "behind_pooler", "pooler": self.pooler, "listen": listens},
        )
        if prepare_threshold is not None:
            logger.warning(
                "the engine goes through a pooler but psycopg prepares statements "
                "(prepare_threshold=%d), which PgBouncer in transaction mode cannot route "
                "before 1.21: create the engine with connect_args={'prepare_threshold': None}",
                prepare_threshold,
                extra={"action": "prepared_behind_pooler"},
            )

    def _start(self) -> None:
        state = self._state
        self._runner.pooled = self.pooled
        self._fetcher = self._make_fetcher()
        writer_failed, writer_ok = self._database.role("outcomes")
        writer = OutcomeWriter(
            state,
            self.registry,
            self._link(),
            finished=self._finished,
            on_database_error=writer_failed,
            on_database_ok=writer_ok,
            observer=self._observer,
        )
        leases = [t.lease.total_seconds() for t in self.registry.tasks_in(self.queues)]
        beat_failed, beat_ok = self._database.role("heartbeat")
        heartbeat = Heartbeat(
            state,
            self._link(),
            every=max(0.05, min(leases or [self.registry.default_lease.total_seconds()]) / 3),
            finished=self._finished,
            on_database_error=beat_failed,
            on_database_ok=beat_ok,
            on_cancel_requested=self._runner.request_cancel,
        )
        self._heartbeat = heartbeat
        self._roles = {
            "fetch": Role("fetch", self._prefix, self._fetcher.loop),
            "outcomes": Role("outcomes", self._prefix, writer.loop),
            "heartbeat": Role("heartbeat", self._prefix, heartbeat.loop),
            "vacuum": Role("vacuum", self._prefix, self._vacuum_loop),
        }
        if self.scheduler:
            schedule_failed, schedule_ok = self._database.role("schedule")
            scheduler = Scheduler(
                self.registry,
                self._schedule_sessions,
                stopping=self._stopping,
                on_database_error=schedule_failed,
                on_database_ok=schedule_ok,
            )
            self._roles["schedule"] = Role("schedule", self._prefix, scheduler.loop)
        if tables_of(self.model).history is not None:  # its history keeper
            history_failed, history_ok = self._database.role("history")
            self.history_keeper = HistoryKeeper(
                self.engine,
                self.model,
                result_model=self.registry.result_model,
                retention=self.history_retention,
                every=self.history_every,
                finished=self._finished,
                stopping=self._stopping,
                on_database_error=history_failed,
                on_database_ok=history_ok,
                partitions=self.history_partitions,
            )
            self._roles["history"] = Role("history", self._prefix, self.history_keeper.loop)
        self._runner.start(self.concurrency)
        for role in self._roles.values():
            role.start()
        if self.listen and (self.listen_engine is not None or not self.pooled):
            self._start_notifier()
        logger.info(
            "worker %s started: queues %s, concurrency %d",
            self.name,
            ",".join(self.queues),
            self.concurrency,
            extra={
                "action": "worker_started",
                "worker": self.name,
                "queues": self.queues,
                "concurrency": self.concurrency,
                "model": self.model.__name__,
            },
        )
        idle = [q for q in self.queues if not self.registry.tasks_in([q])]
        if idle:
            logger.warning(
                "no task of the registry uses queue %s: its jobs run only if their task is "
                "registered under another queue, and are made dead as unknown otherwise",
                ",".join(idle),
                extra={"action": "queue_without_tasks", "queues": idle},
            )

    def _make_fetcher(self) -> Fetcher:
        failed, ok = self._database.role("claim")
        return Fetcher(
            self._state,
            self._runner,
            self.registry,
            self._link(),
            model=self.model,
            queues=self.queues,
            batch_size=self.batch_size,
            poll_interval=self.poll_interval,
            worker_name=self.name,
            stopping=self._stopping,
            on_database_error=failed,
            on_database_ok=ok,
            observer=self._observer,
            prefetch=self.prefetch,
        )

    def _vacuum_loop(self) -> None:
        """Vacuum the job table when enough dead rows piled up; see the module docstring.
        Never in the fetch loop: a VACUUM takes seconds on a big table."""
        fetcher = self._fetcher
        assert fetcher is not None
        failed, ok = self._database.role("vacuum")
        while not self._finished.is_set():
            if not fetcher.vacuum_due.wait(0.5):
                continue
            fetcher.vacuum_due.clear()
            if self._stopping.is_set():
                continue
            try:
                vacuum(self.engine, self.model)
            except Exception as exc:
                failed("vacuum", exc)
            else:
                ok()

    def _link(self) -> Link:
        return Link(
            self.engine,
            lock_timeout=self.lock_timeout,
            synchronous_commit=self.synchronous_commit,
            pooled=self.pooled,
            observer=self._observer,
        )

    def _start_notifier(self) -> None:
        self._notifier = Notifier(
            self.listen_engine or self.engine,
            self._table,
            on_notify=self._on_notify,
            on_connect=self._state.wake,
            name=f"{self._prefix}-notifier",
        )
        self._notifier.start()

    def _on_notify(self, payload: str) -> None:
        if payload in self.queues:
            self._state.wake()
        elif payload.startswith(statements.CANCEL_PAYLOAD_PREFIX):  # cancel() of a running job
            # Only a hint: the heartbeat reads the job's row and stops the handler only if
            # its cancel was requested there (any role may NOTIFY, from any schema).
            job_id, _, attempt = payload[len(statements.CANCEL_PAYLOAD_PREFIX) :].partition(":")
            heartbeat = self._heartbeat
            if _decimal(job_id) and _decimal(attempt) and heartbeat is not None:
                heartbeat.hint((int(job_id), int(attempt)))

    # -- supervise --------------------------------------------------------------------------

    def _supervise(self) -> None:
        if not self._stopping.is_set():  # threads end on purpose once stopping
            for role in self._roles.values():
                if not role.alive():
                    logger.error(
                        "worker thread %s is dead; restarting it",
                        role.name,
                        extra={"action": "thread_crashed", "thread_name": role.name},
                    )
                    role.start()
            if self._notifier is not None and not self._notifier.is_alive():
                logger.error(
                    "the notifier thread is dead; restarting it",
                    extra={"action": "thread_crashed", "thread_name": "notifier"},
                )
                self._start_notifier()
        report = self.health()
        now = time.monotonic()
        if (
            not report.healthy
            and not self._stopping.is_set()
            and now - self._last_stuck_log >= _STUCK_LOG_EVERY
        ):
            self._last_stuck_log = now
            stuck = report.fetch_loop_age >= self.stuck_after
            logger.error(
                "the worker is unhealthy: %s",
                "; ".join(report.problems),
                extra={
                    "action": "fetch_loop_stuck" if stuck else "worker_unhealthy",
                    "seconds": round(report.fetch_loop_age, 1),
                    "problems": list(report.problems),
                },
            )

    def _write_health_file(self) -> None:
        if self.health_file is None or not self.is_healthy():
            return
        try:
            self.health_file.write_text(f"{time.time():.3f}\n")
        except OSError as exc:
            logger.warning(
                "cannot write the health file %s: %s",
                self.health_file,
                describe(exc),
                extra={"action": "health_file_error", "error": describe(exc)},
            )

    # -- signals ------------------------------------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        # The first SIGTERM or SIGINT (StopSignals: a second exits at once): flags only.
        self._stop_signal = signum
        self._stop_requested = True

    # -- shutdown -------------------------------------------------------------------------------

    def _shutdown(self) -> int:
        """Stop claiming; give running jobs ``grace`` seconds; give back the rest (ending
        this worker's own lock-mode transactions first, so their row locks go); let the
        outcome writer write what is left; stop."""
        in_flight = len(self._state.snapshot())
        logger.info(
            "stopping: no more claims; waiting up to %.0fs for %d running jobs",
            self.grace,
            in_flight,
            extra={
                "action": "worker_stopping",
                "signal": self._stop_signal,
                "grace": self.grace,
                "in_flight": in_flight,
            },
        )
        self._stopping.set()
        self._state.wake()
        fetch = self._roles["fetch"]
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and (fetch.alive() or self._state.snapshot()):
            time.sleep(0.02)
        released = self._state.abandon("the worker stopped before the job finished")
        self._end_lock_transactions(released)
        # The fetch loop's claim is bounded by lock_timeout; jobs it returns now are given
        # back by the fetch loop itself (admission is closed).
        fetch.join(self.lock_timeout + 1.0)
        drain_until = time.monotonic() + _DRAIN_TIMEOUT
        while self._state.snapshot() and time.monotonic() < drain_until:
            time.sleep(0.02)
        self._finished.set()
        if self._heartbeat is not None:
            self._heartbeat.wake()
        for name in ("outcomes", "heartbeat", "vacuum", "schedule", "history"):
            if name in self._roles:
                self._roles[name].join(_DRAIN_TIMEOUT)
        self._runner.close(0.5)  # handlers still running are daemon threads
        if self._notifier is not None:
            self._notifier.stop()
        unwritten = self._state.snapshot()
        if unwritten:
            logger.error(
                "%d outcomes could not be written before exit; those jobs run again when "
                "their leases end",
                len(unwritten),
                extra={"action": "outcomes_unwritten", "job_ids": [a.job.id for a in unwritten]},
            )
        logger.info(
            "worker %s stopped; %d unfinished jobs given back",
            self.name,
            len(released),
            extra={"action": "worker_stopped", "worker": self.name, "released": len(released)},
        )
        return 0

    def _end_lock_transactions(self, attempts: list[Attempt]) -> None:
        """End this worker's own open lock-mode transactions of these attempts, so that
        their row locks go and the releases do not wait for handlers that will not finish."""
        backends = [a.backend for a in attempts if a.backend is not None]
        for attempt in attempts:
            if attempt.future is not None:
                attempt.future.cancel()
        if not backends:
            return
        params: TerminateParams = {
            "pids": ",".join(str(pid) for pid, _ in backends),
            "xact_starts": ",".join(repr(float(start)) for _, start in backends),
        }
        try:
            with self.engine.connect() as connection:
                TERMINATE_TRANSACTIONS.rows(connection, None, params)
                connection.commit()
        except Exception as exc:
            logger.warning(
                "could not end %d lock-mode transactions (%s); their jobs come back when "
                "the transactions end",
                len(backends),
                describe(exc),
                extra={"action": "database_error", "operation": "shutdown"},
            )


def _decimal(text: str) -> bool:
    # ASCII only: "²".isdigit() is true, but int("²") raises (on the notifier's thread).
    return text.isascii() and text.isdigit()
