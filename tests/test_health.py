"""Health gauges (sqla_jobs.health), ``sqla-jobs status`` and ``sqla-jobs health``.

The gauges read only indexes, statistics and the catalog: the plan test seeds finished
history and checks, from ``EXPLAIN``, that no part of the status reads touches the job
table's heap by a sequential scan, and that the live counts come from the partial indexes.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from models import EmailJob
from plans import explain_statement, plan_nodes
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import sqla_jobs
from sqla_jobs import _queries as statements
from sqla_jobs import cli, names
from sqla_jobs.errors import InvalidThresholdError
from sqla_jobs.health import GaugeCache, Thresholds, read_gauges

TABLE: sa.Table = EmailJob.__table__  # type: ignore[assignment]
N = names("email_jobs")


def insert(engine: sa.Engine, sql: str, **params: Any) -> None:
    with engine.begin() as connection:
        connection.execute(sa.text(sql), params)


def seed_every_state(engine: sa.Engine) -> None:
    insert(
        engine,
        "INSERT INTO email_jobs (queue, task, run_at) VALUES "
        "('a', 'old', now() - interval '2 minutes'), ('a', 'new', now()), "
        "('a', 'later', now() + interval '1 hour'), ('b', 'new', now())",
    )
    insert(
        engine,
        "INSERT INTO email_jobs (queue, task, status, attempts, lease_expires_at) VALUES "
        "('a', 'busy', 'running', 1, now() + interval '1 hour'), "
        "('b', 'stuck', 'running', 1, now() - interval '1 minute')",
    )
    insert(
        engine,
        "INSERT INTO email_jobs (queue, task, status, attempts, finished_at) VALUES "
        "('b', 'bad', 'dead', 3, now()), ('b', 'bad', 'dead', 3, now()), "
        "('a', 'ok', 'succeeded', 1, now()), ('a', 'no', 'cancelled', 0, now())",
    )


def test_gauges_count_live_jobs_by_queue_in_database_time(queue_engine: sa.Engine) -> None:
    seed_every_state(queue_engine)
    with Session(queue_engine) as session:
        gauges = read_gauges(session, EmailJob)
    a, b = gauges.queues
    assert (a.queue, a.pending, a.runnable, a.running, a.expired_leases, a.dead) == (
        "a",
        3,
        2,
        1,
        0,
        0,
    )
    assert (b.queue, b.pending, b.runnable, b.running, b.expired_leases, b.dead) == (
        "b",
        1,
        1,
        1,
        1,
        2,
    )
    assert a.oldest_runnable_seconds is not None
    assert 119 < a.oldest_runnable_seconds < 600
    assert gauges.oldest_runnable_seconds == a.oldest_runnable_seconds
    assert (gauges.pending, gauges.running, gauges.expired_leases, gauges.dead) == (4, 2, 1, 2)
    table = gauges.table
    assert table.table == "email_jobs"
    for size in (table.table_bytes, table.pending_index_bytes, table.dead_index_bytes):
        assert size is not None
        assert size > 0


def test_queue_stats_leaves_out_the_history(queue_engine: sa.Engine) -> None:
    seed_every_state(queue_engine)
    with Session(queue_engine) as session:
        stats = sqla_jobs.queue_stats(session, EmailJob)
    assert {s.status for s in stats} == {
        sqla_jobs.JobStatus.PENDING,
        sqla_jobs.JobStatus.RUNNING,
        sqla_jobs.JobStatus.DEAD,
    }
    (running_b,) = [s for s in stats if s.queue == "b" and s.status == "running"]
    assert running_b.expired_leases == 1


def test_an_open_transaction_shows_as_holding_back_vacuum(queue_engine: sa.Engine) -> None:
    with queue_engine.connect() as holder:
        holder.execute(sa.text("SELECT txid_current()"))  # it has an xid: vacuum waits for it
        age = sa.text("SELECT extract(epoch FROM statement_timestamp() - transaction_timestamp())")
        deadline = time.monotonic() + 30
        while holder.execute(age).scalar_one() < 1.0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        opened = float(holder.execute(age).scalar_one())
        gauges = _gauges(queue_engine)
        oldest = gauges.oldest_xmin
        # The oldest holder on the server is this transaction, or one open even longer
        # (on a shared server).
        assert oldest is not None
        assert oldest.age_seconds is not None
        assert oldest.age_seconds >= opened
        assert gauges.oldest_xmin_by_xids is not None
        problems = Thresholds(max_xmin_age=timedelta(milliseconds=500)).problems(gauges)
        assert len(problems) == 1
        assert problems[0].startswith(f"vacuum held back for {oldest.age_seconds:.1f}s by ")
        holder.rollback()


def _gauges(engine: sa.Engine) -> sqla_jobs.health.Gauges:
    with Session(engine) as session:
        return read_gauges(session, EmailJob)


def test_thresholds_say_what_is_crossed(queue_engine: sa.Engine) -> None:
    seed_every_state(queue_engine)
    gauges = _gauges(queue_engine)
    assert Thresholds().problems(gauges) == []
    assert (
        Thresholds(
            max_oldest_runnable=600, max_runnable=2, max_expired_leases=1, max_dead=2
        ).problems(gauges)
        == []
    )
    problems = Thresholds(
        max_oldest_runnable=timedelta(seconds=60),
        max_runnable=1,
        max_expired_leases=0,
        max_dead=1,
        max_dead_tuples=10**9,
    ).problems(gauges)
    assert problems[0].startswith("queue a: the oldest runnable job has waited ")
    assert problems[1:] == [
        "queue a: 2 runnable jobs (max 1)",
        "1 running jobs with expired leases (max 0)",
        "2 dead jobs (max 1)",
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_dead", -1),
        ("max_dead", 1.5),
        ("max_dead", True),
        ("max_runnable", "10"),
        ("max_oldest_runnable", -1),
        ("max_oldest_runnable", float("nan")),
        ("max_xmin_age", "10m"),
        ("max_xmin_age", timedelta(seconds=-1)),
    ],
)
def test_bad_thresholds_are_refused_before_any_sql(field: str, value: object) -> None:
    with pytest.raises(InvalidThresholdError) as raised:
        Thresholds(**{field: value})  # type: ignore[arg-type]
    assert raised.value.field == field


@pytest.mark.parametrize(
    ("field", "value"), [("max_age", 0), ("max_age", -5), ("timeout", 0), ("timeout", 301)]
)
def test_bad_cache_settings_are_refused(field: str, value: float) -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(InvalidThresholdError):
        GaugeCache(engine, EmailJob, **{field: value})


def test_the_cache_answers_within_its_timeout_when_the_database_hangs(
    queue_engine: sa.Engine,
) -> None:
    cache = GaugeCache(queue_engine, EmailJob, max_age=0.01, timeout=0.5)
    first = cache.read()
    assert first.error is None
    assert first.gauges is not None
    # An ACCESS EXCLUSIVE lock makes the next read wait (until its statement_timeout).
    with queue_engine.connect() as blocker:
        blocker.execute(sa.text("LOCK TABLE email_jobs IN ACCESS EXCLUSIVE MODE"))
        time.sleep(0.02)
        started = time.monotonic()
        stale = cache.read()
        waited = time.monotonic() - started
        blocker.rollback()
    assert stale.gauges is first.gauges  # the last values, not a hang
    assert stale.error is not None
    assert waited < 30  # bounded by the timeout (generous: the machine is shared)
    deadline = time.monotonic() + 30
    while (reading := cache.read()).error is not None or reading.gauges is first.gauges:
        assert time.monotonic() < deadline, f"the cache never recovered: {reading.error}"
        time.sleep(0.05)


# -- the plan: indexes only, whatever the history --------------------------------------------

HISTORY = 200_000


@pytest.fixture
def history(queue_engine: sa.Engine) -> sa.Engine:
    with queue_engine.begin() as connection:
        connection.execute(sa.text("ALTER TABLE email_jobs DISABLE TRIGGER USER"))
        connection.execute(
            sa.text(
                "INSERT INTO email_jobs (queue, task, status, attempts, finished_at) "
                "SELECT 'q' || (n % 4), 'done', 'succeeded', 1, now() "
                "FROM generate_series(1, :n) AS n"
            ),
            {"n": HISTORY},
        )
        connection.execute(sa.text("ALTER TABLE email_jobs ENABLE TRIGGER USER"))
    seed_every_state(queue_engine)
    with queue_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text("VACUUM ANALYZE email_jobs"))
    return queue_engine


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_status_reads_index_only_whatever_the_history(history: sa.Engine, generic: bool) -> None:
    with history.connect() as connection:
        if generic:
            connection.execute(sa.text("SET plan_cache_mode = force_generic_plan"))
        reads = {
            "queue_stats": statements.queue_stats(TABLE),
            "dead_jobs": statements.dead_jobs(TABLE).params(limit=10),
            "table_stats": statements.table_stats(TABLE),
        }
        for name, statement in reads.items():
            plan = explain_statement(connection, statement)
            nodes = list(plan_nodes(plan["Plan"]))
            on_table = [n for n in nodes if n.get("Relation Name") == "email_jobs"]
            assert all(n["Node Type"] != "Seq Scan" for n in on_table), (name, plan)
            if name == "queue_stats":
                scans = {(n["Node Type"], n["Index Name"]) for n in on_table}
                assert scans == {
                    ("Index Only Scan", N.pending_index),
                    ("Index Only Scan", N.keyed_pending_index),
                    ("Index Only Scan", N.running_index),
                    ("Index Only Scan", N.dead_index),
                }, json.dumps(plan)
            # A few pages, not the history's thousands (200k rows fill about 2,500).
            assert (
                plan["Plan"]["Shared Hit Blocks"] + plan["Plan"].get("Shared Read Blocks", 0) < 100
            ), (
                name,
                plan["Plan"],
            )
        connection.rollback()


# -- the commands ------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def cli_url(queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> str:
    url = queue_engine.url.render_as_string(hide_password=False)
    monkeypatch.setenv(cli.DATABASE_URL_VARIABLE, url)
    return url


@pytest.mark.usefixtures("restore_root_logging")
def test_health_exits_3_with_one_line_when_a_threshold_is_crossed(
    queue_engine: sa.Engine, cli_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", "models:EmailJob"]
    status, out, _ = run(capsys, "health", *model, "--max-dead", "5", "--max-xmin-age", "1h")
    assert status == 0
    assert out.startswith("healthy: 0 runnable, 0 running, 0 expired leases, 0 dead;")
    seed_every_state(queue_engine)
    status, out, _ = run(
        capsys, "health", *model, "--max-dead", "1", "--max-oldest-runnable", "60s"
    )
    assert status == cli.UNHEALTHY == 3
    assert out.count("\n") == 1
    assert out.startswith("unhealthy: queue a: the oldest runnable job has waited ")
    assert out.endswith("; 2 dead jobs (max 1)\n")


@pytest.mark.usefixtures("restore_root_logging")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-dead", "-1"], "--max-dead: must be in [0, 2147483647], got -1"),
        (["--max-runnable", "many"], "--max-runnable: 'many' is not an integer"),
        (["--max-oldest-runnable", "soon"], "'soon' is not a duration"),
        (["--timeout", "0s"], "--timeout: must be more than 0"),
    ],
)
def test_health_refuses_bad_options_before_connecting(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    message: str,
) -> None:
    # A URL that cannot be reached: a bad option must fail first, with status 2.
    monkeypatch.setenv(cli.DATABASE_URL_VARIABLE, "postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(SystemExit) as exited:
        cli.main(["health", *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.usefixtures("restore_root_logging")
def test_health_exits_1_when_the_database_cannot_be_reached(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cli.DATABASE_URL_VARIABLE, "postgresql://nobody@127.0.0.1:1/none")
    status, out, err = run(capsys, "health", "--max-dead", "1")
    assert (status, out) == (1, "")
    assert err.startswith("sqla-jobs: error: cannot reach the database")


@pytest.mark.usefixtures("restore_root_logging")
def test_a_lock_on_the_table_does_not_hang_health(queue_engine: sa.Engine) -> None:
    # The health command's statement_timeout bounds a read stuck behind a table lock.
    url = queue_engine.url.render_as_string(hide_password=False)
    engine = sa.create_engine(url, poolclass=NullPool)
    result: list[int] = []
    with engine.connect() as blocker:
        blocker.execute(sa.text("LOCK TABLE email_jobs IN ACCESS EXCLUSIVE MODE"))
        thread = threading.Thread(
            target=lambda: result.append(
                cli.main(
                    [
                        "health",
                        "--database-url",
                        url,
                        "--model",
                        "models:EmailJob",
                        "--timeout",
                        "200ms",
                    ]
                )
            )
        )
        thread.start()
        thread.join(60)
        blocker.rollback()
    engine.dispose()
    assert result == [1]
