"""The history of a model with ``partitioned_history`` seen by health and the dashboard.

Dead jobs that moved into the history count in ``queue_stats``, ``dead_jobs``, ``sqla-jobs
status`` and ``sqla-jobs health`` (read from the history's dead index, never from the rest of
the history: the plan test); the dashboard lists and shows history jobs, retries them, and
refuses (409) to delete one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import cast

import pytest
import sqlalchemy as sa
from dashboard_pages import csrf_of, ids_on
from history_jobs import enqueue, where
from models import ArchiveJob
from plans import explain_statement, plan_nodes
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

import sqla_jobs
from sqla_jobs import _queries as statements
from sqla_jobs import cli
from sqla_jobs import migrations as jobs
from sqla_jobs.dashboard import create_app
from sqla_jobs.history import create_partitions, history_names, history_table, list_partitions

JOBS = cast(sa.Table, ArchiveJob.__table__)
HISTORY = history_table(ArchiveJob)
NAMES = history_names("archive_jobs")

pytestmark = pytest.mark.usefixtures("history_default_partition_only")


def claim_one(engine: sa.Engine, queue: str = "default") -> sqla_jobs.ClaimedJob:
    with Session(engine) as session, session.begin():
        (job,) = sqla_jobs.claim(session, ArchiveJob, queues=queue)
        return job


def dead_in_history(engine: sa.Engine, queue: str = "default", error: str = "boom") -> int:
    job_id = enqueue(engine, queue=queue, max_attempts=1, args={"n": 7})
    job = claim_one(engine, queue)
    with Session(engine) as session, session.begin():
        sqla_jobs.fail(session, job, RuntimeError(error))
    assert where(engine, job_id) == (0, 1)
    return job_id


# -- health ------------------------------------------------------------------------------


def test_dead_jobs_in_the_history_count_and_are_listed(queue_engine: sa.Engine) -> None:
    history_dead = dead_in_history(queue_engine, queue="mail", error="history boom")
    # A dead job still in the hot table (finished before the model had a history).
    with queue_engine.begin() as connection:
        hot_dead = connection.execute(
            sa.insert(JOBS)
            .values(queue="mail", task="t", status="dead", attempts=3, finished_at=sa.func.now())
            .returning(JOBS.c.id)
        ).scalar_one()
    enqueue(queue_engine, queue="mail")
    with Session(queue_engine) as session:
        stats = {
            (s.queue, s.status.value): s.count for s in sqla_jobs.queue_stats(session, ArchiveJob)
        }
        assert stats == {("mail", "dead"): 2, ("mail", "pending"): 1}
        dead = sqla_jobs.dead_jobs(session, ArchiveJob, limit=10)
        assert {d.id for d in dead} == {history_dead, hot_dead}
        (from_history,) = [d for d in dead if d.id == history_dead]
        assert from_history.queue == "mail"
        assert from_history.last_error is not None
        assert "history boom" in from_history.last_error
        # The limit applies to both tables together, newest first.
        (newest,) = sqla_jobs.dead_jobs(session, ArchiveJob, limit=1)
        assert newest.id == dead[0].id
        gauges = sqla_jobs.health.read_gauges(session, ArchiveJob)
        assert gauges.dead == 2


@pytest.mark.usefixtures("restore_root_logging")
def test_status_and_health_commands_count_the_history(
    queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = queue_engine.url.render_as_string(hide_password=False)
    monkeypatch.setenv(cli.DATABASE_URL_VARIABLE, url)
    job_id = dead_in_history(queue_engine, queue="mail")
    model = ["--model", "models:ArchiveJob"]
    assert cli.main(["status", *model]) == 0
    out = capsys.readouterr().out
    assert "dead jobs (1; all):" in out
    assert str(job_id) in out.split("dead jobs (1; all):")[1]
    assert cli.main(["health", *model, "--max-dead", "0"]) == cli.UNHEALTHY
    out = capsys.readouterr().out
    assert out == "unhealthy: 1 dead jobs (max 0)\n"


SEEDED = 60_000


@pytest.fixture
def seeded_history(queue_engine: sa.Engine) -> sa.Engine:
    """A history of many succeeded jobs and a few dead ones in each partition (yesterday's
    in the DEFAULT one, today's and tomorrow's in theirs), vacuumed and analyzed."""
    create_partitions(queue_engine, ArchiveJob, days_ahead=1)
    columns = [c.name for c in JOBS.columns]
    with queue_engine.begin() as connection:
        connection.execute(sa.text("ALTER TABLE archive_jobs DISABLE TRIGGER USER"))
        connection.execute(
            sa.text(
                "INSERT INTO archive_jobs (queue, task, status, attempts, finished_at) "
                "SELECT 'q' || (n % 4), 'done', "
                "CASE WHEN n % 4999 = 0 THEN 'dead' ELSE 'succeeded' END, 1, "
                "now() + (n % 3 - 1) * interval '1 day' "
                "FROM generate_series(1, :n) AS n"
            ),
            {"n": SEEDED},
        )
        connection.execute(sa.text("ALTER TABLE archive_jobs ENABLE TRIGGER USER"))
        connection.execute(
            sa.insert(HISTORY).from_select(columns, sa.select(*(JOBS.c[c] for c in columns)))
        )
        connection.execute(sa.delete(JOBS))
    with queue_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text("VACUUM ANALYZE archive_jobs_history"))
        connection.execute(sa.text("VACUUM ANALYZE archive_jobs"))
    return queue_engine


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_the_history_is_read_through_its_dead_index(
    seeded_history: sa.Engine, generic: bool
) -> None:
    with seeded_history.connect() as connection:
        partitions = set(
            connection.execute(
                sa.text(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    "WHERE i.inhparent = to_regclass(:index)"
                ),
                {"index": NAMES.dead_index},
            ).scalars()
        )
        tables = {p.name for p in list_partitions(seeded_history, ArchiveJob)}
        assert len(partitions) == len(tables) >= 2  # one dead index on each partition
        if generic:
            connection.execute(sa.text("SET plan_cache_mode = force_generic_plan"))
        reads = {
            "queue_stats": statements.queue_stats(JOBS, history=HISTORY),
            "dead_jobs": statements.dead_jobs(JOBS, history=HISTORY).params(limit=10),
        }
        for name, statement in reads.items():
            plan = explain_statement(connection, statement)
            nodes = list(plan_nodes(plan["Plan"]))
            on_history = [n for n in nodes if n.get("Relation Name", "") in tables]
            assert on_history, (name, json.dumps(plan))
            # Each partition is read through its dead index (an index scan, or a bitmap heap
            # scan over a bitmap index scan of it), never sequentially.
            assert all(n["Node Type"] != "Seq Scan" for n in on_history), (name, plan)
            indexes = [n["Index Name"] for n in nodes if "Index Name" in n]
            assert indexes, (name, plan)
            history_indexes = {i for i in indexes if i.startswith(NAMES.table)}
            assert history_indexes == partitions, (name, plan)
            if name == "queue_stats":  # counted from the index alone
                assert {n["Node Type"] for n in on_history} == {"Index Only Scan"}, plan
            if name == "dead_jobs":
                # The newest first, backwards along each partition's index: it stops at
                # the limit instead of reading every dead job of the history.
                assert {(n["Node Type"], n.get("Scan Direction")) for n in on_history} == {
                    ("Index Scan", "Backward")
                }, json.dumps(plan)
            # A few pages, not the history's hundreds.
            blocks = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"].get("Shared Read Blocks", 0)
            assert blocks < 100, (name, plan["Plan"])
            rows = connection.execute(statement).all()
            if name == "queue_stats":
                assert sum(r.total for r in rows) == SEEDED // 4999
            else:
                assert len(rows) == 10
        connection.rollback()


# -- the dashboard -----------------------------------------------------------------------


@pytest.fixture
def client(queue_engine: sa.Engine) -> Iterator[TestClient]:
    with TestClient(create_app(queue_engine, ArchiveJob)) as client:
        yield client


def test_the_dashboard_lists_and_shows_history_jobs(
    client: TestClient, queue_engine: sa.Engine
) -> None:
    succeeded = enqueue(queue_engine, args={"to": "a@example.com"}, tenant="acme")
    job = claim_one(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job, result={"receipt": "R-42"})
    dead = dead_in_history(queue_engine, error="card <declined>")
    pending = enqueue(queue_engine)
    assert where(queue_engine, succeeded) == (0, 1)

    overview = client.get("/")
    assert overview.status_code == 200
    row = re.search(r'<tr data-queue="default">(.*?)</tr>', overview.text, re.S)
    assert row is not None
    cells = re.findall(r'<td class="num">(?:<a [^>]*>)?(?:<span [^>]*>)?([^<]+)<', row.group(1))
    # pending running dead (the history's dead job), oldest pending, succeeded 5 min / 1 h,
    # dead 1 h: the throughput counts the history's finished jobs
    assert cells[:3] == ["1", "0", "1"]
    assert cells[4:] == ["1", "1", "1"]

    listed = client.get("/jobs")
    assert listed.status_code == 200
    assert ids_on(listed.text) == [pending, dead, succeeded]
    only_dead = client.get("/jobs", params={"status": "dead"})
    assert ids_on(only_dead.text) == [dead]

    page = client.get(f"/jobs/{succeeded}")
    assert page.status_code == 200
    assert 'id="job-status">succeeded' in page.text
    assert 'id="in-history"' in page.text
    assert "&#34;receipt&#34;: &#34;R-42&#34;" in page.text  # its result, from the history row
    assert "&#34;to&#34;: &#34;a@example.com&#34;" in page.text
    assert 'id="delete"' not in page.text
    page = client.get(f"/jobs/{dead}")
    assert 'id="attempts">1 of 1' in page.text
    assert "card &lt;declined&gt;" in page.text
    assert 'id="retry"' in page.text
    assert 'id="delete"' not in page.text
    assert client.get(f"/jobs/{pending}").text.count('id="in-history"') == 0
    assert client.get("/jobs/999999").status_code == 404


def test_the_dashboard_retries_a_history_job_and_refuses_to_delete_one(
    client: TestClient, queue_engine: sa.Engine
) -> None:
    dead = dead_in_history(queue_engine)
    other = dead_in_history(queue_engine)
    csrf = csrf_of(client, f"/jobs/{dead}")
    refused = client.post(f"/jobs/{other}/delete", data={"csrf": csrf})
    assert refused.status_code == 409
    assert "pruned by whole partitions" in refused.text
    assert "nothing was changed" in refused.text
    assert where(queue_engine, other) == (0, 1)
    retried = client.post(f"/jobs/{dead}/retry", data={"csrf": csrf})
    assert retried.status_code == 200  # after the 303 to the job's page
    assert 'id="notice">Job pending again.' in retried.text
    assert 'id="job-status">pending' in retried.text
    assert where(queue_engine, dead) == (1, 0)
    # Back in the hot table, it is deleted like any pending job.
    deleted = client.post(f"/jobs/{dead}/delete", data={"csrf": csrf})
    assert deleted.status_code == 200
    assert where(queue_engine, dead) == (0, 0)
    assert client.post(f"/jobs/{dead}/retry", data={"csrf": csrf}).status_code == 404


def test_check_job_tables_wants_the_history_dead_index(queue_engine: sa.Engine) -> None:
    with queue_engine.connect() as connection:
        assert jobs.check_job_tables(connection, ArchiveJob) == []
        connection.execute(sa.text(f'DROP INDEX "{NAMES.dead_index}"'))
        (problem,) = jobs.check_job_tables(connection, ArchiveJob)
        assert f"has no dead index {NAMES.dead_index}" in problem
        connection.rollback()  # the index comes back
        assert jobs.check_job_tables(connection, ArchiveJob) == []
