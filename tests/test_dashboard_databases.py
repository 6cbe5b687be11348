"""One dashboard of several databases (:func:`sqla_jobs.dashboard.create_multi_app`, and
``sqla-jobs dashboard`` given ``--database-url`` once per database), on real databases.

Two databases hold different jobs under the same ids (each table counts from 1), so a page
or an action that went to the wrong database would show or change the other's job. The
databases page lists each one with its own counts, a database that is down is shown as such
while the others work, every link and form of a database's pages stays within it, and bad
input is refused before any SQL runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from dashboard_pages import csrf_of, ids_on
from models import Base, EmailJob
from no_sql import no_sql
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from sqla_jobs import cli
from sqla_jobs.dashboard import create_app, create_multi_app, database_name
from sqla_jobs.dashboard.app import AUTH_COOKIE
from sqla_jobs.errors import ConfigurationError

TOKEN = "s3cret-token-of-some-length"
#: A server that is not there: nothing listens on port 1 (refused at once). Its password
#: must never be shown.
DOWN_URL = "postgresql+psycopg://nobody:pa55word@127.0.0.1:1/none?connect_timeout=1"
#: Each database's jobs as (status, queue, task, order); ids are 1, 2, ... in this order.
JOBS = {
    "eu": [
        ("pending", "eu-mail", "send_receipt", "eu-1"),  # waiting 3 hours past its run_at
        ("pending", "eu-mail", "send_receipt", "eu-2"),
        ("dead", "eu-mail", "send_receipt", "eu-3"),
    ],
    "us": [
        ("pending", "us-mail", "send_receipt", "us-1"),
        ("running", "us-mail", "send_receipt", "us-2"),
        ("dead", "us-mail", "send_receipt", "us-3"),
        ("dead", "us-billing", "charge", "us-4"),
    ],
}


@dataclass(frozen=True)
class Databases:
    urls: dict[str, str]
    engines: dict[str, sa.Engine]


@pytest.fixture(scope="module")
def databases(fresh_database: FreshDatabase) -> Iterator[Databases]:
    """Two databases with tests/models.py's tables."""
    urls = {name: fresh_database("sqla_jobs_dbs") for name in JOBS}
    engines = {name: sa.create_engine(url) for name, url in urls.items()}
    for engine in engines.values():
        Base.metadata.create_all(engine)
    try:
        yield Databases(urls, engines)
    finally:
        for engine in engines.values():
            engine.dispose()


@pytest.fixture
def engines(databases: Databases) -> dict[str, sa.Engine]:
    """The two databases, emptied (ids from 1 again, no paused queue), each with its
    JOBS."""
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    for name, engine in databases.engines.items():
        with engine.begin() as connection:
            connection.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
            for status, queue, task, order in JOBS[name]:
                values: dict[str, Any] = {
                    "status": status,
                    "queue": queue,
                    "task": task,
                    "args": {"order": order},
                }
                if order == "eu-1":
                    values["run_at"] = sa.func.now() - sa.text("interval '3 hours'")
                if status == "running":
                    values |= {
                        "attempts": 1,
                        "leased_by": "host:2",
                        "lease_expires_at": sa.func.now() + sa.text("interval '1 hour'"),
                        "attempted_at": sa.func.now(),
                    }
                if status == "dead":
                    values |= {
                        "attempts": 3,
                        "max_attempts": 3,
                        "finished_at": sa.func.now(),
                        "last_error": f"ValueError: {order} failed",
                    }
                connection.execute(sa.insert(EmailJob).values(**values))
    return databases.engines


def statuses(engine: sa.Engine) -> dict[int, str]:
    """Each job's status, by id, from the database itself."""
    with engine.connect() as connection:
        rows = connection.execute(sa.select(EmailJob.id, EmailJob.status)).all()
    return {job_id: str(status) for job_id, status in rows}


def row_of(page: str, name: str) -> str:
    """The databases page's row of the database ``name``."""
    found = re.search(rf'<tr data-database="{re.escape(name)}"[^>]*>(.*?)</tr>', page, re.S)
    assert found is not None, f"no row for {name}"
    return found.group(0)


def counts(row: str) -> dict[str, str]:
    """A row's counts (or the footer's totals), by column."""
    cells = re.findall(r'data-(?:count|total)="([a-z_]+)">(?:<[^>]*>)*([^<]*)<', row)
    return dict(cells)


def state_of(row: str) -> str:
    found = re.search(r'data-state="([a-z]+)"', row)
    assert found is not None
    return found.group(1)


