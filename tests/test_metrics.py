"""The worker's Prometheus endpoint, scraped over HTTP from a real worker running real jobs.

``Worker(..., metrics_port=0)`` serves on a free port in a thread of this process; the test
reads the counters, histograms and health gauges back from the text the endpoint serves.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool
from worker_harness import JobDatabase, wait_until
from worker_tasks import FAST_RETRY, WorkerJob

from sqla_jobs import ConfigurationError, JobContext, Registry, Worker, cli
from sqla_jobs.metrics import OTHER

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def engine(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    database = JobDatabase(fresh_database("sqla_jobs_metrics"))
    engine = sa.create_engine(database.url, pool_size=10)
    try:
        yield engine
    finally:
        engine.dispose()
        database.dispose()


def exposition(worker: Worker) -> str:
    address = worker.metrics_address
    assert address is not None
    host, port = address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as response:
        return str(response.read().decode())


def scrape(worker: Worker) -> Samples:
    return scrape_text(exposition(worker))


def scrape_text(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def enqueue(engine: sa.Engine, registry: Registry, task: str, count: int = 1) -> None:
    with Session(engine) as session, session.begin():
        session.add_all([registry[task].job({}) for _ in range(count)])


def test_a_scrape_counts_what_the_worker_did(engine: sa.Engine) -> None:
    registry = Registry(WorkerJob)
    q = "metered"

    @registry.task(queue=q)
    def ok(ctx: JobContext) -> None:
        pass

    @registry.task(queue=q, max_attempts=1)
    def boom(ctx: JobContext) -> None:
        raise RuntimeError("boom")

    @registry.task(queue=q, max_attempts=3, retry=FAST_RETRY)
    def flaky(ctx: JobContext) -> None:
        if ctx.job.attempt == 1:
            raise RuntimeError("first time")

    worker = Worker(registry, engine, poll_interval=0.1, name="metered", metrics_port=0)
    with worker:
        enqueue(engine, registry, "ok", 3)
        enqueue(engine, registry, "boom")
        enqueue(engine, registry, "flaky")

        def settled() -> Samples | None:
            samples = scrape(worker)
            done = {
                task: value(samples, "sqla_jobs_jobs_succeeded_total", queue=q, task=task)
                for task in ("ok", "flaky")
            }
            dead = value(samples, "sqla_jobs_jobs_dead_total", queue=q, task="boom")
            return samples if done == {"ok": 3, "flaky": 1} and dead == 1 else None

        samples = wait_until(settled, timeout=60, message="every job's outcome is counted")
    assert worker.metrics_address is None  # the server stopped with the worker

    def job(name: str, task: str) -> float:
        return value(samples, name, queue=q, task=task)

    assert [job("sqla_jobs_jobs_started_total", t) for t in ("ok", "boom", "flaky")] == [3, 1, 2]
    assert [job("sqla_jobs_jobs_failed_total", t) for t in ("ok", "boom", "flaky")] == [0, 1, 1]
    assert job("sqla_jobs_jobs_dead_total", "flaky") == 0
    assert job("sqla_jobs_handler_duration_seconds_count", "ok") == 3
    assert job("sqla_jobs_handler_duration_seconds_count", "flaky") == 2
    assert value(samples, "sqla_jobs_jobs_claimed_total", queue=q) == 6
    assert value(samples, "sqla_jobs_claim_duration_seconds_count") >= 1
    assert ("sqla_jobs_attempts_in_flight", ()) in samples
    assert value(samples, "sqla_jobs_database_errors_total", operation="claim") == 0
    # The health gauges, read on scrape (possibly a few seconds old: max_age).
    assert value(samples, "sqla_jobs_gauges_up") == 1
    table = WorkerJob.__tablename__
    assert ("sqla_jobs_table_bytes", (("table", table),)) in samples
    assert ("sqla_jobs_index_bytes", (("index", "dead"), ("table", table))) in samples
    assert ("sqla_jobs_oldest_xmin_seconds", ()) in samples


def test_gauges_on_scrape_follow_the_table(engine: sa.Engine) -> None:
    registry = Registry(WorkerJob)

    @registry.task(queue="served")
    def never(ctx: JobContext) -> None:  # pragma: no cover - its queue is not served
        pass

    @registry.task(queue="idle")
    def idle(ctx: JobContext) -> None:  # pragma: no cover
        pass

    worker = Worker(
        registry, engine, queues=["idle"], poll_interval=0.1, metrics_port=0, metrics_max_age=0.1
    )
    with worker:
        enqueue(engine, registry, "never", 2)

        def counted() -> Samples | None:
            samples = scrape(worker)
            labels = {"queue": "served", "table": WorkerJob.__tablename__}
            pending = value(samples, "sqla_jobs_queue_jobs", status="pending", **labels)
            return samples if pending == 2 else None

        samples = wait_until(counted, timeout=30, message="the gauges show the pending jobs")
    labels = {"queue": "served", "table": WorkerJob.__tablename__}
    assert value(samples, "sqla_jobs_queue_runnable_jobs", **labels) == 2
    assert value(samples, "sqla_jobs_queue_oldest_runnable_seconds", **labels) >= 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"metrics_port": -1}, "metrics_port must be an integer in [0, 65535]"),
        ({"metrics_port": 65536}, "metrics_port must be an integer in [0, 65535]"),
        ({"metrics_port": True}, "metrics_port must be an integer"),
        ({"metrics_port": "9100"}, "metrics_port must be an integer"),
        ({"metrics_port": 0, "metrics_host": ""}, "metrics_host must be"),
        ({"metrics_port": 0, "metrics_max_age": 0}, "metrics_max_age must be in"),
    ],
)
def test_bad_metrics_settings_are_refused_before_any_sql(
    options: dict[str, Any], message: str
) -> None:
    registry = Registry(WorkerJob)
    registry.task(name="noop", queue="q")(lambda ctx: None)  # pragma: no cover
    # An engine that cannot connect: the error must come first.
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(ConfigurationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Worker(registry, engine, **options)


def test_a_port_in_use_stops_the_worker_from_starting(engine: sa.Engine) -> None:
    registry = Registry(WorkerJob)

    @registry.task(queue="q")
    def noop(ctx: JobContext) -> None:  # pragma: no cover
        pass

    with Worker(registry, engine, poll_interval=0.1, metrics_port=0) as first:
        address = first.metrics_address
        assert address is not None
        second = Worker(registry, engine, poll_interval=0.1, metrics_port=address[1])
        with pytest.raises(ConfigurationError, match="cannot serve metrics on"):
            second.start()


def test_database_errors_and_reconnects_are_counted(engine: sa.Engine) -> None:
    registry = Registry(WorkerJob)

    @registry.task(queue="faulty")
    def ok(ctx: JobContext) -> None:
        pass

    worker = Worker(
        registry, engine, poll_interval=0.05, lock_timeout=0.1, metrics_port=0, listen=False
    )
    with worker:
        enqueue(engine, registry, "ok")
        wait_until(
            lambda: value(
                scrape(worker), "sqla_jobs_jobs_succeeded_total", queue="faulty", task="ok"
            ),
            timeout=30,
            message="the first job ran",
        )
        # A table lock makes the claims time out (lock_timeout): database errors.
        with engine.connect() as blocker:
            blocker.execute(
                sa.text(f"LOCK TABLE {WorkerJob.__tablename__} IN ACCESS EXCLUSIVE MODE")
            )
            wait_until(
                lambda: value(scrape(worker), "sqla_jobs_database_errors_total", operation="claim"),
                timeout=30,
                message="a failed claim is counted",
            )
            blocker.rollback()
            # Every other backend of this database ends: the worker's kept connections are
            # gone, and replaced at their next use.
            blocker.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
            blocker.commit()
        fresh = sa.create_engine(engine.url, poolclass=NullPool)  # the pool's are gone too
        try:
            enqueue(fresh, registry, "ok")
        finally:
            fresh.dispose()

        def replaced() -> Samples | None:
            samples = scrape(worker)
            reconnects = value(samples, "sqla_jobs_database_reconnects_total")
            done = value(samples, "sqla_jobs_jobs_succeeded_total", queue="faulty", task="ok")
            return samples if reconnects >= 1 and done == 2 else None

        samples = wait_until(
            replaced, timeout=30, message="a replaced connection is counted, the second job ran"
        )
    assert value(samples, "sqla_jobs_database_errors_total", operation="claim") >= 1


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_the_worker_command_refuses_a_bad_metrics_port(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["worker", "nowhere:registry", "--metrics-port", port])
    assert exited.value.code == 2
    assert "--metrics-port" in capsys.readouterr().err


def test_label_values_are_bounded_by_the_registry_not_the_rows(engine: sa.Engine) -> None:
    """500 jobs of 500 task names no handler knows reach a served queue, and 40 jobs wait in
    40 queues nobody serves or registers: every one of those names is counted under one
    label value, so the worker's series stay a few per registered task and queue."""
    registry = Registry(WorkerJob)
    q = "metered"

    @registry.task(queue=q)
    def ok(ctx: JobContext) -> None:
        pass

    @registry.task(queue="elsewhere")
    def elsewhere(ctx: JobContext) -> None:  # pragma: no cover - its queue is not served
        pass

    strangers = [f"stranger-{n}" for n in range(500)]
    unserved = [f"foreign-{n}" for n in range(40)]
    with Session(engine) as session, session.begin():
        session.add_all([WorkerJob(task=name, queue=q) for name in strangers])
        session.add_all([WorkerJob(task="ok", queue=q) for _ in range(3)])
        session.add_all([WorkerJob(task="x", queue=name) for name in unserved])
        session.add(WorkerJob(task="elsewhere", queue="elsewhere"))

    def statuses() -> dict[tuple[str, str], int]:
        query = sa.select(WorkerJob.queue, WorkerJob.status, sa.func.count()).group_by(
            WorkerJob.queue, WorkerJob.status
        )
        with engine.connect() as connection:
            return {(row[0], row[1]): row[2] for row in connection.execute(query)}

    worker = Worker(
        registry, engine, queues=[q], poll_interval=0.1, metrics_port=0, metrics_max_age=0.1
    )
    with worker:
        # The rows decide when the worker is done: every stranger dead, every "ok" succeeded.
        wait_until(
            lambda: statuses().get((q, "dead")) == 500 and statuses().get((q, "succeeded")) == 3,
            timeout=120,
            message="the worker ran its jobs and made the strangers dead",
        )

        def counted() -> str | None:
            text = exposition(worker)
            samples = scrape_text(text)
            dead = value(samples, "sqla_jobs_jobs_dead_total", queue=q, task=OTHER)
            done = value(samples, "sqla_jobs_jobs_succeeded_total", queue=q, task="ok")
            foreign = value(
                samples,
                "sqla_jobs_queue_jobs",
                queue=OTHER,
                status="pending",
                table=WorkerJob.__tablename__,
            )
            return text if (dead, done, foreign) == (500, 3, 40) else None

        text = wait_until(counted, timeout=30, message="the outcomes and gauges are exported")
    families = list(text_string_to_metric_families(text))
    series = [sample for family in families for sample in family.samples]
    tasks = {sample.labels["task"] for sample in series if "task" in sample.labels}
    queues = {sample.labels["queue"] for sample in series if "queue" in sample.labels}
    assert tasks == {"ok", OTHER}  # registered tasks keep their own series
    assert queues == {q, "elsewhere", OTHER}
    # A registered queue nobody serves here keeps its own gauges too.
    samples = scrape_text(text)
    labels = {"table": WorkerJob.__tablename__, "status": "pending"}
    assert value(samples, "sqla_jobs_queue_jobs", queue="elsewhere", **labels) == 1
    # Bounded: the count does not grow with the 540 names (before, about 4 series per name).
    assert len(series) < 100, len(series)
    assert len(text) < 40_000, len(text)
