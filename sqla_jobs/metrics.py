"""Prometheus metrics of a worker: ``Worker(..., metrics_port=9100)`` or ``sqla-jobs worker
--metrics-port 9100``. Needs the ``metrics`` extra (``pip install 'sqla-jobs[metrics]'``,
which installs ``prometheus_client``); nothing else in sqla_jobs imports this module.

:class:`WorkerMetrics` is the worker's :class:`~sqla_jobs.observer.Observer`: counters
and histograms updated as events happen, in the worker's own threads. The health gauges of
:mod:`sqla_jobs.health` are read when Prometheus scrapes, through a
:class:`~sqla_jobs.health.GaugeCache` (at most one read per ``max_age`` seconds, and a scrape
never waits more than its ``timeout`` for the database). The metric names are listed in
docs/operations/metrics.md.

Label values are bounded by the code, never by the data (:class:`LabelValues`): a task label
is a task of the worker's registry, a queue label a queue the worker serves or its registry
names, and every other name a row carries (a job of a task no handler knows, the gauges of a
queue of another application sharing the table) is counted under :data:`OTHER`. The one label
whose values come from the rows, a fairly shared queue's ``tenant``, is bounded by count: the
:data:`TOP_TENANTS` deepest tenants of each such queue, and no other.

For a job model with workflow steps (:class:`~sqla_jobs.schema.workflows.StepMixin`) the
collector also reads the workflows by status and the waiting steps by queue
(:data:`~sqla_jobs._queries.dashboard.WORKFLOW_GAUGES`: a scan of the workflow table), under
the same cache rules; a model without steps reads and exports nothing of the kind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, Table

from sqla_jobs._queries.dashboard import WORKFLOW_GAUGES
from sqla_jobs.health import CachedRead, GaugeCache, QueueGauges
from sqla_jobs.observer import Finish, Observer
from sqla_jobs.queue import ClaimedJob
from sqla_jobs.queue.rating import DEFAULT_TOP_TENANTS, NO_TENANT, tenant_text
from sqla_jobs.schema import JobStatus, has_steps
from sqla_jobs.schema.workflows import WorkflowStatus, check_step_model

__all__ = [
    "OTHER",
    "TOP_TENANTS",
    "DatabasesCollector",
    "GaugeCollector",
    "LabelValues",
    "MetricsServer",
    "WorkerMetrics",
]

_JOB: Final = ("queue", "task")
#: The label value of every task and queue name that :class:`LabelValues` does not know.
#: Parentheses are not allowed in a task or queue name (``validation.NAME_RULE``), so it
#: never collides with one.
OTHER: Final = "(other)"
#: The deepest tenants of each fairly shared queue that ``sqla_jobs_queue_tenant_pending``
#: has a series for (the ``tenant`` label's values come from the rows: this bounds their
#: number). The gauges read as many (:data:`~sqla_jobs.queue.rating.DEFAULT_TOP_TENANTS`).
TOP_TENANTS: Final = DEFAULT_TOP_TENANTS
#: Handler durations: from 5 ms to 10 minutes.
HANDLER_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
)  # fmt: skip
#: Claim round trips: from 1 ms to 10 s.
CLAIM_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class LabelValues:
    """The one home of the rule that keeps the metrics' cardinality bounded: the label
    value of a task or queue name is the name itself when it is in ``tasks`` (a
    :class:`~sqla_jobs.Registry` will do: its task names) or ``queues``, and :data:`OTHER`
    for any other. Each time series costs the scraper memory for as long as it exists, and
    the names come from rows anyone with INSERT on the table can write; so a worker's
    series are at most a few per registered task and queue (and one ``OTHER`` each),
    whatever lands in its queues. The default knows no name: everything is ``OTHER``."""

    def __init__(self, *, tasks: Container[str] = (), queues: Container[str] = ()) -> None:
        self.tasks = tasks
        self.queues = queues

    def task(self, name: str) -> str:
        return name if name in self.tasks else OTHER

    def queue(self, name: str) -> str:
        return name if name in self.queues else OTHER


class WorkerMetrics(Observer):
    """The worker's events as Prometheus metrics in ``registry`` (a new one by default);
    ``in_flight`` gives the attempts the worker holds, ``overrunning`` the handlers still
    running past their time limits (``(job id, seconds past the limit)`` each), ``gauges``
    the health gauges, ``labels`` the task and queue names that get label values of their
    own (see :class:`LabelValues`; the others are counted as :data:`OTHER`)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        in_flight: Callable[[], int] | None = None,
        overrunning: Callable[[], Sequence[tuple[int, float]]] | None = None,
        gauges: GaugeCache | None = None,
        labels: LabelValues | None = None,
    ) -> None:
        self.registry = registry = registry if registry is not None else CollectorRegistry()
        self.labels = labels = labels if labels is not None else LabelValues()

        def counter(name: str, text: str, labels: Sequence[str] = _JOB) -> Counter:
            return Counter(name, text, labels, registry=registry)

        self._started = counter("sqla_jobs_jobs_started", "Attempts whose handler started.")
        self._outcomes: dict[Finish, Counter] = {
            "succeeded": counter("sqla_jobs_jobs_succeeded", "Attempts that succeeded."),
            "failed": counter(
                "sqla_jobs_jobs_failed",
                "Attempts that failed (the job retries later, or is dead: see jobs_dead).",
            ),
            "dead": counter("sqla_jobs_jobs_dead", "Failed attempts that made their job dead."),
            "cancelled": counter(
                "sqla_jobs_jobs_cancelled", "Attempts that ended cancelled (sqla_jobs.cancel)."
            ),
            "released": counter(
                "sqla_jobs_jobs_released", "Attempts given back unfinished (shutdown, ...)."
            ),
            "lost": counter(
                "sqla_jobs_attempts_lost", "Attempts fenced out: their lease was taken over."
            ),
            "snoozed": counter(
                "sqla_jobs_jobs_snoozed",
                "Attempts that snoozed (sqla_jobs.Snooze: run again later, no attempt spent).",
            ),
        }
        self._handler = Histogram(
            "sqla_jobs_handler_duration_seconds",
            "Time from a handler's start to its outcome.",
            _JOB,
            buckets=HANDLER_BUCKETS,
            registry=registry,
        )
        self._claim = Histogram(
            "sqla_jobs_claim_duration_seconds",
            "Round trip of a claim transaction (claim and commit).",
            buckets=CLAIM_BUCKETS,
            registry=registry,
        )
        self._claimed = counter("sqla_jobs_jobs_claimed", "Jobs claimed.", ("queue",))
        self._errors = counter(
            "sqla_jobs_database_errors", "Failed database calls of the worker.", ("operation",)
        )
        self._reconnects = Counter(
            "sqla_jobs_database_reconnects",
            "Kept connections found gone and replaced.",
            registry=registry,
        )
        if in_flight is not None:
            held = Gauge(
                "sqla_jobs_attempts_in_flight",
                "Attempts the worker holds (running, or waiting for a thread or a write).",
                registry=registry,
            )
            held.set_function(lambda: float(in_flight()))
        if overrunning is not None:
            late = Gauge(
                "sqla_jobs_handlers_overrunning",
                "Handlers still running past their time limits (their attempts failed at "
                "the limit; each keeps its slot until it returns).",
                registry=registry,
            )
            late.set_function(lambda: float(len(overrunning())))
            oldest = Gauge(
                "sqla_jobs_handler_overrun_seconds",
                "How long past its time limit the longest overrunning handler is (0: none).",
                registry=registry,
            )
            oldest.set_function(lambda: max((age for _, age in overrunning()), default=0.0))
        if gauges is not None:
            registry.register(GaugeCollector(gauges, labels))

    # -- Observer -----------------------------------------------------------------------

    def _job(self, job: ClaimedJob) -> tuple[str, str]:
        return self.labels.queue(job.queue), self.labels.task(job.task)

    def claimed(self, jobs: Sequence[ClaimedJob], seconds: float) -> None:
        self._claim.observe(seconds)
        for job in jobs:
            self._claimed.labels(self.labels.queue(job.queue)).inc()

    def started(self, job: ClaimedJob) -> None:
        self._started.labels(*self._job(job)).inc()

    def finished(self, job: ClaimedJob, how: Finish, handler_seconds: float | None) -> None:
        labels = self._job(job)
        self._outcomes[how].labels(*labels).inc()
        if how == "dead":
            self._outcomes["failed"].labels(*labels).inc()
        if handler_seconds is not None:
            self._handler.labels(*labels).observe(handler_seconds)

    def database_error(self, operation: str) -> None:
        self._errors.labels(operation).inc()

    def reconnected(self) -> None:
        self._reconnects.inc()


