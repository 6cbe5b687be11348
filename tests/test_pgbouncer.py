"""sqla_jobs through PgBouncer in transaction mode: enqueue, claim, outcomes, the worker and
the administration commands.

The PgBouncer here (the ``pgbouncer`` fixture) hands transactions to its server connections
in turn (``server_round_robin``, at least two of them open), so that anything that relied on
the state of a session (a prepared statement, a session ``SET``, ``LISTEN``) would meet a
server connection that does not have it, and fail here. Engines through it are made as the
README says: ``connect_args={"prepare_threshold": None}``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
import worker_tasks
from conftest import FreshDatabase, pgbouncer_url
from models import Base, EmailJob, EmailJobResult
from sqlalchemy.orm import Session
from worker_harness import JobDatabase, Workers, running, wait_until

import sqla_jobs
from sqla_jobs import LeaseLostError
from sqla_jobs.pgbouncer import PgBouncer
from sqla_jobs.pooler import behind_pooler
from sqla_jobs.urls import libpq_url
from sqla_jobs.worker.link import Link

UNPREPARED: dict[str, Any] = {"prepare_threshold": None}
ROUNDS = 8  # more than psycopg's prepare_threshold (5): a prepared statement would show


@pytest.fixture(scope="module")
def direct_url(fresh_database: FreshDatabase) -> str:
    """A database with tests/models.py's tables (created directly, not through PgBouncer)."""
    url = fresh_database("sqla_jobs_bouncer")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    Base.metadata.create_all(engine)
    engine.dispose()
    return url


@pytest.fixture
def pooled(direct_url: str, pgbouncer: PgBouncer) -> Iterator[sa.Engine]:
    """An engine on ``direct_url``'s database through PgBouncer, its tables emptied."""
    engine = sa.create_engine(pgbouncer_url(pgbouncer, direct_url), connect_args=UNPREPARED)
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    with engine.begin() as connection:
        connection.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    on_each_server_connection(pgbouncer, direct_url, 2)  # two to take turns from the start
    try:
        yield engine
    finally:
        engine.dispose()


def on_each_server_connection(bouncer: PgBouncer, url: str, count: int) -> list[Any]:
    """``pg_backend_pid()`` and ``lock_timeout`` from ``count`` server connections of
    ``url``'s pool: as many clients each hold a transaction at once, so each gets its own
    (and PgBouncer opens what it lacks, up to its pool size)."""
    connections = [
        psycopg.connect(libpq_url(pgbouncer_url(bouncer, url)), prepare_threshold=None)
        for _ in range(count)
    ]
    try:
        sql = "SELECT pg_backend_pid(), current_setting('lock_timeout')"
        rows = [connection.execute(sql).fetchone() for connection in connections]
    finally:
        for connection in connections:
            connection.rollback()  # a client gone mid-transaction costs its server connection
            connection.close()
    assert len({row[0] for row in rows if row is not None}) == count
    return rows


def server_lock_timeouts(bouncer: PgBouncer, url: str) -> set[str]:
    """``lock_timeout`` on every server connection of ``url``'s pool."""
    return {row[1] for row in on_each_server_connection(bouncer, url, bouncer.pool_size)}


def test_the_fixture_is_a_transaction_pooler(direct_url: str, pooled: sa.Engine) -> None:
    direct = sa.create_engine(direct_url, poolclass=sa.NullPool)
    try:
        with direct.connect() as connection:
            assert not behind_pooler(connection.connection.driver_connection)
    finally:
        direct.dispose()
    with pooled.connect() as connection:
        assert behind_pooler(connection.connection.driver_connection)
        backends = set()
        for _ in range(ROUNDS):
            with connection.begin():
                backends.add(connection.execute(sa.text("SELECT pg_backend_pid()")).scalar())
    # One client's transactions go to different server connections.
    assert len(backends) >= 2


