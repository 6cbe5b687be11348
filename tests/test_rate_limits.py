"""Rate limits (``RateLimit``, ``claim(rate_limits=...)``, ``Registry(rate_limits=...)``):
at most N attempts start in any window of a queue, proven from SQL (the attempts' own start
times) with worker processes on several connections; bad input refused before any SQL."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from in_process import enqueue
from models import EmailJob, ReportJob
from no_sql import no_sql
from rate_tasks import KEY_LIMIT, KEYS, LIMIT
from sqlalchemy.orm import Session
from worker_harness import Workers, wait_until

import sqla_jobs
from sqla_jobs import ConfigurationError, InvalidJobError, RateLimit, Registry, Worker
from sqla_jobs._queries.claiming import RATE_RETRY
from sqla_jobs.queue.claiming import claim_waiting

HOURLY = {"api": RateLimit(5, per=timedelta(hours=1))}


def add(engine: sa.Engine, count: int, queue: str = "api", **values: Any) -> list[int]:
    return enqueue(engine, *(EmailJob(task="call", queue=queue, **values) for _ in range(count)))


def logged(engine: sa.Engine) -> list[Any]:
    with engine.connect() as connection:
        return list(connection.execute(sa.text("SELECT queue, key, counts FROM email_jobs_rates")))


def keys_of(engine: sa.Engine, jobs: list[Any]) -> list[str]:
    """The ordering keys of ``jobs`` (``-`` for none), sorted, from SQL."""
    with engine.connect() as connection:
        keys = connection.execute(
            sa.select(EmailJob.ordering_key).where(EmailJob.id.in_([job.id for job in jobs]))
        ).scalars()
        return sorted(key or "-" for key in keys)


def age_log(engine: sa.Engine, seconds: float) -> None:
    """Move the rate table's logged starts ``seconds`` into the past."""
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                "UPDATE email_jobs_rates SET starts = ARRAY(SELECT s - make_interval(secs => :s) "
                "FROM unnest(starts) AS s)"
            ),
            {"s": seconds},
        )


@pytest.mark.parametrize("hold", [False, True], ids=["lease", "lock"])
def test_a_claim_starts_no_more_than_the_window_allows(queue_engine: sa.Engine, hold: bool) -> None:
    add(queue_engine, 12)
    add(queue_engine, 3, queue="other")
    with Session(queue_engine) as session, session.begin():
        first, wait = claim_waiting(
            session, EmailJob, queues=["api", "other"], limit=10, rate_limits=HOURLY, hold=hold
        )
    assert sorted(job.queue for job in first) == ["api"] * 5 + ["other"] * 3
    assert wait is not None
    assert 3590 < wait <= 3600  # when the first of the five leaves the hour
    assert logged(queue_engine) == [("api", "", [5])]
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, EmailJob, queues="api", limit=10, rate_limits=HOURLY) == []
    # Without the limit the queue is claimed as ever: the limit is the claimers' to keep.
    age_log(queue_engine, 3601)  # an hour later
    with Session(queue_engine) as session, session.begin():
        again = sqla_jobs.claim(session, EmailJob, queues="api", limit=10, rate_limits=HOURLY)
    assert len(again) == 5
    assert logged(queue_engine) == [("api", "", [5])]  # the old claim left the window
    with queue_engine.connect() as connection:  # from SQL: ten attempts started, two claims
        starts = connection.execute(
            sa.text(
                "SELECT count(*), count(DISTINCT attempted_at) FROM email_jobs "
                "WHERE queue = 'api' AND attempted_at IS NOT NULL"
            )
        ).one()
    assert tuple(starts) == (10, 2)