def links(page: str) -> list[str]:
    """Every link and form target of a page."""
    return re.findall(r'(?:href|action)="([^"]*)"', page)


# -- the databases page ----------------------------------------------------------------------


def test_the_databases_page_lists_each_database_with_its_own_counts(
    engines: dict[str, sa.Engine],
) -> None:
    with TestClient(create_multi_app(engines, EmailJob)) as client:
        page = client.get("/")
    assert page.status_code == 200
    assert "script" not in page.headers["content-security-policy"].replace("'none'", "")
    eu, us = row_of(page.text, "eu"), row_of(page.text, "us")
    assert page.text.index(eu) < page.text.index(us)  # in the order given
    assert (state_of(eu), state_of(us)) == ("ok", "ok")
    eu_counts, us_counts = counts(eu), counts(us)
    assert {k: v for k, v in eu_counts.items() if k != "oldest_runnable"} == {
        "pending": "2",
        "runnable": "2",
        "running": "0",
        "expired_leases": "0",
        "dead": "1",
    }
    assert {k: v for k, v in us_counts.items() if k != "oldest_runnable"} == {
        "pending": "1",
        "runnable": "1",
        "running": "1",
        "expired_leases": "0",
        "dead": "2",
    }
    # By each database's clock: eu's oldest runnable job waits 3 hours, us's just came.
    assert eu_counts["oldest_runnable"] == "3.0 h"
    assert re.fullmatch(r"\d+ s", us_counts["oldest_runnable"]), us_counts
    footer = page.text.split("<tfoot>")[1]
    assert counts(footer) == {
        "pending": "3",
        "runnable": "3",
        "running": "1",
        "expired_leases": "0",
        "dead": "3",
        "oldest_runnable": "3.0 h",
    }
    assert "all 2 databases" in footer
    # Each name links to its queues, each count to its database's jobs of that status.
    assert 'href="/db/eu/"' in eu
    assert 'href="/db/eu/jobs?status=dead"' in eu
    assert 'href="/db/us/jobs?status=running"' in us
    # Its server, never the user or the password.
    url = engines["us"].url
    assert f'<td class="server">{url.host}:{url.port}/{url.database}</td>' in us


def test_a_database_that_is_down_is_shown_as_such_and_the_others_work(
    engines: dict[str, sa.Engine], fresh_database: FreshDatabase
) -> None:
    down = sa.create_engine(DOWN_URL)
    bare = sa.create_engine(fresh_database("sqla_jobs_dbs"))  # no job table there
    app = create_multi_app(
        {"eu": engines["eu"], "down": down, "bare": bare, "us": engines["us"]}, EmailJob
    )
    try:
        with TestClient(app) as client:
            page = client.get("/")
            assert page.status_code == 200
            unreachable = row_of(page.text, "down")
            assert state_of(unreachable) == "unreachable"
            assert "Connection refused" in unreachable
            assert "pa55word" not in page.text
            assert '<td class="server">127.0.0.1:1/none</td>' in unreachable
            failed = row_of(page.text, "bare")
            assert state_of(failed) == "error"
            assert "relation &#34;email_jobs&#34; does not exist" in failed
            assert counts(row_of(page.text, "eu"))["pending"] == "2"
            assert counts(row_of(page.text, "us"))["dead"] == "2"
            footer = page.text.split("<tfoot>")[1]
            assert "the 2 of 4 databases that answered" in footer
            assert counts(footer)["dead"] == "3"
            # Its own pages say why, within it; the others' pages answer as usual.
            jobs = client.get("/db/down/jobs")
            assert jobs.status_code == 503
            assert "database error: " in jobs.text
            assert "pa55word" not in jobs.text
            assert 'id="database" title="the database of this page">down<' in jobs.text
            assert client.get("/db/us/jobs").status_code == 200
            assert ids_on(client.get("/db/eu/jobs").text) == [3, 2, 1]
    finally:
        down.dispose()
        bare.dispose()


# -- each database's pages -------------------------------------------------------------------