def test_enqueue_with_the_orm_and_in_bulk(pooled: sa.Engine) -> None:
    for n in range(ROUNDS):
        with Session(pooled) as session, session.begin():
            session.add_all([EmailJob(task="t", args={"n": n}), EmailJob(task="u")])
        with Session(pooled) as session, session.begin():
            sqla_jobs.enqueue_many(
                session, EmailJob, [{"task": "bulk", "args": {"n": n, "i": i}} for i in range(3)]
            )
    with pooled.connect() as connection:
        rows = connection.execute(
            sa.select(EmailJob.task, sa.func.count()).group_by(EmailJob.task)
        ).all()
    counts = {task: int(count) for task, count in rows}
    assert counts == {"t": ROUNDS, "u": ROUNDS, "bulk": 3 * ROUNDS}


def test_claim_in_lease_and_lock_held_modes(pooled: sa.Engine) -> None:
    with Session(pooled) as session, session.begin():
        sqla_jobs.enqueue_many(session, EmailJob, [{"task": "t"} for _ in range(4 * ROUNDS)])
    done = 0
    for _ in range(ROUNDS):
        # Lease mode through a Session, and through a Core connection (the driver path).
        with Session(pooled) as session, session.begin():
            jobs = sqla_jobs.claim(session, EmailJob, limit=1)
        with Session(pooled) as session, session.begin():
            done += len(jobs) - len(sqla_jobs.complete_many(session, jobs))
        with pooled.connect() as connection:
            with connection.begin():
                jobs = sqla_jobs.claim(connection, EmailJob, limit=2)
            with connection.begin():
                done += len(jobs) - len(sqla_jobs.complete_many(connection, jobs))
        # Lock-held: the attempt is committed on a separate connection, the rows locked and
        # completed in this transaction.
        with Session(pooled) as session, session.begin():
            (job,) = sqla_jobs.claim(session, EmailJob, hold=True)
            sqla_jobs.complete(session, job)
            done += 1
    assert done == 4 * ROUNDS
    with pooled.connect() as connection:
        statuses = connection.execute(sa.select(EmailJob.status, EmailJob.attempts)).all()
    assert set(statuses) == {("succeeded", 1)}


def test_every_outcome(pooled: sa.Engine) -> None:
    def one(**kwargs: Any) -> sqla_jobs.ClaimedJob:
        with Session(pooled) as session, session.begin():
            (job,) = sqla_jobs.claim(session, EmailJob, **kwargs)
            return job

    for _ in range(ROUNDS):
        with Session(pooled) as session, session.begin():
            sqla_jobs.enqueue_many(session, EmailJob, [{"task": "t"} for _ in range(4)])
        completed, failed, released, dead = [one(lease=60) for _ in range(4)]
        with Session(pooled) as session, session.begin():
            assert sqla_jobs.heartbeat(session, [completed, failed], lease=120) == []
            sqla_jobs.complete(session, completed, result={"ok": 1}, result_model=EmailJobResult)
            outcome = sqla_jobs.fail(session, failed, RuntimeError("again"), delay=0.001)
            assert outcome.will_retry
            sqla_jobs.release(session, [released])
            assert not sqla_jobs.fail(session, dead, "no", retry=False).will_retry
        with Session(pooled) as session, session.begin(), pytest.raises(LeaseLostError):
            sqla_jobs.complete(session, completed)  # fenced: that attempt is over
        time.sleep(0.01)
        again = [one(), one()]  # the failed and the released job, runnable now
        assert {job.id for job in again} == {failed.id, released.id}
        with Session(pooled) as session, session.begin():
            assert sqla_jobs.complete_many(session, again) == []
            sqla_jobs.retry(session, EmailJob, dead.id)
            sqla_jobs.cancel(session, EmailJob, dead.id)
    time.sleep(0.05)
    with Session(pooled) as session, session.begin():
        stats = {(s.queue, s.status): s.count for s in sqla_jobs.queue_stats(session, EmailJob)}
        assert sqla_jobs.prune(session, EmailJob, older_than=0.01, limit=1000) == 4 * ROUNDS
    assert stats == {}  # every job finished: queue_stats counts only the live ones
    with Session(pooled) as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(EmailJobResult)) == ROUNDS


