"""Pausing and resuming a queue: every claim form honours a pause (proven from the rows the
claim statements leave), running jobs finish, a resume lets the jobs run and wakes the
workers, and bad input is refused before any SQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from conftest import FreshDatabase, advance_clock
from in_process import enqueue
from models import EmailJob, ReportJob
from no_sql import no_sql
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import sqla_jobs
from sqla_jobs import ConfigurationError, InvalidJobError, JobStatus, cli, migrations
from sqla_jobs._queries.admin import TABLE_LAYOUT
from sqla_jobs.health import read_gauges
from sqla_jobs.schema import names
from sqla_jobs.schema.pauses import pause_names, pause_table

EMAIL_JOBS: sa.Table = EmailJob.__table__  # type: ignore[assignment]


def claim(engine: sa.Engine, **options: Any) -> list[sqla_jobs.ClaimedJob]:
    with Session(engine) as session, session.begin():
        return sqla_jobs.claim(session, EmailJob, limit=50, **options)


def pause(engine: sa.Engine, queue: str, **options: Any) -> sqla_jobs.QueuePause:
    with Session(engine) as session, session.begin():
        return sqla_jobs.pause_queue(session, EmailJob, queue, **options)


def resume(engine: sa.Engine, queue: str) -> bool:
    with Session(engine) as session, session.begin():
        return sqla_jobs.resume_queue(session, EmailJob, queue)


def statuses(engine: sa.Engine) -> dict[int, str]:
    """Every job's status, read from the table (what the claims left)."""
    table = EmailJob.__table__
    with engine.connect() as connection:
        rows = connection.execute(sa.select(table.c.id, table.c.status))
        return {row.id: row.status for row in rows}


def jobs(queue: str, count: int, **fields: Any) -> list[EmailJob]:
    return [EmailJob(task="t", queue=queue, **fields) for _ in range(count)]


# The claim forms: plain (one queue, several), lock-held, keyed, limited, keyed and limited.
CLAIM_FORMS: dict[str, dict[str, Any]] = {
    "plain one queue": {"queues": ["paused"]},
    "plain several queues": {"queues": ["paused", "open"]},
    "lock-held": {"queues": ["paused", "open"], "hold": True},
    "keyed": {"queues": ["paused", "open"], "keys": True},
    "keyed one queue": {"queues": ["paused"], "keys": True},
    "limited": {"queues": ["paused", "open"], "queue_limits": {"paused": 5, "open": 5}},
    "keyed limited": {
        "queues": ["paused", "open"],
        "keys": True,
        "queue_limits": {"paused": 10},
    },
}


@pytest.mark.parametrize("form", CLAIM_FORMS)
def test_no_claim_form_starts_a_paused_queues_jobs_and_a_resume_lets_them_run(
    queue_engine: sa.Engine, form: str
) -> None:
    options = CLAIM_FORMS[form]
    keyed = enqueue(
        queue_engine, *(EmailJob(task="t", queue="paused", ordering_key=f"k{i}") for i in range(3))
    )
    paused = [*enqueue(queue_engine, *jobs("paused", 3)), *keyed]
    open_ids = enqueue(queue_engine, *jobs("open", 2))
    pause(queue_engine, "paused")

    claimed = claim(queue_engine, **options)

    status = statuses(queue_engine)
    assert all(status[job_id] == "pending" for job_id in paused)
    assert {job.queue for job in claimed} <= {"open"}
    if "open" in options["queues"]:
        assert {job.id for job in claimed} == set(open_ids)
    assert resume(queue_engine, "paused") is True
    again = claim(queue_engine, **options)
    # (A plain claim never takes keyed jobs: a keyed claim takes them.)
    wanted = set(paused) if options.get("keys") else set(paused) - set(keyed)
    assert wanted <= {job.id for job in again}