@pytest.mark.parametrize("mount", ["", "/admin/jobs"])
def test_each_databases_pages_show_its_jobs_and_link_within_it(
    engines: dict[str, sa.Engine], mount: str
) -> None:
    app = create_multi_app(engines, EmailJob)
    served = Starlette(routes=[Mount(mount, app)]) if mount else app
    with TestClient(served) as client:
        for name, jobs in JOBS.items():
            prefix = f"{mount}/db/{name}"
            listed = client.get(f"{prefix}/jobs")
            assert listed.status_code == 200
            assert ids_on(listed.text) == list(range(len(jobs), 0, -1))
            other = "us" if name == "eu" else "eu"
            assert f"{other}-mail" not in listed.text
            # The same id in each database: each page shows its own database's job.
            first = client.get(f"{prefix}/jobs/1")
            assert f"&#34;order&#34;: &#34;{name}-1&#34;" in first.text
            assert f"{other}-1" not in first.text
            dead = client.get(f"{prefix}/jobs/3")
            assert f"ValueError: {name}-3 failed" in dead.text
            assert f'action="{prefix}/jobs/3/retry"' in dead.text
            pages = [
                client.get(f"{prefix}/"),
                listed,
                first,
                dead,
                client.get(f"{prefix}/jobs?status=dead"),
                client.get(f"{prefix}/activity"),
                client.get(f"{prefix}/failures"),
                client.get(f"{prefix}/jobs/999"),  # its 404 too
            ]
            assert pages[-1].status_code == 404
            assert f"no job 999 in email_jobs of the database {name}" in pages[-1].text
            for page in pages:
                assert f'id="database" title="the database of this page">{name}<' in page.text
                for target in links(page.text):
                    # Within it; the way out is the Databases link, to the list.
                    assert target.startswith(f"{prefix}/") or target == f"{mount}/", target
        overview = client.get(f"{mount}/").text
        assert f'href="{mount}/db/eu/"' in overview


def test_an_action_changes_its_own_database_only(engines: dict[str, sa.Engine]) -> None:
    eu, us = engines["eu"], engines["us"]
    with TestClient(create_multi_app(engines, EmailJob)) as client:
        csrf = csrf_of(client, "/db/eu/jobs/3")
        retried = client.post("/db/eu/jobs/3/retry", data={"csrf": csrf}, follow_redirects=False)
        assert (retried.status_code, retried.headers["location"]) == (
            303,
            "/db/eu/jobs/3?done=retried",
        )
        assert statuses(eu)[3] == "pending"
        assert statuses(us)[3] == "dead"  # us's job 3, the same id: untouched
        cancelled = client.post("/db/us/jobs/1/cancel", data={"csrf": csrf})
        assert cancelled.url.path == "/db/us/jobs/1"
        assert 'id="notice">Job cancelled.' in cancelled.text
        assert statuses(us)[1] == "cancelled"
        assert statuses(eu)[1] == "pending"
        # A job that is in the other database only.
        missing = client.post("/db/eu/jobs/4/retry", data={"csrf": csrf})
        assert missing.status_code == 404
        assert "no job 4 in email_jobs of the database eu" in missing.text
        assert statuses(us)[4] == "dead"
        # Pausing a queue pauses it in that database only, and back on its page.
        paused = client.post("/db/us/queues/us-mail/pause", data={"csrf": csrf})
        assert paused.url.path == "/db/us/"
        listed = client.get("/").text
        assert '<td class="paused">us-mail</td>' in row_of(listed, "us")
        assert '<td class="paused"></td>' in row_of(listed, "eu")
        resumed = client.post("/db/us/queues/us-mail/resume", data={"csrf": csrf})
        assert resumed.url.path == "/db/us/"
        assert '<td class="paused"></td>' in row_of(client.get("/").text, "us")


def test_read_only_refuses_the_actions_of_every_database(engines: dict[str, sa.Engine]) -> None:
    before = {name: statuses(engine) for name, engine in engines.items()}
    with TestClient(create_multi_app(engines, EmailJob, read_only=True)) as client:
        for name in engines:
            page = client.get(f"/db/{name}/jobs/3")
            assert 'id="read-only"' in page.text
            assert '<form method="post"' not in page.text
            refused = client.post(f"/db/{name}/jobs/3/retry", data={"csrf": "any"})
            assert refused.status_code == 403
    assert {name: statuses(engine) for name, engine in engines.items()} == before