def test_a_queue_another_claim_is_rating_is_skipped_not_waited_for(
    queue_engine: sa.Engine,
) -> None:
    add(queue_engine, 4)
    with Session(queue_engine) as holder, holder.begin():
        assert (
            len(sqla_jobs.claim(holder, EmailJob, queues="api", limit=2, rate_limits=HOURLY)) == 2
        )
        with Session(queue_engine) as other, other.begin():
            jobs, wait = claim_waiting(other, EmailJob, queues="api", limit=2, rate_limits=HOURLY)
        assert (jobs, wait) == ([], RATE_RETRY)
    with Session(queue_engine) as session, session.begin():  # the holder committed: 2 + 3 > 5
        assert (
            len(sqla_jobs.claim(session, EmailJob, queues="api", limit=9, rate_limits=HOURLY)) == 2
        )


def test_queue_limits_and_ordering_keys_apply_within_a_rate_limit(
    queue_engine: sa.Engine,
) -> None:
    add(queue_engine, 3, ordering_key="k", key_limit=3)
    add(queue_engine, 3)
    with Session(queue_engine) as session, session.begin():
        jobs = sqla_jobs.claim(
            session,
            EmailJob,
            queues="api",
            limit=10,
            keys=True,
            queue_limits={"api": 4},
            rate_limits=HOURLY,
        )
    assert len(jobs) == 4  # the queue limit, below the rate limit's 5
    assert logged(queue_engine) == [("api", "", [4])]
    with Session(queue_engine) as session, session.begin():
        more = sqla_jobs.claim(
            session, EmailJob, queues="api", limit=10, keys=True, rate_limits=HOURLY
        )
    assert len(more) == 1  # what the hour has left


def test_a_per_key_limit_gives_each_ordering_key_its_own_window(
    queue_engine: sa.Engine,
) -> None:
    for key in ("a", "b", "c"):
        add(queue_engine, 6, ordering_key=key, key_limit=10)
    add(queue_engine, 3)  # no key: not limited by a per-key limit
    per_key = {"api": RateLimit(2, per=timedelta(hours=1), per_key=True)}
    with Session(queue_engine) as session, session.begin():
        first, wait = claim_waiting(
            session, EmailJob, queues="api", limit=30, keys=True, rate_limits=per_key
        )
    assert keys_of(queue_engine, first) == ["-"] * 3 + ["a", "a", "b", "b", "c", "c"]
    assert wait is not None  # it came back short: keys wait for their windows
    assert sorted(logged(queue_engine)) == [("api", key, [2]) for key in ("a", "b", "c")]
    with Session(queue_engine) as session, session.begin():
        assert (
            sqla_jobs.claim(
                session, EmailJob, queues="api", limit=30, keys=True, rate_limits=per_key
            )
            == []
        )
    age_log(queue_engine, 3601)
    with Session(queue_engine) as session, session.begin():
        again = sqla_jobs.claim(
            session, EmailJob, queues="api", limit=30, keys=True, rate_limits=per_key
        )
    assert len(again) == 6