def test_a_paused_queues_expired_leases_wait_for_the_resume(queue_engine: sa.Engine) -> None:
    (job_id,) = enqueue(queue_engine, *jobs("paused", 1))
    (first,) = claim(queue_engine, queues=["paused"], lease=30)
    pause(queue_engine, "paused")
    advance_clock(queue_engine, EmailJob, 60)  # its lease has run out: its worker died

    assert claim(queue_engine, queues=["paused"]) == []
    assert statuses(queue_engine)[job_id] == "running"

    resume(queue_engine, "paused")
    (taken_over,) = claim(queue_engine, queues=["paused"])
    assert (taken_over.id, taken_over.attempt) == (first.id, first.attempt + 1)


def test_jobs_running_in_a_paused_queue_finish(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs("paused", 2))
    done, failed = claim(queue_engine, queues=["paused"])
    pause(queue_engine, "paused")

    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, done)
        sqla_jobs.fail(session, failed, "boom", delay=0.001)

    status = statuses(queue_engine)
    assert status[done.id] == JobStatus.SUCCEEDED.value
    assert status[failed.id] == JobStatus.PENDING.value  # its retry waits for the resume
    assert claim(queue_engine, queues=["paused"]) == []
    resume(queue_engine, "paused")
    assert [job.id for job in claim(queue_engine, queues=["paused"])] == [failed.id]


def test_a_queue_without_jobs_can_be_paused_and_holds_its_first_job(
    queue_engine: sa.Engine,
) -> None:
    made = pause(queue_engine, "later", reason="not yet")
    enqueue(queue_engine, *jobs("later", 1))

    assert claim(queue_engine, queues=["later"]) == []
    assert (made.queue, made.reason) == ("later", "not yet")


def test_pause_and_resume_are_idempotent(queue_engine: sa.Engine) -> None:
    first = pause(queue_engine, "q", reason="maintenance")
    second = pause(queue_engine, "q")
    third = pause(queue_engine, "q", reason="still")

    assert second.paused_at == first.paused_at == third.paused_at
    assert (second.reason, third.reason) == ("maintenance", "still")
    with Session(queue_engine) as session:
        (listed,) = sqla_jobs.paused_queues(session, EmailJob)
    assert (listed.queue, listed.reason, listed.paused_at) == ("q", "still", first.paused_at)
    assert listed.paused_seconds is not None
    assert listed.paused_seconds >= 0
    assert resume(queue_engine, "q") is True
    assert resume(queue_engine, "q") is False
    with Session(queue_engine) as session:
        assert sqla_jobs.paused_queues(session, EmailJob) == []


def test_a_pause_is_per_job_table(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs("shared", 1))
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.pause_queue(session, ReportJob, "shared")
        session.add(ReportJob(task="r", queue="shared"))

    assert len(claim(queue_engine, queues=["shared"])) == 1
    with Session(queue_engine) as session, session.begin():
        assert sqla_jobs.claim(session, ReportJob, queues=["shared"]) == []


def test_a_pause_rolled_back_pauses_nothing(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs("q", 1))
    with Session(queue_engine) as session:
        sqla_jobs.pause_queue(session, EmailJob, "q")
        session.rollback()

    assert len(claim(queue_engine, queues=["q"])) == 1


def test_a_resume_wakes_the_listeners_of_the_queue(queue_engine: sa.Engine) -> None:
    pause(queue_engine, "q")
    url = queue_engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    channel = names(EmailJob.__tablename__).channel
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{channel}"')
        resume(queue_engine, "q")
        resume(queue_engine, "q")  # not paused any more: sends nothing
        pause(queue_engine, "q")  # a pause sends nothing either
        heard = [n.payload for n in listener.notifies(timeout=2.0, stop_after=2)]

    assert heard == ["q"]


def test_status_gauges_show_paused_queues(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs("busy", 2), *jobs("open", 1))
    pause(queue_engine, "busy", reason="deploy")
    pause(queue_engine, "idle")

    with Session(queue_engine) as session:
        gauges = read_gauges(session, EmailJob)

    by_queue = {q.queue: q for q in gauges.queues}
    assert (by_queue["busy"].paused, by_queue["busy"].pending) == (True, 2)
    assert (by_queue["idle"].paused, by_queue["idle"].pending) == (True, 0)
    assert by_queue["open"].paused is False
    assert gauges.paused == ("busy", "idle")