def test_one_token_and_one_login_for_every_database(engines: dict[str, sa.Engine]) -> None:
    before = {name: statuses(engine) for name, engine in engines.items()}
    app = create_multi_app(engines, EmailJob, token=TOKEN, allowed_hosts=["testserver"])
    with TestClient(app) as client:
        for path in ("/", "/db/eu/", "/db/us/jobs", "/db/nowhere/jobs"):
            missing = client.get(path)
            assert missing.status_code == 401, path
            assert 'action="/login"' in missing.text
            assert "eu, us" not in missing.text  # no database is named before the login
        assert client.post("/db/eu/jobs/3/retry", data={"csrf": "x"}).status_code == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert client.get("/db/us/jobs", headers=bearer).status_code == 200
        wrong = {"Authorization": "Bearer not-the-token-at-all"}
        assert client.get("/db/us/jobs", headers=wrong).status_code == 403
        logged_in = client.post("/login", data={"token": TOKEN, "next": "/db/eu/jobs?status=dead"})
        assert logged_in.url.path == "/db/eu/jobs"
        assert ids_on(logged_in.text) == [3]
        cookie = next(c for c in client.cookies.jar if c.name == AUTH_COOKIE)
        assert cookie.path == "/"  # one login for the list and every database
        assert client.get("/db/us/jobs").status_code == 200
        assert client.get("/").status_code == 200
        # An off-site "next" goes to the list of the databases.
        offsite = client.post("/login", data={"token": TOKEN, "next": "//evil.example/"})
        assert offsite.url.path == "/"
        assert 'id="nav-databases"' in offsite.text
        unknown = client.get("/db/nowhere/jobs")
        assert unknown.status_code == 404
        assert "no database named &#39;nowhere&#39; here (the databases: eu, us)" in unknown.text
        assert 'href="/"' in unknown.text  # back to the databases
    with TestClient(app, base_url="http://rebound.example") as client:
        assert client.get("/db/eu/", headers=bearer).status_code == 400
    assert {name: statuses(engine) for name, engine in engines.items()} == before


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({}, "engines is empty"),
        ([("eu", "eu")], "engines must be a mapping of database names to engines, not list"),
        ({"e u": "eu"}, "the database name 'e u' is not URL-safe"),
        ({"eu/x": "eu"}, "the database name 'eu/x' is not URL-safe"),
        ({"..": "eu"}, "the database name '..' is not URL-safe"),
        ({"": "eu"}, "the database name '' is not URL-safe"),
        ({"x" * 256: "eu"}, "is not URL-safe"),
        ({"eu": "eu", "EU": "us"}, "the database names 'eu' and 'EU' differ only by case"),
        ({"eu": "eu", "europe": "eu"}, "engines['eu'] and engines['europe'] are the same database"),
        ({"eu": "postgresql://x@y/z"}, "engines['eu'] must be a sqlalchemy Engine, not str"),
    ],
)
def test_bad_engines_are_refused_before_any_sql(
    engines: dict[str, sa.Engine], given: Any, says: str
) -> None:
    if isinstance(given, dict):
        given = {name: engines.get(value, value) for name, value in given.items()}
    with no_sql(engines["eu"]), no_sql(engines["us"]):
        with pytest.raises(ConfigurationError, match=re.escape(says)):
            create_multi_app(given, EmailJob)
        # create_app's own checks hold too.
        with pytest.raises(ConfigurationError, match="at least 16"):
            create_multi_app(engines, EmailJob, token="short")
        with pytest.raises(ConfigurationError, match="JobMixin"):
            create_multi_app(engines, Base)  # type: ignore[arg-type]


def test_the_routes_are_create_apps_under_each_databases_prefix(
    engines: dict[str, sa.Engine],
) -> None:
    """The databases' pages are the one-database pages under /db/{database}, as
    docs/operations/dashboard.md says; the login and the logout are the dashboard's own."""
    single = create_app(engines["eu"], EmailJob)
    several = create_multi_app(engines, EmailJob)
    one = {route.path for route in single.routes}  # type: ignore[attr-defined]
    paths = {route.path for route in several.routes}  # type: ignore[attr-defined]
    shared = {"/login", "/logout"}
    assert paths == {"/", *shared} | {f"/db/{{database}}{path}" for path in one - shared}
    text = (Path(__file__).parents[1] / "docs/operations/dashboard.md").read_text()
    section = text.split("## Several databases")[1].split("\n## ")[0]
    for shown in ("`/db/NAME/`", "`/db/NAME/jobs`", "`/db/NAME/jobs/{id}`", "`/login`"):
        assert shown in section


def test_database_name() -> None:
    assert database_name("postgresql+psycopg://app:pa55word@db-eu:5433/app") == "db-eu-5433-app"
    assert database_name(sa.make_url("postgresql://app@db-us/app")) == "db-us-app"
    assert database_name("postgresql://app@[::1]:5432/jobs") == "--1-5432-jobs"
    assert database_name("postgresql:///app") == "localhost-app"
    failover = "postgresql+psycopg://app:pa55word@/app?host=db1:5432&host=db2:5432"
    assert database_name(failover) == "db1-5432-db2-5432-app"
    assert database_name("postgresql://app@/app?host=/run/postgresql") == "-run-postgresql-app"