def test_a_pooled_link_sets_lock_timeout_in_each_transaction(
    pgbouncer: PgBouncer, direct_url: str, pooled: sa.Engine
) -> None:
    link = Link(pooled, lock_timeout=0.25, pooled=True)
    show = sa.text("SELECT current_setting('lock_timeout'), current_setting('plan_cache_mode')")
    try:
        for _ in range(ROUNDS):
            # Nothing is prepared behind the pooler: plan_cache_mode is left as it is.
            settings = link.transaction(lambda c: tuple(c.execute(show).one()))
            assert settings == ("250ms", "auto")
    finally:
        link.close()
    assert server_lock_timeouts(pgbouncer, direct_url) == {"0"}


# -- the worker ---------------------------------------------------------------------------


def test_worker_pooler_option_is_checked() -> None:
    with pytest.raises(sqla_jobs.ConfigurationError, match="pooler must be one of"):
        sqla_jobs.Worker(
            worker_tasks.registry, sa.create_engine("postgresql+psycopg://"), pooler="x"
        )


@pytest.fixture
def worker_db(fresh_database: FreshDatabase) -> Iterator[JobDatabase]:
    database = JobDatabase(fresh_database("sqla_jobs_bouncer_worker"))
    try:
        yield database
    finally:
        database.dispose()


@pytest.fixture
def bounced_workers(
    worker_db: JobDatabase, pgbouncer: PgBouncer, tmp_path: Path
) -> Iterator[Workers]:
    """``sqla-jobs worker`` processes whose database URL goes through PgBouncer (their
    handlers' own connections too)."""
    on_each_server_connection(pgbouncer, worker_db.url, 2)
    pool = Workers(pgbouncer_url(pgbouncer, worker_db.url), tmp_path)
    try:
        yield pool
    finally:
        pool.close()


MIXED = [("sleepy", None), ("sleepy_locked", None), ("async_sleepy", None)] * 8


@pytest.mark.slow
def test_worker_listens_on_a_direct_listen_url(
    worker_db: JobDatabase, bounced_workers: Workers, pgbouncer: PgBouncer
) -> None:
    poll_interval = 10.0
    worker = bounced_workers.start("--listen-url", worker_db.url, poll_interval=f"{poll_interval}s")
    worker.wait_log("action=behind_pooler")
    worker.wait_log("action=listener_connected")
    assert "prepared_behind_pooler" not in worker.log_text()
    time.sleep(0.5)  # past the first (empty) poll: it now waits up to 10 s
    for _ in range(3):
        enqueued = time.monotonic()
        job_id = worker_db.enqueue("sleepy")
        wait_until(lambda: worker_db.started(job_id), timeout=poll_interval, message="woken")  # noqa: B023
        assert time.monotonic() - enqueued < poll_interval / 5
    ids = worker_db.enqueue_many(MIXED)
    wait_until(
        lambda: worker_db.all_succeeded(len(ids) + 3), timeout=30, message="every job succeeds"
    )
    assert worker_db.result(ids[0]) == {"attempt": 1}
    worker.send(signal.SIGTERM)
    assert worker.wait(10) == 0
    assert server_lock_timeouts(pgbouncer, worker_db.url) == {"0"}


@pytest.mark.slow
def test_worker_polls_without_a_listen_url(
    worker_db: JobDatabase, bounced_workers: Workers, pgbouncer: PgBouncer
) -> None:
    worker = bounced_workers.start(poll_interval="0.3s")
    worker.wait_log("action=behind_pooler")
    ids = worker_db.enqueue_many(MIXED)
    poison = worker_db.enqueue("poison")
    wait_until(
        lambda: worker_db.all_succeeded(len(ids)) and worker_db.status(poison) == "dead",
        timeout=30,
        message="every job succeeds and the poison job is dead",
    )
    assert worker_db.job(poison).attempts == 3
    assert worker_db.result(ids[0]) == {"attempt": 1}
    worker.send(signal.SIGTERM)
    assert worker.wait(10) == 0
    log = worker.log_text()
    assert "no LISTEN: new jobs are found by polling every 0.3s" in log
    assert "listener_connected" not in log
    assert "action=database_error" not in log
    assert server_lock_timeouts(pgbouncer, worker_db.url) == {"0"}