BAD_QUEUES: list[Any] = ["", "x" * 201, "with space", "!cancel", None, 3]


@pytest.mark.parametrize("queue", BAD_QUEUES)
def test_a_malformed_queue_is_refused_before_any_sql(queue_engine: sa.Engine, queue: Any) -> None:
    with no_sql(queue_engine), Session(queue_engine) as session:
        with pytest.raises(InvalidJobError, match="queue"):
            sqla_jobs.pause_queue(session, EmailJob, queue)
        with pytest.raises(InvalidJobError, match="queue"):
            sqla_jobs.resume_queue(session, EmailJob, queue)


@pytest.mark.parametrize("reason", [3, b"bytes", "x" * 1001, "nul\x00"])
def test_a_bad_reason_is_refused_before_any_sql(queue_engine: sa.Engine, reason: Any) -> None:
    with (
        no_sql(queue_engine),
        Session(queue_engine) as session,
        pytest.raises(InvalidJobError, match="reason"),
    ):
        sqla_jobs.pause_queue(session, EmailJob, "q", reason=reason)


def test_a_model_that_is_not_a_job_model_is_refused_before_any_sql(
    queue_engine: sa.Engine,
) -> None:
    with no_sql(queue_engine), Session(queue_engine) as session:
        for call in (sqla_jobs.pause_queue, sqla_jobs.resume_queue):
            with pytest.raises(ConfigurationError):
                call(session, object, "q")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            sqla_jobs.paused_queues(session, object)  # type: ignore[arg-type]


def test_every_job_model_has_a_pause_table_in_its_metadata() -> None:
    for model in (EmailJob, ReportJob):
        table = pause_table(model)
        assert table.name == pause_names(model.__tablename__).table
        assert table.metadata is model.metadata
        assert [c.name for c in table.primary_key] == ["queue"]


@pytest.fixture
def scratch_engine(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(fresh_database("sqla_jobs_pauses"), poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


def migrate(engine: sa.Engine, step: Callable[[], object]) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(connection)
        with Operations.context(context), context.begin_transaction():
            step()


def test_the_migration_helper_makes_the_table_the_model_declares(
    scratch_engine: sa.Engine,
) -> None:
    declared = sa.MetaData()
    pause_table(EmailJob).to_metadata(declared)

    migrate(scratch_engine, lambda: migrations.create_pause_table("email_jobs"))
    migrate(scratch_engine, lambda: migrations.create_pause_table("email_jobs"))  # re-runnable

    with scratch_engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "compare_server_default": True}
        )
        assert compare_metadata(context, declared) == []
    with scratch_engine.connect() as connection:  # what a worker's start-up check asks
        (layout,) = TABLE_LAYOUT.rows(connection, EMAIL_JOBS, {})
        assert layout.pauses is True
    migrate(scratch_engine, lambda: migrations.drop_pause_table("email_jobs"))
    migrate(scratch_engine, lambda: migrations.drop_pause_table("email_jobs"))
    assert not sa.inspect(scratch_engine).has_table("email_jobs_pauses")
    with scratch_engine.connect() as connection:
        (layout,) = TABLE_LAYOUT.rows(connection, EMAIL_JOBS, {})
        assert layout.pauses is False


@pytest.mark.usefixtures("restore_root_logging")
def test_the_commands_pause_and_resume_and_status_shows_the_paused_queues(
    capsys: pytest.CaptureFixture[str], queue_engine: sa.Engine
) -> None:
    enqueue(queue_engine, *jobs("mail", 1))
    url = queue_engine.url.render_as_string(hide_password=False)
    common = ["--database-url", url, "--model", "models:EmailJob"]

    def run(*args: str) -> tuple[int, str, str]:
        status = cli.main([*args[:1], *common, *args[1:]])
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    status, out, _ = run("pause", "mail", "--reason", "deploy")
    assert status == 0
    assert out.startswith("queue mail is paused (since ")
    assert claim(queue_engine, queues=["mail"]) == []
    status, out, _ = run("status")
    assert status == 0
    (mail,) = [line.split() for line in out.splitlines() if line.startswith("mail ")]
    assert mail[:6] == ["mail", "1", "1", "0", "0", "0"]
    assert mail[-1].endswith("s")  # paused for that long
    assert "paused: mail (no job of theirs starts until sqla-jobs resume QUEUE)" in out
    assert run("health")[1].endswith("; paused: mail\n")

    assert run("resume", "mail")[:2] == (0, "queue mail is resumed\n")
    assert run("resume", "mail")[:2] == (0, "queue mail was not paused\n")
    assert len(claim(queue_engine, queues=["mail"])) == 1
    status, _, err = run("pause", "bad name")
    assert status == 1
    assert err.startswith("sqla-jobs: error: queue: 'bad name' is malformed")