def fold_queues(queues: Sequence[QueueGauges], labels: LabelValues) -> list[QueueGauges]:
    """The queues' gauges by label value: a known queue's as read, the others' added up
    into one :data:`OTHER` queue (counts summed, the oldest wait the longest of theirs; a
    rate limit's and a fair share's figures only while it holds one queue)."""
    folded: dict[str, QueueGauges] = {}
    for queue in queues:
        label = labels.queue(queue.queue)
        seen = folded.get(label)
        if seen is None:
            folded[label] = QueueGauges(
                label,
                pending=queue.pending,
                runnable=queue.runnable,
                running=queue.running,
                expired_leases=queue.expired_leases,
                dead=queue.dead,
                oldest_runnable_seconds=queue.oldest_runnable_seconds,
                paused=queue.paused,
                paused_seconds=queue.paused_seconds,
                rate_limit=queue.rate_limit,
                rate_window_seconds=queue.rate_window_seconds,
                rate_started=queue.rate_started,
                rate_full_keys=queue.rate_full_keys,
                fair_column=queue.fair_column,
                fair_tenants=queue.fair_tenants,
                fair_deepest_pending=queue.fair_deepest_pending,
                fair_deepest=queue.fair_deepest,
            )
            continue
        waits = (seen.oldest_runnable_seconds, queue.oldest_runnable_seconds)
        ages = [age for age in waits if age is not None]
        folded[label] = QueueGauges(
            label,
            pending=seen.pending + queue.pending,
            runnable=seen.runnable + queue.runnable,
            running=seen.running + queue.running,
            expired_leases=seen.expired_leases + queue.expired_leases,
            dead=seen.dead + queue.dead,
            oldest_runnable_seconds=max(ages) if ages else None,
            paused=seen.paused or queue.paused,
            rate_full_keys=seen.rate_full_keys + queue.rate_full_keys,
        )
    return list(folded.values())