def test_the_windows_show_in_status_health_metrics_and_the_dashboard(
    queue_engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("prometheus_client", reason="the metrics extra")
    pytest.importorskip("starlette", reason="the dashboard extra")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from sqla_jobs import cli
    from sqla_jobs.dashboard import create_app
    from sqla_jobs.health import GaugeCache, read_gauges
    from sqla_jobs.metrics import GaugeCollector, LabelValues

    with Session(queue_engine) as session:  # no start logged yet: nothing to show
        assert sqla_jobs.rate_usage(session, EmailJob) == []
        assert sqla_jobs.rate_usage(session, ReportJob) == []  # no rate table at all
    add(queue_engine, 7)
    for key in ("a", "b"):
        add(queue_engine, 3, queue="calls", ordering_key=key, key_limit=5)
    per_key = {"calls": RateLimit(2, per=60, per_key=True)}
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.claim(session, EmailJob, queues="api", limit=10, rate_limits=HOURLY)
        sqla_jobs.claim(session, EmailJob, queues="calls", limit=10, keys=True, rate_limits=per_key)
    with Session(queue_engine) as session:
        usage = sqla_jobs.rate_usage(session, EmailJob)
        gauges = {q.queue: q for q in read_gauges(session, EmailJob).queues}
    api, calls = usage
    assert (api.queue, api.limit, api.window_seconds, api.started, api.full) == (
        "api",
        5,
        3600.0,
        5,
        True,
    )
    assert (calls.queue, calls.started, calls.keys, calls.full_keys) == ("calls", None, 2, 2)
    assert (gauges["api"].rate_started, gauges["api"].rate_limit) == (5, 5)
    assert gauges["calls"].rate_full_keys == 2

    registry = CollectorRegistry()
    known = LabelValues(queues={"api", "calls"})
    registry.register(GaugeCollector(GaugeCache(queue_engine, EmailJob), known))
    samples = {
        (sample.name, sample.labels["queue"]): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name.startswith("sqla_jobs_queue_rate_")
    }
    assert samples == {
        ("sqla_jobs_queue_rate_started", "api"): 5.0,
        ("sqla_jobs_queue_rate_limit", "api"): 5.0,
        ("sqla_jobs_queue_rate_full_keys", "api"): 0.0,
        ("sqla_jobs_queue_rate_limit", "calls"): 2.0,
        ("sqla_jobs_queue_rate_full_keys", "calls"): 2.0,
    }

    url = queue_engine.url.render_as_string(hide_password=False)
    assert cli.main(["status", "--database-url", url, "--model", "models:EmailJob"]) == 0
    out = capsys.readouterr().out
    assert "rate limit of api: 5 of 5 per 3600 s started in the window now (full" in out
    assert "rate limit of calls: 2 per 60 s per ordering key; 2 keys full" in out

    with TestClient(create_app(queue_engine, EmailJob)) as client:
        page = client.get("/").text
    row = page.split('<tr data-queue="api">')[1].split("</tr>")[0]
    assert "5/5 per 3600.0 s" in row
    assert 'aria-label="5 of 5 started in the window"' in row
    row = page.split('<tr data-queue="calls">')[1].split("</tr>")[0]
    assert "2 keys full" in row


def test_prune_rates_deletes_the_rows_of_idle_windows(
    queue_engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    from sqla_jobs import cli

    for key in ("a", "b"):
        add(queue_engine, 1, ordering_key=key)
    add(queue_engine, 1, queue="live", ordering_key="c")
    per_key = {
        "api": RateLimit(1, per=60, per_key=True),
        "live": RateLimit(1, per=60, per_key=True),
    }
    with Session(queue_engine) as session, session.begin():
        jobs = sqla_jobs.claim(
            session, EmailJob, queues=["api", "live"], limit=5, keys=True, rate_limits=per_key
        )
    assert len(jobs) == 3
    with queue_engine.begin() as connection:  # the keys of "api" went idle a minute ago
        connection.execute(
            sa.text(
                "UPDATE email_jobs_rates SET starts = ARRAY(SELECT s - interval '61 seconds' "
                "FROM unnest(starts) AS s) WHERE queue = 'api'"
            )
        )
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.prune_rates(session, EmailJob, limit=1) == 1  # a batch at a time
    url = queue_engine.url.render_as_string(hide_password=False)
    common = ["--database-url", url, "--model", "models:EmailJob"]
    assert cli.main(["prune", *common, "--older-than", "30d"]) == 0
    assert "pruned 1 idle rows of the rate table" in capsys.readouterr().out
    assert logged(queue_engine) == [("live", "c", [1])]  # a live window stays
    with Session(queue_engine) as session:
        assert sqla_jobs.prune_rates(session, ReportJob) == 0  # no rate table
        with no_sql(queue_engine), pytest.raises(InvalidJobError, match="limit"):
            sqla_jobs.prune_rates(session, EmailJob, limit=0)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: RateLimit(0), r"in \[1, 100000\]"),
        (lambda: RateLimit(100_001), r"in \[1, 100000\]"),
        (lambda: RateLimit(True), "an integer"),
        (lambda: RateLimit(5, per=0), "RateLimit.per must be positive"),
        (lambda: RateLimit(5, per=float("nan")), "RateLimit.per must be positive"),
        (lambda: RateLimit(5, per=timedelta(days=2)), r"at most 86,400 seconds \(a day\)"),
        (lambda: RateLimit(5, per_key=1), "True or False"),  # type: ignore[arg-type]
        (lambda: RateLimit(5, per="1s"), "a timedelta or a number of seconds"),  # type: ignore[arg-type]
        (lambda: Registry(EmailJob, rate_limits={"api": 5}), "must be a RateLimit"),  # type: ignore[dict-item]
        (lambda: Registry(EmailJob, rate_limits={"bad queue!": RateLimit(5)}), "rate_limits"),
    ],
)
def test_bad_rate_limits_are_refused(make: Any, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        make()


def test_a_claim_with_bad_rate_limits_runs_no_sql(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, no_sql(queue_engine):
        for bad in ({"api": 5}, [("api", RateLimit(5))], {"": RateLimit(5)}):
            with pytest.raises(InvalidJobError, match="rate_limits"):
                sqla_jobs.claim(session, EmailJob, queues="api", rate_limits=bad)  # type: ignore[arg-type]


def test_a_worker_with_rate_limits_needs_the_rate_table(queue_engine: sa.Engine) -> None:
    registry = Registry(ReportJob, rate_limits={"api": RateLimit(5)})
    with pytest.raises(ConfigurationError, match=r"create_rate_table\('report_jobs'\)"):
        Worker(registry, queue_engine).run()


#: How long the proofs run: 5 s in the suite; SQLA_JOBS_RATE_PROOF_SECONDS=60 for the
#: issue's minute (docs/how-to/rate-limits.md has that run's figures).
PROOF_SECONDS = float(os.environ.get("SQLA_JOBS_RATE_PROOF_SECONDS", "5"))
#: The share of the limit the workers must reach. The limit itself is never exceeded,
#: however loaded the machine; how close to it they get is a speed, measured in the proof's
#: own run on an idle machine (0.95, with SQLA_JOBS_RATE_PROOF_SECONDS set), and only bounded
#: loosely inside the suite, which runs beside other tests on two cores (a held-back key's
#: next start waits for a claim round trip, and those slow down under load).
RATE_FLOOR = 0.95 if "SQLA_JOBS_RATE_PROOF_SECONDS" in os.environ else 0.5
PROCESSES = 4


@pytest.mark.slow
def test_four_worker_processes_hold_the_limit_in_every_sliding_second(
    queue_engine: sa.Engine, tmp_path: Path
) -> None:
    """Four ``sqla-jobs worker`` processes (8 slots each) drain a backlog of no-op jobs under
    50 starts a second. From SQL, afterwards: no window of one second, starting at any
    attempt's start, holds more than 50 starts, and over the run's whole seconds from the
    first start they started at least 0.95 of 50 a second (:data:`RATE_FLOOR`)."""
    total = int(LIMIT * (PROOF_SECONDS + 3))
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text(
                "INSERT INTO email_jobs (queue, task) "
                "SELECT 'rated', 'tick' FROM generate_series(1, :n)"
            ),
            {"n": total},
        )
    run_workers(queue_engine, tmp_path, "rated", "rate_tasks:registry", concurrency=8)
    with queue_engine.connect() as connection:
        busiest, started = connection.execute(
            sa.text(
                """
                WITH starts AS (
                    SELECT attempted_at AS t FROM email_jobs
                    WHERE queue = 'rated' AND attempted_at IS NOT NULL
                ), first AS (SELECT min(t) AS t0 FROM starts)
                SELECT
                    (SELECT max(n) FROM (
                        SELECT count(*) OVER (
                            ORDER BY t RANGE BETWEEN CURRENT ROW
                            AND interval '999999 microseconds' FOLLOWING
                        ) AS n FROM starts
                    ) AS windows),
                    (SELECT count(*) FROM starts, first
                     WHERE t < t0 + make_interval(secs => :seconds))
                """
            ),
            {"seconds": PROOF_SECONDS},
        ).one()
        attempts = connection.execute(
            sa.text("SELECT max(attempts) FROM email_jobs WHERE queue = 'rated'")
        ).scalar_one()
    print(f"busiest second: {busiest} starts; {started} in the first {PROOF_SECONDS:g} s")
    assert busiest <= LIMIT
    assert started >= RATE_FLOOR * LIMIT * PROOF_SECONDS
    assert attempts == 1  # no attempt ran twice (none lost its lease)


def run_workers(
    engine: sa.Engine, directory: Path, queue: str, target: str, *, concurrency: int
) -> None:
    """Run :data:`PROCESSES` ``sqla-jobs worker`` processes of ``target`` on ``queue`` until
    its first attempt started :data:`PROOF_SECONDS` ago (by the database's clock), then
    stop them gracefully (each must exit 0)."""
    url = engine.url.render_as_string(hide_password=False)
    workers = Workers(url, directory)
    try:
        for _ in range(PROCESSES):
            workers.start(queues=queue, concurrency=concurrency, poll_interval="1s", target=target)
        wait_until(
            lambda: ran_for(engine, queue) >= PROOF_SECONDS + 0.5,
            timeout=PROOF_SECONDS + 120,
            message=f"the workers started jobs for {PROOF_SECONDS} s",
        )
        for process in workers.started:
            assert process.stop(30) == 0, process.log_text()[-3000:]
    finally:
        workers.close()


def ran_for(engine: sa.Engine, queue: str) -> float:
    """Seconds of the database's clock since the first attempt of ``queue`` started (0.0
    before)."""
    with engine.connect() as connection:
        seconds = connection.execute(
            sa.text(
                "SELECT coalesce(date_part('epoch', now() - min(attempted_at)), 0) "
                "FROM email_jobs WHERE queue = :queue"
            ),
            {"queue": queue},
        ).scalar_one()
    return float(seconds)


@pytest.mark.slow
def test_four_worker_processes_hold_a_per_key_limit_for_each_of_100_keys(
    queue_engine: sa.Engine, tmp_path: Path
) -> None:
    """The same with a limit per ordering key: 100 keys, 5 starts a second each (500 a
    second in all). From SQL: no key's sliding second holds more than 5 of its starts, and
    in all they started at least 0.95 of 500 a second over the run's whole seconds
    (:data:`RATE_FLOOR`)."""
    per_key = int(KEY_LIMIT * (PROOF_SECONDS + 3))
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text(
                "INSERT INTO email_jobs (queue, task, ordering_key, key_limit) "
                "SELECT 'keyed', 'keyed_tick', 'key-' || (n % :keys), :key_limit "
                "FROM generate_series(1, :n) AS n"
            ),
            {"keys": KEYS, "key_limit": KEY_LIMIT, "n": per_key * KEYS},
        )
    run_workers(queue_engine, tmp_path, "keyed", "rate_tasks:keyed_registry", concurrency=16)
    with queue_engine.connect() as connection:
        busiest, keys, started = connection.execute(
            sa.text(
                """
                WITH starts AS (
                    SELECT ordering_key AS k, attempted_at AS t FROM email_jobs
                    WHERE queue = 'keyed' AND attempted_at IS NOT NULL
                ), first AS (SELECT min(t) AS t0 FROM starts)
                SELECT
                    (SELECT max(n) FROM (
                        SELECT count(*) OVER (
                            PARTITION BY k ORDER BY t RANGE BETWEEN CURRENT ROW
                            AND interval '999999 microseconds' FOLLOWING
                        ) AS n FROM starts
                    ) AS windows),
                    (SELECT count(DISTINCT k) FROM starts),
                    (SELECT count(*) FROM starts, first
                     WHERE t < t0 + make_interval(secs => :seconds))
                """
            ),
            {"seconds": PROOF_SECONDS},
        ).one()
    print(
        f"busiest key second: {busiest} starts; {keys} keys; "
        f"{started} in the first {PROOF_SECONDS:g} s"
    )
    assert keys == KEYS
    assert busiest <= KEY_LIMIT
    assert started >= RATE_FLOOR * KEY_LIMIT * KEYS * PROOF_SECONDS