def test_the_dashboard_pauses_and_resumes_a_queue(queue_engine: sa.Engine) -> None:
    pytest.importorskip("starlette", reason="the dashboard extra")
    from dashboard_pages import csrf_of
    from starlette.testclient import TestClient

    from sqla_jobs.dashboard import create_app

    enqueue(queue_engine, *jobs("mail", 1))
    with TestClient(create_app(queue_engine, EmailJob)) as client:
        csrf = csrf_of(client, "/")
        assert 'id="pause-mail"' in client.get("/").text
        paused = client.post("/queues/mail/pause", data={"csrf": csrf}, follow_redirects=False)
        assert paused.status_code == 303
        assert claim(queue_engine, queues=["mail"]) == []
        assert 'id="resume-mail"' in client.get("/").text
        forged = client.post("/queues/mail/resume", data={"csrf": "forged"})
        assert forged.status_code == 403
        bad = client.post("/queues/bad%20name/pause", data={"csrf": csrf})
        assert bad.status_code == 400
        assert client.post("/queues/mail/explode", data={"csrf": csrf}).status_code == 404
        resumed = client.post("/queues/mail/resume", data={"csrf": csrf}, follow_redirects=False)
        assert resumed.status_code == 303
    assert len(claim(queue_engine, queues=["mail"])) == 1
    with TestClient(create_app(queue_engine, EmailJob, read_only=True)) as client:
        page = client.get("/").text
        assert 'id="pause-mail"' not in page
        assert client.post("/queues/mail/pause", data={"csrf": csrf}).status_code == 403


def test_the_metrics_export_the_paused_queues(queue_engine: sa.Engine) -> None:
    pytest.importorskip("prometheus_client", reason="the metrics extra")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sqla_jobs.health import GaugeCache
    from sqla_jobs.metrics import OTHER, GaugeCollector, LabelValues

    enqueue(queue_engine, *jobs("mail", 1), *jobs("open", 1))
    for name in ("mail", "stranger-1", "stranger-2"):
        pause(queue_engine, name)
    registry = CollectorRegistry()
    cache = GaugeCache(queue_engine, EmailJob)
    registry.register(GaugeCollector(cache, LabelValues(queues={"mail", "open"})))

    text = generate_latest(registry).decode()

    paused = {
        sample.labels["queue"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sqla_jobs_queue_paused"
    }
    assert paused == {"mail": 1.0, "open": 0.0, OTHER: 2.0}


async def test_the_async_session_pauses_and_resumes(queue_async_engine: AsyncEngine) -> None:
    import sqla_jobs.aio

    async with AsyncSession(queue_async_engine) as session, session.begin():
        session.add(EmailJob(task="t", queue="mail"))
        await sqla_jobs.aio.pause_queue(session, EmailJob, "mail", reason="async")
    async with AsyncSession(queue_async_engine) as session, session.begin():
        assert await sqla_jobs.aio.claim(session, EmailJob, queues="mail") == []
        (paused,) = await sqla_jobs.aio.paused_queues(session, EmailJob)
        assert (paused.queue, paused.reason) == ("mail", "async")
        assert await sqla_jobs.aio.resume_queue(session, EmailJob, "mail") is True
    async with AsyncSession(queue_async_engine) as session, session.begin():
        assert len(await sqla_jobs.aio.claim(session, EmailJob, queues="mail")) == 1
