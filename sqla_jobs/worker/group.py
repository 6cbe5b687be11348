"""Several workers in one process: one per database, for jobs spread over several primaries.

A job lives in the database of its business rows (a shard chosen by the application's own
key, with SQLAlchemy's ``horizontal_shard`` extension or ``Session`` binds: docs,
how-to/several-databases). Each database needs a worker; :class:`WorkerGroup` runs one
:class:`~sqla_jobs.worker.Worker` per database in one process and stops them together.

Each member is a whole worker of its own: its engine and connections, its handler slots
(``concurrency``), its claims, heartbeats and outcome writer. So the databases are served
fairly by construction: a busy database cannot take another's slots, and a database that is
down (its member waits for it, as any worker waits for a server that is down or restarting)
holds up none of the others.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from sqlalchemy.exc import DBAPIError

from sqla_jobs.errors import ConfigurationError
from sqla_jobs.urls import server_label
from sqla_jobs.worker.lifecycle import Worker, freeze_startup_heap
from sqla_jobs.worker.settings import ObservabilitySettings
from sqla_jobs.worker.signals import StopSignals

if TYPE_CHECKING:
    from sqla_jobs.metrics import MetricsServer

__all__ = ["WorkerGroup"]

_SUPERVISE_EVERY = 0.1


class WorkerGroup:
    """Run ``workers`` (one per database) in this process until stopped.

    :meth:`run` owns the process, as :meth:`Worker.run` does: the first SIGTERM or SIGINT stops
    every member gracefully (each gives its running jobs its ``grace``), a second one exits at
    once. ``with group:`` (or :meth:`start` / :meth:`stop`) runs them in background threads
    instead, with no signal handler. A member that the database refuses for good (no such
    table, a wrong password: :class:`~sqla_jobs.ConfigurationError`) stops the group, which
    then raises that error; a member whose database is down waits for it, the others run.

    Members must be distinct :class:`Worker` objects on distinct engines (two workers on one
    database in one process would only split its slots; raise its ``concurrency`` instead).

    With a ``metrics_port``, the group serves its members' Prometheus metrics there while it
    runs (:attr:`metrics_address` says where; the ``metrics`` extra): each metric once, each
    sample labelled with its ``database`` (:func:`sqla_jobs.urls.server_label`: the URL's
    host, port and database, never its user or password). Members then have no
    ``metrics_port`` of their own.
    """

    def __init__(
        self,
        workers: Iterable[Worker],
        *,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        members = list(workers)
        if not members:
            raise ConfigurationError("a WorkerGroup needs at least one Worker")
        for member in members:
            if not isinstance(member, Worker):
                raise ConfigurationError(f"expected a sqla_jobs Worker, not {member!r}")
        engines = [member.engine for member in members]
        if metrics_port is not None:
            ObservabilitySettings(metrics_port=metrics_port, metrics_host=metrics_host)  # checks
            own = [m.name for m in members if m.metrics_port is not None]
            if own:
                raise ConfigurationError(
                    "a WorkerGroup with a metrics_port serves its members' metrics: its "
                    f"workers have none of their own (these do: {', '.join(own)})"
                )
        # Two workers on one database in one process would only split its slots.
        labels = [server_label(engine.url) for engine in engines]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ConfigurationError(
                "each Worker of a WorkerGroup serves a database of its own: "
                f"{', '.join(twice)} is given twice"
            )
        #: The members, in the order given.
        self.workers: tuple[Worker, ...] = tuple(members)
        #: Each member's ``database`` label (its metrics', its log lines').
        self.labels: tuple[str, ...] = tuple(labels)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self._metrics_server: MetricsServer | None = None
        self._threads: list[threading.Thread] = []
        self._outcomes: dict[int, int | BaseException] = {}
        self._stop = threading.Event()

    # -- running ---------------------------------------------------------------------------

    def run(self) -> int:
        """Run every member until a signal or :meth:`stop`; return the exit status (0 after a
        graceful stop). Raises the first :class:`~sqla_jobs.ConfigurationError` a member
        raised (the others are stopped first). Like :meth:`Worker.run
        <sqla_jobs.Worker.run>`, it owns the process: once the members are started, the
        objects made so far leave the garbage collector's full collections
        (``gc.freeze()``)."""
        signals = StopSignals(lambda _signum: self._stop.set())
        signals.install("worker group", "group.stop()")
        try:
            self._start_members()
            freeze_startup_heap()
            self._supervise()
            return self._finish()
        finally:
            signals.restore()

    def start(self) -> None:
        """Start every member in background threads of this process and return at once
        (a member whose database is down starts when it answers)."""
        if self._threads:
            raise ConfigurationError("this WorkerGroup is already running")
        self._start_members()
        self._supervisor = threading.Thread(
            target=self._supervise, name="sqla-jobs-group", daemon=True
        )
        self._supervisor.start()

    def stop(self, *, graceful: bool = True, wait: bool = False) -> None:
        """Stop every member (as :meth:`Worker.stop`); with ``wait``, return once all have
        stopped, raising the first error one of them ended with."""
        for member in self.workers:
            member.stop(graceful=graceful)
        self._stop.set()
        if wait:
            self._finish()

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(wait=True)

    # -- inside ------------------------------------------------------------------------------

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the members' metrics are served on while the group runs."""
        server = self._metrics_server
        return None if server is None else server.address

    def _start_members(self) -> None:
        self._start_metrics()
        self._stop.clear()
        self._outcomes.clear()
        self._threads = []
        for index, member in enumerate(self.workers):
            thread = threading.Thread(
                target=self._run_member,
                args=(index, member),
                name=f"sqla-jobs-group-{index}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()

    def _run_member(self, index: int, member: Worker) -> None:
        try:
            self._outcomes[index] = member._run(embedded=True)
        except BaseException as exc:
            self._outcomes[index] = exc

    def _supervise(self) -> None:
        """Wait for a stop; a member that ended on its own with an error stops the rest."""
        while not self._stop.is_set():
            failed = [o for o in self._outcomes.values() if isinstance(o, BaseException)]
            if failed or not any(thread.is_alive() for thread in self._threads):
                break
            time.sleep(_SUPERVISE_EVERY)
        self._stop.set()
        for member in self.workers:
            member.stop()

    def _start_metrics(self) -> None:
        if self.metrics_port is None:
            return
        from prometheus_client import CollectorRegistry  # only with metrics (its extra)

        from sqla_jobs.metrics import DatabasesCollector, MetricsServer

        collector = DatabasesCollector()
        registry = CollectorRegistry()
        registry.register(collector)
        try:
            self._metrics_server = MetricsServer(registry, self.metrics_host, self.metrics_port)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {self.metrics_host}:{self.metrics_port}: {exc}"
            ) from exc
        for member, label in zip(self.workers, self.labels, strict=True):
            member._metrics_home = functools.partial(collector.put, label)

    def _finish(self) -> int:
        for thread in self._threads:
            thread.join()
        self._threads = []
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.close()
        errors: list[BaseException] = []
        status = 0
        for outcome in self._outcomes.values():
            if isinstance(outcome, DBAPIError) and self._stop.is_set():
                continue  # stopped while its database was still down: nothing ran
            if isinstance(outcome, BaseException):
                errors.append(outcome)
            else:
                status = max(status, outcome)
        configuration = [e for e in errors if isinstance(e, ConfigurationError)]
        if configuration or errors:
            raise (configuration or errors)[0]
        return status