# -- sqla-jobs dashboard ---------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def no_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    """No database or replica URL in the environment: the command gets its as options."""
    for variable in (cli.DATABASE_URL_VARIABLE, cli.REPLICA_URL_VARIABLE):
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.usefixtures("restore_root_logging", "no_urls")
def test_the_command_serves_every_database_given(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    engines: dict[str, sa.Engine],
    databases: Databases,
) -> None:
    """``sqla-jobs dashboard --database-url A --database-url B``: the app it serves (here
    uvicorn's ``run`` is replaced by requests to the app) lists both databases, named
    from their URLs, and acts on each one's own jobs."""
    import uvicorn

    names = {region: database_name(url) for region, url in databases.urls.items()}
    served: list[str] = []

    def serve(app: Any, **_: Any) -> None:
        # On loopback without a token, it answers only this machine's names.
        with TestClient(app, base_url="http://127.0.0.1") as client:
            page = client.get("/")
            assert page.status_code == 200
            served.append(page.text)
            for region, name in names.items():
                assert state_of(row_of(page.text, name)) == "ok"
                jobs = client.get(f"/db/{name}/jobs")
                assert ids_on(jobs.text) == list(range(len(JOBS[region]), 0, -1))
            eu = names["eu"]
            csrf = csrf_of(client, f"/db/{eu}/jobs/3")
            done = client.post(f"/db/{eu}/jobs/3/retry", data={"csrf": csrf})
            assert done.url.path == f"/db/{eu}/jobs/3"
        with TestClient(app, base_url="http://rebound.example") as client:
            assert client.get("/").status_code == 400

    monkeypatch.setattr(uvicorn, "run", serve)
    urls = [arg for url in databases.urls.values() for arg in ("--database-url", url)]
    code, _, err = run(capsys, "dashboard", "--model", "models:EmailJob", *urls)
    assert code == 0, err
    assert f"/, 2 databases: {names['eu']}, {names['us']}\n" in err
    assert len(served) == 1
    assert statuses(engines["eu"])[3] == "pending"
    assert statuses(engines["us"])[3] == "dead"


@pytest.mark.usefixtures("restore_root_logging", "no_urls")
def test_the_command_with_one_database_serves_it_as_before(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    engines: dict[str, sa.Engine],
    databases: Databases,
) -> None:
    import uvicorn

    pages: list[str] = []

    def serve(app: Any, **_: Any) -> None:
        with TestClient(app, base_url="http://127.0.0.1") as client:
            pages.append(client.get("/").text)
            pages.append(client.get("/jobs").text)

    monkeypatch.setattr(uvicorn, "run", serve)
    url = databases.urls["us"]
    code, _, err = run(capsys, "dashboard", "--model", "models:EmailJob", "--database-url", url)
    assert code == 0, err
    assert "sqla-jobs dashboard on http://127.0.0.1:8400/\n" in err  # nothing more
    overview, jobs = pages
    assert '<tr data-queue="us-billing">' in overview
    assert 'id="nav-databases"' not in overview
    assert ids_on(jobs) == [4, 3, 2, 1]


@pytest.mark.usefixtures("restore_root_logging", "no_urls")
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            [
                "--database-url",
                DOWN_URL,
                "--database-url",
                DOWN_URL.replace("/none", "/other"),
                "--replica-url",
                DOWN_URL.replace("/none", "/replica"),
            ],
            "--replica-url reads one database's replica: give one --database-url with it",
        ),
        (
            ["--database-url", DOWN_URL, "--database-url", DOWN_URL],
            "--database-url names the same database twice",
        ),
        (
            [
                "--database-url",
                DOWN_URL,
                "--database-url",
                DOWN_URL.replace("nobody:pa55word", "somebody"),
            ],
            "--database-url names the database 127.0.0.1-1-none twice",
        ),
        (
            ["--database-url", DOWN_URL, "--database-url", "mysql://x@y/z"],
            "sqla_jobs needs PostgreSQL, not 'mysql'",
        ),
    ],
)
def test_the_command_refuses_bad_databases_before_anything_connects(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    says: str,
) -> None:
    import uvicorn

    def serve(app: Any, **_: Any) -> None:
        raise AssertionError("served despite bad databases")

    monkeypatch.setattr(uvicorn, "run", serve)
    code, out, err = run(capsys, "dashboard", "--model", "models:EmailJob", *args)
    assert (code, out) == (1, "")
    assert err.startswith("sqla-jobs: error: "), err
    assert says in err
    assert err.count("\n") == 1, err
    assert "pa55word" not in err
    assert "cannot reach" not in err  # refused before any connection was tried
