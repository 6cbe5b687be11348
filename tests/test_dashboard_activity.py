"""The dashboard's pictures over HTTP, on a real database: each queue's last hour by minute
(finished, failed, depth) as inline SVG, and the failing jobs by task and error. The
screenshot check is in test_dashboard_browser.py, the plans in test_dashboard_plan.py."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import cast

import pytest
import sqlalchemy as sa
from dashboard_data import TRACEBACK, seed
from models import ArchiveJob, ArchiveJobHistory, EmailJob, EmailJobResult
from starlette.testclient import TestClient

from sqla_jobs._queries.dashboard import FAILURES, MINUTE_COUNTS, MINUTES
from sqla_jobs.dashboard import create_app
from sqla_jobs.dashboard.activity import Chart, depth_series, read_activity, read_failures
from sqla_jobs.dashboard.sources import TableSource
from sqla_jobs.errors import ConfigurationError


@pytest.fixture
def client(queue_engine: sa.Engine) -> Iterator[TestClient]:
    app = create_app(queue_engine, EmailJob, result_model=EmailJobResult)
    with TestClient(app) as client:
        yield client


def add(connection: sa.Connection, model: type[EmailJob | ArchiveJob], **values: object) -> int:
    values.setdefault("queue", "email")
    values.setdefault("task", "send")
    job_id: int = connection.execute(
        sa.insert(model).values(**values).returning(model.id)
    ).scalar_one()
    return job_id


def settled_minute(engine: sa.Engine) -> None:
    """Wait (with a deadline) until the database's clock is not in the last seconds of a
    minute, so that a test's writes and reads fall in the same minute, and each "k minutes
    ago" in the same bucket: MINUTES - 1 - k."""
    deadline = time.monotonic() + 10
    while True:
        with engine.connect() as connection:
            second = connection.execute(
                sa.select(sa.extract("second", sa.func.statement_timestamp()))
            ).scalar_one()
        if second < 50:
            return
        assert time.monotonic() < deadline, "the database's clock did not move on"
        time.sleep(0.5)


def ago(minutes: float) -> sa.ColumnElement[object]:
    return sa.func.statement_timestamp() - sa.text(f"interval '{minutes * 60} seconds'")


def chart(page: str, queue: str, kind: str) -> str:
    card = re.search(
        rf'<section class="chart-card" data-queue="{queue}">(.*?)</section>', page, re.S
    )
    assert card is not None, f"no card for {queue}"
    svg = re.search(rf'<svg class="chart {kind}"(.*?)</svg>', card.group(1), re.S)
    assert svg is not None, f"no {kind} chart for {queue}"
    return svg.group(0)


def test_depth_is_derived_back_from_now() -> None:
    # Now 3 unfinished; the last minute enqueued 2 and finished 1; the one before finished 4.
    assert depth_series(3, [0, 0, 2], [0, 4, 1]) == [6, 2, 3]
    # Lower bounds on a busy table never draw a depth below 0.
    assert depth_series(0, [0, 5], [0, 0]) == [0, 0]


def test_a_chart_of_nothing_draws_nothing_and_one_job_shows() -> None:
    empty = Chart.bars([0] * MINUTES, [0] * MINUTES)
    assert (empty.total, empty.lower, empty.upper) == (0, [], [])
    one = Chart.bars([0] * (MINUTES - 1) + [1], [0] * MINUTES)
    assert len(one.lower) == 1
    assert one.lower[0].height >= 1.5
    line = Chart.line([0, 2, 1])
    assert line.path.startswith("M")
    assert line.area.endswith("Z")


def test_activity_page_charts_each_queue(client: TestClient, queue_engine: sa.Engine) -> None:
    settled_minute(queue_engine)
    with queue_engine.begin() as connection:
        for minutes in (0, 0, 10):
            add(
                connection,
                EmailJob,
                status="succeeded",
                created_at=ago(minutes + 1),
                finished_at=ago(minutes),
            )
        add(connection, EmailJob, status="dead", finished_at=ago(0), last_error=TRACEBACK)
        add(connection, EmailJob, queue="billing")  # pending, enqueued now
        add(connection, EmailJob, status="succeeded", finished_at=ago(120), created_at=ago(121))
    page = client.get("/activity")
    assert page.status_code == 200
    assert "<script" not in page.text
    email = chart(page.text, "email", "throughput")
    assert 'data-total="4"' in email  # the job of two hours ago is not charted
    assert len(re.findall(r'<rect class="succeeded"', email)) == 2  # minutes -10 and now
    assert len(re.findall(r'<rect class="dead"', email)) == 1
    # billing: one job waiting now, enqueued this minute: the depth line rises at the end.
    depth = chart(page.text, "billing", "depth")
    path = re.search(r'class="line" d="([^"]+)"', depth)
    assert path is not None
    heights = [float(point.split(",")[1]) for point in path.group(1)[1:].split(" L")]
    assert len(heights) == MINUTES
    assert heights[-1] < heights[0]  # SVG's y grows downwards
    assert 'href="/jobs?queue=billing"' in page.text
    # The counts behind it, read by minute.
    with queue_engine.connect() as connection:
        (billing, email_activity) = read_activity(
            connection, EmailJob, [TableSource(cast(sa.Table, EmailJob.__table__), 100)]
        )
    assert (billing.queue, email_activity.queue) == ("billing", "email")
    assert email_activity.succeeded[-1] == 2
    assert email_activity.succeeded[MINUTES - 11] == 1
    assert email_activity.dead[-1] == 1
    assert billing.depth[-1] == 1
    assert billing.depth[0] == 0