@pytest.mark.slow
def test_sigterm_ends_lock_mode_transactions_behind_the_pooler(
    worker_db: JobDatabase, bounced_workers: Workers
) -> None:
    # At shutdown the worker ends its own lock-mode transactions by backend pid: behind a
    # pooler it must ask the server for the pid, not trust the pooler's stand-in.
    long = {"sleep": 60, "sleep_attempts": [1]}
    ids = worker_db.enqueue_many([("sleepy_locked", long), ("sleepy", long)])
    worker = bounced_workers.start(concurrency=2, grace="1s")
    # A worker process starts in seconds, more on a busy machine (seen: 15 s not enough).
    wait_until(lambda: all(worker_db.started(i) for i in ids), timeout=45, message="started")
    stopped_at = time.monotonic()
    worker.send(signal.SIGTERM)
    assert worker.wait(15) == 0
    assert time.monotonic() - stopped_at < 10
    for job_id in ids:
        job = worker_db.job(job_id)
        assert (job.status, job.attempts) == ("pending", 1)  # given back, not charged
    assert worker_db.effects(ids[0], "effect") == []  # the lock-mode work rolled back


@pytest.mark.slow
def test_worker_api_finds_the_pooler(
    worker_db: JobDatabase, pgbouncer: PgBouncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The handlers' own connections (worker_tasks.record) go through PgBouncer too.
    bounced = JobDatabase(pgbouncer_url(pgbouncer, worker_db.url))
    monkeypatch.setenv(worker_tasks.DATABASE_URL_VARIABLE, bounced.url)
    listen = sa.create_engine(worker_db.url, poolclass=sa.NullPool)
    try:
        options: dict[str, Any] = {"engine_options": {"connect_args": UNPREPARED}}
        with running(bounced, **options) as worker:
            assert worker.pooled
            assert not worker.health().listening
            job_id = worker_db.enqueue("sleepy")
            wait_until(lambda: worker_db.status(job_id) == "succeeded", timeout=10, message="done")
        with running(bounced, listen_engine=listen, **options) as worker:
            wait_until(lambda: worker.health().listening, timeout=10, message="listening")
            job_id = worker_db.enqueue("sleepy_locked")
            wait_until(lambda: worker_db.status(job_id) == "succeeded", timeout=10, message="done")
        with running(worker_db) as worker:  # direct: as before
            assert not worker.pooled
            wait_until(lambda: worker.health().listening, timeout=10, message="listening")
    finally:
        listen.dispose()
        bounced.dispose()
        worker_tasks.forget_engines()


# -- administration commands --------------------------------------------------------------


@pytest.mark.usefixtures("restore_root_logging")
def test_administration_commands(
    capsys: pytest.CaptureFixture[str], pooled: sa.Engine, pgbouncer: PgBouncer, direct_url: str
) -> None:
    from sqla_jobs import cli

    url = pgbouncer_url(pgbouncer, direct_url)
    common = ["--database-url", url, "--model", "models:EmailJob"]
    with Session(pooled) as session, session.begin():
        jobs = [EmailJob(task="t") for _ in range(14)]
        session.add_all(jobs)
        session.flush()
        ids = [job.id for job in jobs]
        session.execute(
            sa.update(EmailJob)
            .where(EmailJob.id.in_(ids[:12]))
            .values(status="succeeded", finished_at=sa.func.now() - sa.text("interval '2 d'"))
        )
        session.execute(
            sa.update(EmailJob)
            .where(EmailJob.id == ids[12])
            .values(status="dead", finished_at=sa.func.now(), last_error="ValueError: no")
        )

    def run(*args: str) -> str:
        status = cli.main([*args, *common])
        captured = capsys.readouterr()
        assert status == 0, captured.err
        return captured.out

    assert "ValueError: no" in run("status")
    assert run("retry", str(ids[12])) == f"job {ids[12]} is pending again\n"
    assert run("cancel", str(ids[13])) == f"job {ids[13]} is cancelled\n"
    # One job per batch: the same DELETE a dozen times on one pooled connection.
    out = run("prune", "--older-than", "1d", "--batch-size", "1")
    assert out == "pruned 12 finished jobs older than 24.0h\n"
    with pooled.connect() as connection:
        rows = connection.execute(sa.select(EmailJob.id, EmailJob.status)).all()
    left = {job_id: str(status) for job_id, status in rows}
    assert left == {ids[12]: "pending", ids[13]: "cancelled"}