@dataclass(frozen=True, slots=True)
class _WorkflowCounts:
    """The workflows of each status (every status, 0 for none), and the waiting steps of
    each queue that has some."""

    workflows: dict[str, int]
    waiting: dict[str, int]


def _read_workflows(table: Table, workflow: Table, connection: Connection) -> _WorkflowCounts:
    workflows = dict.fromkeys((status.value for status in WorkflowStatus), 0)
    waiting: dict[str, int] = {}
    for row in WORKFLOW_GAUGES.rows(connection, table, {}, workflow=workflow):
        if row.queue is None:
            workflows[row.status] = int(row.total)
        else:
            waiting[row.queue] = int(row.total)
    return _WorkflowCounts(workflows, waiting)


class GaugeCollector(Collector):
    """The health gauges (:func:`sqla_jobs.health.read_gauges`), read on scrape through
    ``cache``. ``sqla_jobs_gauges_up`` is 0 when the last read failed or timed out; the
    other values are then the last ones read (``sqla_jobs_gauges_age_seconds`` old). The
    queues ``labels`` does not know are added up under :data:`OTHER`.

    For a model with workflow steps, the workflows by status (``sqla_jobs_workflows``) and
    the waiting steps (``status="waiting"`` of ``sqla_jobs_queue_jobs``), read under the
    same rules (``cache``'s ``max_age`` and ``timeout``; both reads run at once, and a scrape
    waits for them ``timeout`` at most), and ``sqla_jobs_gauges_up`` is 0 when either read
    failed. For any other model, none of it: no read, no series."""

    def __init__(self, cache: GaugeCache, labels: LabelValues | None = None) -> None:
        self.cache = cache
        self.labels = labels if labels is not None else LabelValues()
        self._workflows: CachedRead[_WorkflowCounts] | None = None
        self._workflow_table: str | None = None
        model = cache.model
        if has_steps(model):
            workflow = check_step_model(model)
            table: Table = model.__table__  # type: ignore[attr-defined]
            self._workflow_table = workflow.fullname
            self._workflows = CachedRead(
                cache.engine,
                lambda connection: _read_workflows(table, workflow, connection),
                max_age=cache.max_age,
                timeout=cache.timeout,
                what="the workflow gauges",
            )

    def collect(self) -> Iterator[Any]:
        deadline = time.monotonic() + self.cache.timeout
        if self._workflows is not None:
            self._workflows.start()  # alongside the health gauges' read, not after it
        reading = self.cache.read()
        flows, flows_error = (None, None)
        if self._workflows is not None:
            flows, flows_error, _ = self._workflows.read(deadline)
        up = GaugeMetricFamily(
            "sqla_jobs_gauges_up", "1 if the last read of the health gauges succeeded."
        )
        failed = reading.error or reading.gauges is None
        if self._workflows is not None:
            failed = failed or flows_error is not None or flows is None
        up.add_metric([], 0.0 if failed else 1.0)
        yield up
        gauges = reading.gauges
        if gauges is None:
            return
        age = GaugeMetricFamily("sqla_jobs_gauges_age_seconds", "Age of the health gauges.")
        age.add_metric([], reading.age_seconds or 0.0)
        yield age
        table = gauges.table.table

        def family(name: str, text: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=["table", *labels])

        jobs = family("sqla_jobs_queue_jobs", "Live jobs by queue and status.", ["queue", "status"])
        runnable = family(
            "sqla_jobs_queue_runnable_jobs", "Pending jobs whose run_at has come.", ["queue"]
        )
        oldest = family(
            "sqla_jobs_queue_oldest_runnable_seconds",
            "How long the oldest runnable job has waited past its run_at (0: none).",
            ["queue"],
        )
        expired = family(
            "sqla_jobs_queue_expired_leases", "Running jobs whose lease ran out.", ["queue"]
        )
        paused = family(
            "sqla_jobs_queue_paused",
            "1 while the queue is paused (sqla_jobs.pause_queue), else 0; for the other "
            "queues' label, how many of them are paused.",
            ["queue"],
        )
        rate_started = family(
            "sqla_jobs_queue_rate_started",
            "Attempts the queue's rate-limit window holds now (RateLimit; only rate-limited "
            "queues with a queue-wide limit).",
            ["queue"],
        )
        rate_limit = family(
            "sqla_jobs_queue_rate_limit",
            "The queue's rate limit: starts per window (only rate-limited queues).",
            ["queue"],
        )
        rate_full = family(
            "sqla_jobs_queue_rate_full_keys",
            "Ordering keys of the queue whose rate-limit windows are full: their jobs are "
            "held back (a RateLimit per key).",
            ["queue"],
        )
        tenants = family(
            "sqla_jobs_queue_tenants",
            "Tenants with pending jobs (without an ordering key) in a fairly shared queue "
            "(FairShare; only those queues).",
            ["queue"],
        )
        tenant_pending = family(
            "sqla_jobs_queue_tenant_pending",
            f"Pending jobs (without an ordering key) of each of the {TOP_TENANTS} deepest "
            "tenants of a fairly shared queue: only those tenants, so the series are at "
            f'most {TOP_TENANTS} per queue (tenant="{NO_TENANT}": the jobs without one).',
            ["queue", "tenant"],
        )
        paused_count: dict[str, int] = {}
        seen: set[str] = set()  # the queue labels of sqla_jobs_queue_jobs
        for queue in gauges.queues:
            label = self.labels.queue(queue.queue)
            paused_count[label] = paused_count.get(label, 0) + queue.paused
        for queue in fold_queues(gauges.queues, self.labels):
            for status, count in (
                ("pending", queue.pending),
                ("running", queue.running),
                ("dead", queue.dead),
            ):
                jobs.add_metric([table, queue.queue, status], float(count))
            seen.add(queue.queue)
            runnable.add_metric([table, queue.queue], float(queue.runnable))
            oldest.add_metric([table, queue.queue], queue.oldest_runnable_seconds or 0.0)
            expired.add_metric([table, queue.queue], float(queue.expired_leases))
            paused.add_metric([table, queue.queue], float(paused_count.get(queue.queue, 0)))
            if queue.rate_limit is not None:
                rate_limit.add_metric([table, queue.queue], float(queue.rate_limit))
                rate_full.add_metric([table, queue.queue], float(queue.rate_full_keys))
                if queue.rate_started is not None:
                    rate_started.add_metric([table, queue.queue], float(queue.rate_started))
            if queue.fair_tenants is not None:
                tenants.add_metric([table, queue.queue], float(queue.fair_tenants))
                shown: set[str] = set()
                for tenant, count in queue.fair_deepest[:TOP_TENANTS]:
                    label = tenant_text(tenant)
                    if label not in shown:  # two long values cut to the same text: the deeper
                        shown.add(label)
                        tenant_pending.add_metric([table, queue.queue, label], float(count))
        if flows is not None:
            # A model with steps: the waiting steps by queue, for every queue shown (0 for
            # none) and every queue with some; a model without steps has no such series.
            waiting: dict[str, int] = dict.fromkeys(seen, 0)
            for name, count in flows.waiting.items():
                label = self.labels.queue(name)
                waiting[label] = waiting.get(label, 0) + count
            for label in sorted(waiting):
                jobs.add_metric([table, label, JobStatus.WAITING.value], float(waiting[label]))
            workflows = family(
                "sqla_jobs_workflows",
                "Workflows by status, in the workflow table (the finished ones until pruned).",
                ["status"],
            )
            for status, count in flows.workflows.items():
                workflows.add_metric([self._workflow_table or "", status], float(count))
            yield workflows
        yield from (jobs, runnable, oldest, expired, paused, rate_started, rate_limit, rate_full)
        yield from (tenants, tenant_pending)
        stats = gauges.table
        for name, text, value in (
            ("sqla_jobs_table_live_tuples", "Live rows of the job table.", stats.live_tuples),
            (
                "sqla_jobs_table_dead_tuples",
                "Dead row versions of the job table.",
                stats.dead_tuples,
            ),
            ("sqla_jobs_table_bytes", "Size of the job table (heap and TOAST).", stats.table_bytes),
            (
                "sqla_jobs_table_vacuum_age_seconds",
                "Time since the job table was last vacuumed.",
                stats.vacuum_age_seconds,
            ),
        ):
            if value is not None:
                metric = family(name, text)
                metric.add_metric([table], float(value))
                yield metric
        indexes = family("sqla_jobs_index_bytes", "Size of the claim and dead indexes.", ["index"])
        for index, size in (
            ("pending", stats.pending_index_bytes),
            ("running", stats.running_index_bytes),
            ("dead", stats.dead_index_bytes),
        ):
            if size is not None:
                indexes.add_metric([table, index], float(size))
        yield indexes
        xmin = gauges.oldest_xmin
        held = GaugeMetricFamily(
            "sqla_jobs_oldest_xmin_seconds",
            "How long the oldest snapshot on the server has held back vacuum (0: none).",
        )
        held.add_metric([], (xmin.age_seconds if xmin else None) or 0.0)
        yield held
        by_xids = gauges.oldest_xmin_by_xids
        xids = GaugeMetricFamily(
            "sqla_jobs_oldest_xmin_xids", "Age in transaction ids of the oldest xmin held."
        )
        xids.add_metric([], float((by_xids.age_xids if by_xids else None) or 0))
        yield xids


class DatabasesCollector(Collector):
    """The metrics of several workers of one process, one database each (a
    :class:`~sqla_jobs.WorkerGroup`), as one set: each metric once, every sample labelled
    with its worker's ``database``. Workers come (:meth:`put` their registry) and go
    (``put(database, None)``) while it serves."""

    def __init__(self) -> None:
        self._registries: dict[str, CollectorRegistry] = {}
        self._lock = threading.Lock()

    def put(self, database: str, registry: CollectorRegistry | None) -> None:
        with self._lock:
            if registry is None:
                self._registries.pop(database, None)
            else:
                self._registries[database] = registry

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            registries = list(self._registries.items())
        merged: dict[str, Metric] = {}
        for database, registry in registries:
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                into.samples += [
                    sample._replace(labels={"database": database, **sample.labels})
                    for sample in family.samples
                ]
        yield from merged.values()


class MetricsServer:
    """``registry`` served over HTTP on ``host``:``port`` (0: any free port) in a daemon
    thread, until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.address: tuple[str, int] = (host, int(self._server.server_address[1]))
        self._closed = threading.Lock()

    def close(self) -> None:
        if self._closed.acquire(blocking=False):
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