def test_activity_of_an_empty_table_and_bad_parameters(client: TestClient) -> None:
    page = client.get("/activity")
    assert page.status_code == 200
    assert 'id="no-activity"' in page.text
    assert client.get("/activity?x=1").status_code == 400
    assert client.get("/failures?x=1").status_code == 400
    empty = client.get("/failures")
    assert empty.status_code == 200
    assert 'id="no-failures"' in empty.text


def test_failures_are_grouped_by_task_and_error(
    client: TestClient, queue_engine: sa.Engine
) -> None:
    seed(queue_engine)  # one dead charge: ValueError
    with queue_engine.begin() as connection:
        for n in range(3):
            add(
                connection,
                EmailJob,
                task="charge",
                queue="billing",
                status="dead",
                finished_at=ago(n),
                last_error=f"Traceback ...\nValueError: card {n}\n",
            )
        newest = add(
            connection,
            EmailJob,
            task="charge",
            status="dead",
            finished_at=ago(0),
            last_error="Traceback ...\nKeyError: 'x'",
        )
        add(connection, EmailJob, task="send", status="dead", finished_at=ago(1))  # no error
        add(
            connection,
            EmailJob,
            task="send",
            status="dead",
            finished_at=ago(60 * 30),
            last_error="TimeoutError: long ago",
        )
        add(connection, EmailJob, task="send", status="pending", last_error="RuntimeError: x")
    page = client.get("/failures")
    assert page.status_code == 200
    rows = re.findall(
        r'<tr data-task="([^"]+)" data-error="([^"]+)">.*?<td class="num">(\d+)</td>',
        page.text,
        re.S,
    )
    assert rows == [
        ("charge", "ValueError", "4"),
        ("charge", "KeyError", "1"),
        ("send", "(no error recorded)", "1"),
    ]
    assert f'href="/jobs/{newest}"' in page.text
    assert 'href="/jobs?task=charge&amp;status=dead"' in page.text
    assert "KeyError: &#39;x&#39;" in page.text  # the newest's last line, escaped


def test_a_history_model_is_read_in_both_tables(queue_engine: sa.Engine) -> None:
    """ArchiveJob's finished jobs are in its partitioned history: the charts and the failures
    read both tables (the history's rows of the last hour / day only)."""
    history = ArchiveJobHistory.__table__
    jobs = cast(sa.Table, ArchiveJob.__table__)
    settled_minute(queue_engine)
    with queue_engine.begin() as connection:
        add(connection, ArchiveJob, status="running")
        for job_id, status, error in ((901, "succeeded", None), (902, "dead", "OSError: disk")):
            connection.execute(
                sa.insert(history).values(
                    id=job_id,
                    queue="email",
                    task="send",
                    status=status,
                    attempts=1,
                    max_attempts=3,
                    args={},
                    priority=0,
                    run_at=ago(3),
                    created_at=ago(3),
                    finished_at=ago(2),
                    last_error=error,
                )
            )
    sources = [TableSource(jobs, 100), TableSource(history, 100)]
    with queue_engine.connect() as connection:
        (activity,) = read_activity(connection, ArchiveJob, sources)
        failures = read_failures(connection, sources)
    # Enqueued 3 minutes ago, finished 2 minutes ago; the running one enqueued now.
    assert activity.succeeded[MINUTES - 3] == 1
    assert activity.dead[MINUTES - 3] == 1
    assert activity.unfinished_now == 1
    assert activity.depth[MINUTES - 5 :] == [0, 2, 0, 0, 1]
    assert [(f.task, f.error, f.jobs, f.latest_id) for f in failures] == [
        ("send", "OSError", 1, 902)
    ]
    app = create_app(queue_engine, ArchiveJob)
    with TestClient(app) as client:
        assert client.get("/activity").status_code == 200
        assert "OSError" in client.get("/failures").text


def test_the_window_must_be_positive() -> None:
    table = cast(sa.Table, EmailJob.__table__)
    for query in (MINUTE_COUNTS, FAILURES):
        with pytest.raises(ConfigurationError):
            query.statement(table, scan=0)
