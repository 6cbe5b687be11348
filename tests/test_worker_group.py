"""Jobs spread over several databases: enqueued with their business rows in their own
database (``horizontal_shard``), run by one process that serves every database fairly
(:class:`sqla_jobs.worker.WorkerGroup`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from shard_models import Base, RegionJob, RegionOrder, fulfil, registry, sharded_sessions
from sqlalchemy.orm import Session
from worker_harness import subprocess_env

from sqla_jobs import ConfigurationError, JobStatus, Worker, WorkerGroup, cli

REGIONS = ("eu", "us", "ap")


@pytest.fixture(scope="module")
def _databases(fresh_database: FreshDatabase) -> Iterator[dict[str, sa.Engine]]:
    made = {region: sa.create_engine(fresh_database("sqla_jobs_shard")) for region in REGIONS}
    for engine in made.values():
        Base.metadata.create_all(engine)
    try:
        yield made
    finally:
        for engine in made.values():
            engine.dispose()


@pytest.fixture
def engines(_databases: dict[str, sa.Engine]) -> dict[str, sa.Engine]:
    """The three databases, emptied before the test."""
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    for engine in _databases.values():
        with engine.begin() as connection:
            connection.exec_driver_sql(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
    return _databases


def statuses(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as connection:
        rows = connection.execute(
            sa.select(RegionJob.status, sa.func.count()).group_by(RegionJob.status)
        ).all()
    return {JobStatus(status).value: int(count) for status, count in rows}


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def enqueue(engines: dict[str, sa.Engine], orders: dict[str, int], sleep: float = 0.0) -> None:
    """``orders[region]`` orders, each with its job, in one sharded session."""
    sessions = sharded_sessions(engines)
    next_id = 1
    with sessions() as session, session.begin():
        for region, count in orders.items():
            for _ in range(count):
                order = RegionOrder(id=next_id, region=region)
                session.add(order)
                session.add(fulfil.job({"sleep": sleep}, order=order))
                next_id += 1


def test_each_job_is_written_with_its_order_in_its_regions_database(
    engines: dict[str, sa.Engine],
) -> None:
    enqueue(engines, {"eu": 2, "us": 1, "ap": 3})
    for region, engine in engines.items():
        with Session(engine) as session:
            rows = session.execute(
                sa.select(RegionOrder.region, RegionJob.order_id).join(
                    RegionJob, RegionJob.order_id == RegionOrder.id
                )
            ).all()
            assert {r for r, _ in rows} == {region}
            assert len(rows) == {"eu": 2, "us": 1, "ap": 3}[region]
    # A business transaction that rolls back leaves no order and no job in any database.
    sessions = sharded_sessions(engines)
    with sessions() as session:
        session.begin()
        for i, region in enumerate(REGIONS, 100):
            order = RegionOrder(id=i, region=region)
            session.add(order)
            session.add(fulfil.job({}, order=order))
        session.flush()
        session.rollback()
    assert sum(sum(statuses(engine).values()) for engine in engines.values()) == 6


def _worker(engine: sa.Engine) -> Worker:
    return Worker(registry, engine, concurrency=2, poll_interval=0.1)


def test_one_group_drains_every_database(engines: dict[str, sa.Engine]) -> None:
    enqueue(engines, {"eu": 20, "us": 20, "ap": 20})
    with WorkerGroup(_worker(engine) for engine in engines.values()):
        wait_for(lambda: all(statuses(e) == {"succeeded": 20} for e in engines.values()))


def test_a_busy_database_does_not_hold_up_a_quiet_one(engines: dict[str, sa.Engine]) -> None:
    enqueue(engines, {"eu": 400}, sleep=0.01)
    enqueue_more = sharded_sessions(engines)
    with enqueue_more() as session, session.begin():
        for i in range(10):
            order = RegionOrder(id=10_000 + i, region="us")
            session.add(order)
            session.add(fulfil.job({}, order=order))
    with WorkerGroup(_worker(engine) for engine in engines.values()):
        wait_for(lambda: statuses(engines["us"]) == {"succeeded": 10})
        # The quiet database's jobs are done while the busy one still has most of its own.
        assert statuses(engines["eu"]).get("pending", 0) > 0


def test_a_database_that_is_down_holds_up_none_of_the_others(
    engines: dict[str, sa.Engine],
) -> None:
    enqueue(engines, {"eu": 10})
    down = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=1")
    group = WorkerGroup([_worker(engines["eu"]), _worker(down)])
    try:
        group.start()
        wait_for(lambda: statuses(engines["eu"]) == {"succeeded": 10})
    finally:
        group.stop(wait=True)  # the member still waiting for its server stops too
        down.dispose()


def test_a_database_that_refuses_the_worker_stops_the_group_with_its_error(
    engines: dict[str, sa.Engine], fresh_database: FreshDatabase
) -> None:
    empty = sa.create_engine(fresh_database("sqla_jobs_shard"))  # no job table there
    group = WorkerGroup([_worker(engines["eu"]), _worker(empty)])
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            group.run()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    empty.dispose()
    assert not thread.is_alive()
    (error,) = outcome
    assert isinstance(error, ConfigurationError)
    assert "region_jobs" in str(error)
    assert all(not member._running for member in group.workers)


def test_a_group_is_refused_bad_members_before_anything_runs(
    engines: dict[str, sa.Engine],
) -> None:
    with pytest.raises(ConfigurationError, match="at least one Worker"):
        WorkerGroup([])
    with pytest.raises(ConfigurationError, match="expected a sqla_jobs Worker"):
        WorkerGroup([engines["eu"]])  # type: ignore[list-item]
    one = _worker(engines["eu"])
    with pytest.raises(ConfigurationError, match="given twice"):
        WorkerGroup([one, one])
    with pytest.raises(ConfigurationError, match="given twice"):
        WorkerGroup([one, _worker(engines["eu"])])


# -- the command line: --database-url once per database -------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _urls(engines: dict[str, sa.Engine]) -> list[str]:
    return [
        arg
        for engine in engines.values()
        for arg in ("--database-url", engine.url.render_as_string(hide_password=False))
    ]


def test_status_shows_each_database(
    engines: dict[str, sa.Engine], capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(engines, {"eu": 3, "us": 1, "ap": 2})
    status, out, _ = _cli(capsys, "status", "--model", "shard_models:RegionJob", *_urls(engines))
    assert status == 0
    sections = out.split("== ")[1:]
    assert len(sections) == 3
    for section, (region, engine) in zip(sections, engines.items(), strict=True):
        assert section.startswith(engine.url.render_as_string(hide_password=True))
        (row,) = [line for line in section.splitlines() if line.startswith("regions ")]
        assert row.split()[1] == str({"eu": 3, "us": 1, "ap": 2}[region])  # pending


def test_health_names_the_database_that_crosses_a_threshold(
    engines: dict[str, sa.Engine], capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(engines, {"us": 5})
    status, out, _ = _cli(
        capsys,
        "health",
        "--model",
        "shard_models:RegionJob",
        "--max-runnable",
        "4",
        *_urls(engines),
    )
    assert status == 3
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    us = engines["us"].url.render_as_string(hide_password=True)
    assert lines[us].startswith("unhealthy")
    assert [text.split(":")[0] for url, text in lines.items() if url != us] == ["healthy"] * 2


def test_several_databases_are_refused_what_serves_one_before_anything_connects(
    engines: dict[str, sa.Engine], capsys: pytest.CaptureFixture[str]
) -> None:
    urls = _urls(engines)
    for extra in (["--listen-url", urls[1]], ["--health-file", "/tmp/x"]):
        status, _, err = _cli(capsys, "worker", "shard_models:registry", *urls, *extra)
        assert status == 1
        assert "run a worker process per database" in err
    status, _, err = _cli(capsys, "worker", "shard_models:registry", *urls[:2], *urls[:2])
    assert status == 1
    assert "the same database twice" in err
    status, _, err = _cli(
        capsys, "status", *urls[:4], "--replica-url", urls[1], "--model", "shard_models:RegionJob"
    )
    assert status == 1
    assert "give one --database-url with it" in err


def test_the_worker_command_serves_every_database(
    engines: dict[str, sa.Engine], tmp_path: Path
) -> None:
    enqueue(engines, {"eu": 5, "us": 5, "ap": 5})
    env = subprocess_env(engines["eu"].url.render_as_string(hide_password=False))
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sqla_jobs", "worker", "shard_models:registry", *_urls(engines)],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: all(statuses(e) == {"succeeded": 5} for e in engines.values()))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log.close()
    text = (tmp_path / "worker.log").read_text()
    assert text.count("action=worker_started") == 3, text


def test_a_group_serves_every_databases_metrics_on_one_port(
    engines: dict[str, sa.Engine],
) -> None:
    pytest.importorskip("prometheus_client")
    enqueue(engines, {"eu": 4, "us": 2})
    members = [_worker(engines["eu"]), _worker(engines["us"])]
    group = WorkerGroup(members, metrics_port=0)
    labels = dict(zip(("eu", "us"), group.labels, strict=True))
    assert all(label.endswith(engines[r].url.database or "") for r, label in labels.items())
    with group:
        wait_for(lambda: statuses(engines["eu"]) == {"succeeded": 4})
        wait_for(lambda: statuses(engines["us"]) == {"succeeded": 2})
        address = group.metrics_address
        assert address is not None

        def scraped() -> str:
            host, port = address
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
                return str(reply.read().decode())

        def succeeded(text: str, region: str) -> float:
            line = next(
                (
                    line
                    for line in text.splitlines()
                    if line.startswith("sqla_jobs_jobs_succeeded_total{")
                    and f'database="{labels[region]}"' in line
                ),
                None,
            )
            return 0.0 if line is None else float(line.rsplit(" ", 1)[1])

        # The outcome writer counts a success once its commit is through.
        wait_for(lambda: succeeded(scraped(), "eu") == 4 and succeeded(scraped(), "us") == 2)
        text = scraped()
        # Each metric once, whatever the number of databases.
        types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types))
        assert "# TYPE sqla_jobs_jobs_succeeded_total counter" in types
    assert group.metrics_address is None


def test_a_group_with_metrics_refuses_members_with_their_own(
    engines: dict[str, sa.Engine],
) -> None:
    own = Worker(registry, engines["eu"], metrics_port=0)
    with pytest.raises(ConfigurationError, match="none of their own"):
        WorkerGroup([own, _worker(engines["us"])], metrics_port=0)
    with pytest.raises(ConfigurationError, match="metrics_port"):
        WorkerGroup([_worker(engines["us"])], metrics_port=-1)
