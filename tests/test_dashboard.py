"""The dashboard's pages and actions over HTTP (Starlette's TestClient), on a real database.

Every bad request gets an error page and leaves the jobs as they were. The browser tests
are in test_dashboard_browser.py.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import cast

import pytest
import sqlalchemy as sa
from dashboard_data import Seeded, seed, statuses
from dashboard_pages import Browser, csrf_of, ids_on, set_cookies
from in_process import enqueue
from models import EmailJob, EmailJobResult, ReportJob
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient
from test_cli import run_cli
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from worker_harness import subprocess_env

import sqla_jobs
from sqla_jobs import JobContext, Registry
from sqla_jobs._queries.dashboard import MAX_ID
from sqla_jobs.dashboard import access, create_app
from sqla_jobs.dashboard.access import SESSION_LIFETIME, SESSION_MAX_AGE
from sqla_jobs.dashboard.app import AUTH_COOKIE, CSRF_COOKIE
from sqla_jobs.dashboard.sources import ListQuery, TableSource, find_job, read_page
from sqla_jobs.errors import ConfigurationError, InvalidJobError, JobNotFoundError, JobStateError

TOKEN = "s3cret-token-of-some-length"


@pytest.fixture
def seeded(queue_engine: sa.Engine) -> Seeded:
    return seed(queue_engine)


@pytest.fixture
def client(queue_engine: sa.Engine) -> Iterator[TestClient]:
    app = create_app(queue_engine, EmailJob, result_model=EmailJobResult)
    with TestClient(app) as client:
        yield client


# -- pages --------------------------------------------------------------------------------


def test_overview_shows_queues_counts_and_throughput(client: TestClient, seeded: Seeded) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert "script" not in page.headers["content-security-policy"].replace("'none'", "")
    row = re.search(r'<tr data-queue="billing">(.*?)</tr>', page.text, re.S)
    assert row is not None
    cells = re.findall(r'<td class="num">(?:<a [^>]*>)?(?:<span [^>]*>)?([^<]+)<', row.group(1))
    # pending running dead, oldest pending, succeeded 5 min / 1 h, dead 1 h
    assert cells == ["0", "0", "1", "-", "1", "1", "1"]
    assert 'href="/jobs?queue=billing&amp;status=dead"' in page.text


def test_overview_of_an_empty_table(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert 'id="no-jobs"' in page.text


def test_job_list_filters(client: TestClient, seeded: Seeded) -> None:
    everything = client.get("/jobs")
    assert everything.status_code == 200
    assert ids_on(everything.text) == sorted(
        [seeded.pending, seeded.running, seeded.succeeded, seeded.dead, seeded.cancelled],
        reverse=True,
    )
    assert ids_on(client.get("/jobs?queue=billing").text) == [seeded.dead, seeded.succeeded]
    assert ids_on(client.get("/jobs?status=dead").text) == [seeded.dead]
    assert ids_on(client.get("/jobs?queue=email&task=send_receipt&status=pending").text) == [
        seeded.pending
    ]
    empty = client.get("/jobs?queue=nowhere")
    assert empty.status_code == 200
    assert ids_on(empty.text) == []
    assert 'id="no-match"' in empty.text


def test_keyset_pagination_walks_every_job_once(queue_engine: sa.Engine) -> None:
    with queue_engine.begin() as connection:
        connection.execute(
            sa.insert(EmailJob),
            [{"task": "even" if i % 2 == 0 else "odd", "queue": "q"} for i in range(23)],
        )
    app = create_app(queue_engine, EmailJob, page_size=5, scan=8)
    seen: list[int] = []
    sparse_pages = 0
    with TestClient(app) as client:
        path = "/jobs?task=even"
        for _ in range(20):
            page = client.get(path)
            assert page.status_code == 200
            seen += ids_on(page.text)
            sparse_pages += 'id="sparse"' in page.text
            older = re.search(r'href="([^"]+)" id="older"', page.text)
            if older is None:
                break
            path = older.group(1).replace("&amp;", "&")
    with queue_engine.connect() as connection:
        even = connection.execute(
            sa.select(EmailJob.id).where(EmailJob.task == "even").order_by(EmailJob.id.desc())
        ).scalars()
        assert seen == list(even)
    # 12 matches in 23 jobs, 8 read per page: some pages end at their window, not full.
    assert sparse_pages >= 1


def test_job_detail_shows_args_error_and_result(client: TestClient, seeded: Seeded) -> None:
    dead = client.get(f"/jobs/{seeded.dead}")
    assert dead.status_code == 200
    assert "3 of 3" in dead.text
    assert "&#34;amount&#34;: 12.5" in dead.text
    # The traceback, escaped: the page shows it, and no markup from it gets through.
    assert "ValueError: card &lt;declined&gt; &amp; &#39;refused&#39;" in dead.text
    assert "<declined>" not in dead.text
    assert 'id="retry"' in dead.text
    assert 'id="cancel"' not in dead.text
    succeeded = client.get(f"/jobs/{seeded.succeeded}")
    assert "R-77" in succeeded.text
    assert 'id="retry"' not in succeeded.text
    pending = client.get(f"/jobs/{seeded.pending}")
    assert "&lt;b&gt;bold&lt;/b&gt;" in pending.text
    assert 'id="cancel"' in pending.text
    running = client.get(f"/jobs/{seeded.running}")
    assert 'id="delete"' not in running.text
    assert "host:1" in running.text


# -- actions ------------------------------------------------------------------------------


def test_retry_cancel_and_delete(
    client: TestClient, seeded: Seeded, queue_engine: sa.Engine
) -> None:
    csrf = csrf_of(client, f"/jobs/{seeded.dead}")
    retried = client.post(f"/jobs/{seeded.dead}/retry", data={"csrf": csrf})
    assert retried.status_code == 200  # after the 303 to the job's page
    assert 'id="notice">Job pending again.' in retried.text
    cancelled = client.post(f"/jobs/{seeded.pending}/cancel", data={"csrf": csrf})
    assert 'id="notice">Job cancelled.' in cancelled.text
    deleted = client.post(f"/jobs/{seeded.succeeded}/delete", data={"csrf": csrf})
    assert deleted.url.path == "/jobs"
    after = statuses(queue_engine)
    assert after[seeded.dead] == "pending"
    assert after[seeded.pending] == "cancelled"
    assert seeded.succeeded not in after


def test_an_action_the_state_forbids_changes_nothing(
    client: TestClient, seeded: Seeded, queue_engine: sa.Engine
) -> None:
    before = statuses(queue_engine)
    csrf = csrf_of(client, f"/jobs/{seeded.dead}")
    for job_id, action in (
        (seeded.running, "delete"),
        (seeded.succeeded, "retry"),
        (seeded.dead, "cancel"),
    ):
        page = client.post(f"/jobs/{job_id}/{action}", data={"csrf": csrf})
        assert page.status_code == 409, (job_id, action)
        assert "nothing was changed" in page.text
    assert client.post("/jobs/999999/retry", data={"csrf": csrf}).status_code == 404
    assert client.post(f"/jobs/{seeded.dead}/explode", data={"csrf": csrf}).status_code == 404
    assert statuses(queue_engine) == before


def test_cancel_of_a_running_job_asks_its_worker(
    client: TestClient, seeded: Seeded, queue_engine: sa.Engine
) -> None:
    csrf = csrf_of(client, f"/jobs/{seeded.running}")
    page = client.post(f"/jobs/{seeded.running}/cancel", data={"csrf": csrf})
    assert page.status_code == 200  # after the redirect to the job's page
    assert "its worker was asked to stop it" in page.text
    with queue_engine.connect() as connection:
        status, requested = connection.execute(
            sa.text("SELECT status, cancel_requested_at FROM email_jobs WHERE id = :id"),
            {"id": seeded.running},
        ).one()
    assert status == "running"
    assert requested is not None


def test_csrf_is_required(client: TestClient, seeded: Seeded, queue_engine: sa.Engine) -> None:
    before = statuses(queue_engine)
    csrf_of(client, f"/jobs/{seeded.dead}")  # the cookie is set
    for data in ({}, {"csrf": "forged"}, {"csrf": ""}):
        page = client.post(f"/jobs/{seeded.dead}/retry", data=data)
        assert page.status_code == 403
        assert "CSRF" in page.text
    # Another site's form: the right field, but the browser sends no SameSite cookie.
    csrf = csrf_of(client, f"/jobs/{seeded.dead}")
    client.cookies.delete(CSRF_COOKIE)
    assert client.post(f"/jobs/{seeded.dead}/retry", data={"csrf": csrf}).status_code == 403
    assert statuses(queue_engine) == before


def test_read_only(queue_engine: sa.Engine, seeded: Seeded) -> None:
    before = statuses(queue_engine)
    with TestClient(create_app(queue_engine, EmailJob, read_only=True)) as client:
        page = client.get(f"/jobs/{seeded.dead}")
        assert page.status_code == 200
        assert 'id="read-only"' in page.text
        assert '<form method="post"' not in page.text
        cookie = page.cookies.get(CSRF_COOKIE) or client.cookies.get(CSRF_COOKIE)
        assert cookie
        for action in ("retry", "cancel", "delete"):
            refused = client.post(f"/jobs/{seeded.dead}/{action}", data={"csrf": cookie})
            assert refused.status_code == 403
            assert "read-only" in refused.text
    assert statuses(queue_engine) == before


# -- CSRF and the login cookie -----------------------------------------------------------

#: A well-formed CSRF nonce that someone else chose, and set as a cookie for the dashboard's
#: host (another service on the same host, whatever its port; a sibling subdomain).
FORGED_NONCE = "Forged-by-another-service-on-this-host-0123"


def job_rows(engine: sa.Engine) -> dict[int, tuple[str, bool]]:
    """Each job's status and whether a cancel was requested, from the table."""
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text("SELECT id, status, cancel_requested_at IS NOT NULL FROM email_jobs")
        )
        return {job_id: (status, requested) for job_id, status, requested in rows}


def actions(seeded: Seeded) -> list[tuple[int, str]]:
    """One of each action, each on a job whose status allows it."""
    return [
        (seeded.dead, "retry"),
        (seeded.pending, "cancel"),
        (seeded.running, "cancel"),
        (seeded.succeeded, "delete"),
    ]


def test_a_csrf_token_someone_else_chose_is_refused(
    queue_engine: sa.Engine, seeded: Seeded
) -> None:
    """Double submit is not enough: whoever can set a cookie for the host sets the nonce
    cookie and sends the same value in the field; or sends the pair another dashboard process
    made (another service on this host). Neither changes anything."""
    assert len(FORGED_NONCE) == 43
    before = job_rows(queue_engine)
    app = create_app(queue_engine, EmailJob)
    with TestClient(app) as client, TestClient(create_app(queue_engine, EmailJob)) as other:
        browser = Browser(client)
        legit = browser.csrf(f"/jobs/{seeded.dead}")
        own_nonce = browser.cookies[CSRF_COOKIE]
        elsewhere = Browser(other)
        made_elsewhere = elsewhere.csrf(f"/jobs/{seeded.dead}")
        for job_id, action in actions(seeded):
            path = f"/jobs/{job_id}/{action}"
            forged_pairs = [
                # The forged cookie alone, and after the dashboard's own: the server reads
                # the last of duplicate cookies.
                (f"{CSRF_COOKIE}={FORGED_NONCE}", FORGED_NONCE),
                (f"{CSRF_COOKIE}={own_nonce}; {CSRF_COOKIE}={FORGED_NONCE}", FORGED_NONCE),
                # The dashboard's own cookie, repeated in the field (double submit).
                (f"{CSRF_COOKIE}={own_nonce}", own_nonce),
                # A pair another dashboard process made, with a key of its own.
                (f"{CSRF_COOKIE}={elsewhere.cookies[CSRF_COOKIE]}", made_elsewhere),
                # The right token with another nonce.
                (f"{CSRF_COOKIE}={FORGED_NONCE}", legit),
            ]
            for cookie, field in forged_pairs:
                refused = browser.post(path, {"csrf": field}, cookie=cookie)
                assert refused.status_code == 403, (path, cookie)
                assert "CSRF token did not match" in refused.text
        assert job_rows(queue_engine) == before
        # The dashboard's own pair still works.
        retried = browser.post(f"/jobs/{seeded.dead}/retry", {"csrf": legit})
        assert retried.status_code == 303
    assert job_rows(queue_engine)[seeded.dead] == ("pending", False)


def login(browser: Browser, token: str = TOKEN) -> None:
    done = browser.post("/login", {"token": token, "next": "/"})
    assert done.status_code == 303, done.text


def test_logout_ends_the_browsers_login(queue_engine: sa.Engine, seeded: Seeded) -> None:
    with TestClient(create_app(queue_engine, EmailJob, token=TOKEN)) as client:
        browser = Browser(client)
        assert 'id="logout"' not in browser.get("/").text  # the login form: no one to log out
        login(browser)
        page = browser.get(f"/jobs/{seeded.dead}")
        found = re.search(
            r'id="logout"><input type="hidden" name="csrf" value="([^"]+)"', page.text
        )
        assert found is not None, page.text
        # Without the field of a page of this login: refused, still logged in.
        refused = browser.post("/logout", {"csrf": FORGED_NONCE})
        assert refused.status_code == 403
        assert AUTH_COOKIE not in set_cookies(refused)
        assert browser.get("/").status_code == 200
        done = browser.post("/logout", {"csrf": found.group(1)})
        assert (done.status_code, done.headers["location"]) == (303, "/login")
        deleted = set_cookies(done)[AUTH_COOKIE]
        assert (deleted.value, deleted["max-age"], deleted["path"]) == ("", "0", "/")
        del browser.cookies[AUTH_COOKIE]  # what a browser does with a cookie of Max-Age 0
        assert browser.get("/").status_code == 401
    with TestClient(create_app(queue_engine, EmailJob)) as client:  # no token, no login
        assert client.post("/logout", data={"csrf": "x"}).status_code == 404


def test_a_csrf_token_is_bound_to_the_login(queue_engine: sa.Engine, seeded: Seeded) -> None:
    """With a token, a form's CSRF token holds only for the login that drew it, and a login
    cookie that the server did not sign is refused, whatever CSRF pair comes with it."""
    before = job_rows(queue_engine)
    with TestClient(create_app(queue_engine, EmailJob, token=TOKEN)) as client:
        first = Browser(client)
        login(first)
        first_csrf = first.csrf(f"/jobs/{seeded.dead}")
        second = Browser(client)
        login(second)
        assert second.cookies[AUTH_COOKIE] != first.cookies[AUTH_COOKIE]
        second.csrf(f"/jobs/{seeded.dead}")  # its own nonce cookie
        old_cookie = hmac.new(TOKEN.encode(), b"sqla_jobs dashboard", hashlib.sha256).hexdigest()
        session, started, issued, _ = second.cookies[AUTH_COOKIE].split(".")[1:]
        for job_id, action in actions(seeded):
            path = f"/jobs/{job_id}/{action}"
            # The first login's form (its nonce too) with the second login's cookie.
            mixed = (
                f"{CSRF_COOKIE}={first.cookies[CSRF_COOKIE]}; "
                f"{AUTH_COOKIE}={second.cookies[AUTH_COOKIE]}"
            )
            refused = second.post(path, {"csrf": first_csrf}, cookie=mixed)
            assert refused.status_code == 403, path
            assert "CSRF token did not match" in refused.text
            # Login cookies someone else made: the cookie of 7df56fb (a digest of the token,
            # the same for ever), a well-formed one with another signature, one with its
            # times pushed on: each with a double-submit pair.
            for forged in (
                old_cookie,
                f"1.{session}.{started}.{issued}.{'A' * 43}",
                f"1.{session}.{started}.{int(issued) + 10 * 86400}.{'A' * 43}",
            ):
                cookie = f"{AUTH_COOKIE}={forged}; {CSRF_COOKIE}={FORGED_NONCE}"
                refused = second.post(path, {"csrf": FORGED_NONCE}, cookie=cookie)
                assert refused.status_code == 403, (path, forged)
                assert "wrong access token" in refused.text
        assert job_rows(queue_engine) == before
        # Each login's own form works.
        done = first.post(f"/jobs/{seeded.dead}/retry", {"csrf": first_csrf})
        assert done.status_code == 303
    assert job_rows(queue_engine)[seeded.dead] == ("pending", False)


def test_the_login_cookie_expires_and_rotates(
    queue_engine: sa.Engine, seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A login lasts session_lifetime (12 hours) after its last use and session_max_age (7
    days) at most; its cookie is re-issued (a new value, the same session: forms drawn before
    still post) once a quarter of its lifetime has passed; expired, it is refused 401 and
    changes nothing."""
    lifetime, max_age = (int(t.total_seconds()) for t in (SESSION_LIFETIME, SESSION_MAX_AGE))
    assert (lifetime, max_age) == (12 * 3600, 7 * 86400)
    clock = [1_900_000_000]
    monkeypatch.setattr(access, "now", lambda: clock[0])
    app = create_app(queue_engine, EmailJob, token=TOKEN)  # 12 hours, 7 days
    start = clock[0]
    with TestClient(app) as client:
        browser = Browser(client)
        logged_in = browser.post("/login", {"token": TOKEN, "next": "/"})
        cookie = set_cookies(logged_in)[AUTH_COOKIE]
        assert cookie["httponly"] is True
        assert cookie["samesite"] == "strict"
        assert cookie["path"] == "/"
        assert cookie["max-age"] == str(lifetime)
        assert not cookie["secure"]  # plain http here; see the https test
        assert TOKEN not in cookie.value
        issued_first = cookie.value
        csrf = browser.csrf(f"/jobs/{seeded.dead}")
        assert AUTH_COOKIE not in set_cookies(browser.get("/"))  # too new to re-issue

        clock[0] = start + lifetime // 4 + 1  # a quarter of the lifetime: re-issued on use
        page = browser.get("/")
        assert page.status_code == 200
        rotated = set_cookies(page)[AUTH_COOKIE]
        assert rotated.value != issued_first
        assert rotated["max-age"] == str(lifetime)
        assert browser.cookies[AUTH_COOKIE] == rotated.value
        # The form drawn before the rotation still posts.
        retried = browser.post(f"/jobs/{seeded.dead}/retry", {"csrf": csrf})
        assert retried.status_code == 303
        assert job_rows(queue_engine)[seeded.dead] == ("pending", False)

        clock[0] = start + lifetime + 1  # the first cookie went unused for its whole lifetime
        expired = browser.request("GET", "/", cookie=f"{AUTH_COOKIE}={issued_first}")
        assert expired.status_code == 401
        assert "expired" in expired.text
        assert 'id="token"' in expired.text
        assert browser.get("/").status_code == 200  # the re-issued one was used since

        # Used twice a lifetime, a login still ends session_max_age after it began.
        while clock[0] < start + max_age:
            assert browser.get("/").status_code == 200
            clock[0] += lifetime // 2
        before = job_rows(queue_engine)
        for job_id, action in actions(seeded):
            refused = browser.post(f"/jobs/{job_id}/{action}", {"csrf": csrf})
            assert refused.status_code == 401, (job_id, action)
            assert "expired" in refused.text
        assert job_rows(queue_engine) == before

        # Logging in again starts a new session: the old session's form is refused.
        login(browser)
        assert browser.post(f"/jobs/{seeded.pending}/cancel", {"csrf": csrf}).status_code == 403
        assert job_rows(queue_engine) == before
        cancelled = browser.post(
            f"/jobs/{seeded.pending}/cancel", {"csrf": browser.csrf(f"/jobs/{seeded.pending}")}
        )
        assert cancelled.status_code == 303
    assert job_rows(queue_engine)[seeded.pending] == ("cancelled", False)

    # Other lifetimes: a timedelta or seconds.
    short = create_app(
        queue_engine,
        EmailJob,
        token=TOKEN,
        session_lifetime=timedelta(minutes=30),
        session_max_age=3600,
    )
    with TestClient(short) as client:
        browser = Browser(client)
        assert set_cookies(browser.post("/login", {"token": TOKEN}))[AUTH_COOKIE]["max-age"] == (
            "1800"
        )
        clock[0] += 1801
        assert browser.get("/").status_code == 401


def test_cookies_are_secure_over_https(queue_engine: sa.Engine, seeded: Seeded) -> None:
    """Served over HTTPS (or behind a proxy that says so, trusted by uvicorn's proxy-headers
    middleware), both cookies are Secure; over plain HTTP they cannot be."""
    app = create_app(queue_engine, EmailJob, token=TOKEN)
    with TestClient(app, base_url="https://dashboard.example") as client:
        browser = Browser(client)
        cookie = set_cookies(browser.post("/login", {"token": TOKEN, "next": "/"}))[AUTH_COOKIE]
        assert cookie["secure"] is True
        assert cookie["httponly"] is True
        assert cookie["samesite"] == "strict"
        page = browser.get(f"/jobs/{seeded.dead}")
        nonce = set_cookies(page)[CSRF_COOKIE]
        assert nonce["secure"] is True
        assert nonce["httponly"] is True
        retried = browser.post(
            f"/jobs/{seeded.dead}/retry", {"csrf": browser.csrf(f"/jobs/{seeded.dead}")}
        )
        assert retried.status_code == 303
    assert job_rows(queue_engine)[seeded.dead] == ("pending", False)
    proxied = ProxyHeadersMiddleware(app, trusted_hosts="*")  # type: ignore[arg-type]
    with TestClient(proxied) as client:  # type: ignore[arg-type]
        forwarded = client.post(
            "/login",
            data={"token": TOKEN, "next": "/"},
            headers={"X-Forwarded-Proto": "https"},
            follow_redirects=False,
        )
        assert set_cookies(forwarded)[AUTH_COOKIE]["secure"] is True
        plain = client.post("/login", data={"token": TOKEN, "next": "/"}, follow_redirects=False)
        assert not set_cookies(plain)[AUTH_COOKIE]["secure"]


def test_processes_with_the_same_keys_accept_each_others_cookies(
    queue_engine: sa.Engine, seeded: Seeded
) -> None:
    """Replicas behind a load balancer: the same token (or secret) signs the same, so a login
    and a form of one are good on the other; another token or secret is not."""
    secret = "a-secret-shared-by-the-replicas"
    replicas = [create_app(queue_engine, EmailJob, secret=secret) for _ in range(2)]
    with TestClient(replicas[0]) as first, TestClient(replicas[1]) as second:
        browser = Browser(first)
        csrf = browser.csrf(f"/jobs/{seeded.dead}")
        browser.client = second
        assert browser.post(f"/jobs/{seeded.dead}/retry", {"csrf": csrf}).status_code == 303
    assert job_rows(queue_engine)[seeded.dead] == ("pending", False)

    with (
        TestClient(create_app(queue_engine, EmailJob, token=TOKEN)) as first,
        TestClient(create_app(queue_engine, EmailJob, token=TOKEN)) as second,
        TestClient(create_app(queue_engine, EmailJob, token=TOKEN + "-new")) as renewed,
        TestClient(create_app(queue_engine, EmailJob, token=TOKEN, secret=secret)) as salted,
    ):
        browser = Browser(first)
        login(browser)
        csrf = browser.csrf(f"/jobs/{seeded.pending}")
        before = job_rows(queue_engine)
        for other in (renewed, salted):  # a new token or secret ends every login
            browser.client = other
            assert browser.get("/").status_code == 403
        assert job_rows(queue_engine) == before
        browser.client = second
        assert browser.post(f"/jobs/{seeded.pending}/cancel", {"csrf": csrf}).status_code == 303
    assert job_rows(queue_engine)[seeded.pending] == ("cancelled", False)


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/jobs/999999", 404, "no job 999999"),
        ("/jobs/abc", 404, "no such job"),
        ("/jobs/0", 404, "no such job"),
        ("/jobs/99999999999999999999999", 404, "no such job"),
        ("/nowhere", 404, "no such page"),
        ("/jobs?before=abc", 400, "bad cursor"),
        ("/jobs?before=-5", 400, "bad cursor"),
        ("/jobs?before=99999999999999999999", 400, "bad cursor"),
        ("/jobs?status=exploded", 400, "bad status filter"),
        ("/jobs?queue=%3Cscript%3Ealert(1)%3C/script%3E", 400, "bad queue filter"),
        ("/jobs?task=x%27%20OR%201%3D1--", 400, "bad task filter"),
        ("/jobs?queue=" + "q" * 300, 400, "bad queue filter"),
        ("/jobs?sort=id", 400, "unknown parameter"),
        ("/?x=1", 400, "takes no parameters"),
    ],
)
def test_bad_input_gets_an_error_page(
    client: TestClient, seeded: Seeded, queue_engine: sa.Engine, path: str, status: int, says: str
) -> None:
    before = statuses(queue_engine)
    page = client.get(path)
    assert page.status_code == status
    assert says in page.text
    assert 'id="error-message"' in page.text
    assert "<script>" not in page.text
    assert statuses(queue_engine) == before


def test_access_token(queue_engine: sa.Engine, seeded: Seeded) -> None:
    before = statuses(queue_engine)
    app = create_app(queue_engine, EmailJob, token=TOKEN)
    with TestClient(app) as client:
        missing = client.get("/jobs")
        assert missing.status_code == 401
        assert 'id="token"' in missing.text
        assert client.get("/jobs", headers={"Authorization": "Bearer nope"}).status_code == 403
        assert client.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        client.cookies.set("sqla_jobs_auth", "forged")
        assert client.get("/jobs").status_code == 403
        client.cookies.delete("sqla_jobs_auth")
        # A POST without the token changes nothing, whatever it carries.
        csrf = client.get("/").cookies.get(CSRF_COOKIE) or client.cookies.get(CSRF_COOKIE)
        assert client.post(f"/jobs/{seeded.dead}/retry", data={"csrf": csrf}).status_code == 401
        wrong = client.post("/login", data={"token": "guess", "next": "/jobs"})
        assert wrong.status_code == 403
        assert "wrong access token" in wrong.text
        # The login form; an off-site "next" goes to the overview instead.
        offsite = client.post("/login", data={"token": TOKEN, "next": "//evil.example/"})
        assert offsite.url.path == "/"
        assert TOKEN not in str(client.cookies.get("sqla_jobs_auth"))
        logged_in = client.post("/login", data={"token": TOKEN, "next": "/jobs?status=dead"})
        assert logged_in.status_code == 200
        assert ids_on(logged_in.text) == [seeded.dead]
    assert statuses(queue_engine) == before


def test_allowed_hosts(queue_engine: sa.Engine) -> None:
    app = create_app(queue_engine, EmailJob, allowed_hosts=["127.0.0.1", "localhost"])
    with TestClient(app, base_url="http://rebound.example") as client:
        assert client.get("/").status_code == 400
    with TestClient(app, base_url="http://localhost:8000") as client:
        assert client.get("/").status_code == 200


def test_database_errors_get_a_page(queue_engine: sa.Engine) -> None:
    broken = sa.create_engine(queue_engine.url.set(database="no_such_database_here"))
    with TestClient(create_app(broken, EmailJob)) as client:
        page = client.get("/")
        assert page.status_code == 503
        assert "database error" in page.text
    broken.dispose()


def test_mounted_inside_an_app(queue_engine: sa.Engine, seeded: Seeded) -> None:
    outer = Starlette(routes=[Mount("/admin/jobs", create_app(queue_engine, EmailJob))])
    with TestClient(outer) as client:
        page = client.get("/admin/jobs/jobs?status=dead")
        assert page.status_code == 200
        assert f'href="/admin/jobs/jobs/{seeded.dead}"' in page.text
        csrf = csrf_of(client, f"/admin/jobs/jobs/{seeded.dead}")
        done = client.post(f"/admin/jobs/jobs/{seeded.dead}/retry", data={"csrf": csrf})
        assert done.url.path == f"/admin/jobs/jobs/{seeded.dead}"
    assert statuses(queue_engine)[seeded.dead] == "pending"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"token": "short"}, "at least 16"),
        ({"page_size": 0}, "page_size"),
        ({"scan": True}, "scan"),
        ({"secret": "short"}, "secret"),
        ({"secret": 12345678901234567}, "secret"),
        ({"session_lifetime": 10}, "session_lifetime"),
        ({"session_lifetime": "1h"}, "session_lifetime"),
        ({"session_lifetime": 7200, "session_max_age": 3600}, "session_max_age"),
        ({"time_limits": [("import", 60)]}, "time_limits must be a mapping"),
        ({"time_limits": {"import": -1}}, r"time_limits\['import'\]"),
        ({"time_limits": {"import": 10**9}}, "a week"),
        ({"time_limits": {1: 60}}, "a task name is a string"),
    ],
)
def test_create_app_checks_its_arguments(
    queue_engine: sa.Engine, kwargs: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigurationError, match=says):
        create_app(queue_engine, EmailJob, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="JobMixin"):
        create_app(queue_engine, EmailJobResult)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="JobResultMixin"):
        create_app(queue_engine, EmailJob, result_model=EmailJob)  # type: ignore[arg-type]


# -- sqla_jobs.delete ------------------------------------------------------------------------


def test_delete(queue_engine: sa.Engine, seeded: Seeded) -> None:
    with queue_engine.begin() as connection:
        sqla_jobs.delete(connection, EmailJob, seeded.dead)
        sqla_jobs.delete(connection, EmailJob, seeded.pending)
    with queue_engine.begin() as connection:
        with pytest.raises(JobStateError, match="is running"):
            sqla_jobs.delete(connection, EmailJob, seeded.running)
        with pytest.raises(JobNotFoundError):
            sqla_jobs.delete(connection, EmailJob, seeded.dead)
        with pytest.raises(InvalidJobError):
            sqla_jobs.delete(connection, EmailJob, "1")  # type: ignore[arg-type]
    after = statuses(queue_engine)
    assert seeded.dead not in after
    assert seeded.pending not in after
    assert after[seeded.running] == "running"
    # The result row is kept (results are not tied to job rows).
    with queue_engine.connect() as connection:
        kept = connection.execute(sa.select(sa.func.count()).select_from(EmailJobResult))
        assert kept.scalar_one() == 1


# -- sqla-jobs dashboard --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["--host", "0.0.0.0"], 1, "refusing to serve the dashboard on 0.0.0.0 without"),
        (["--host", "192.0.2.1"], 1, "without an access token"),
        (["--host", "0.0.0.0", "--token", "short"], 1, "at least 16 characters"),
        (["--port", "70000"], 2, "must be a port"),
    ],
)
def test_the_command_refuses_bad_settings(
    tmp_path: Path, args: list[str], status: int, says: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_JOBS_")}
    result = run_cli("dashboard", *args, env=env, cwd=tmp_path)
    assert result.returncode == status
    assert says in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


#: A registry of the command test's: its task's time limit, and its result model.
APP_TASKS = """
from models import EmailJob, EmailJobResult
from sqla_jobs import Registry

registry = Registry(EmailJob, result_model=EmailJobResult)


@registry.task(time_limit=600)
def send_receipt(ctx):
    pass
"""


@pytest.mark.parametrize(
    "named",
    [
        ["--model", "models:EmailJob", "--result-model", "models:EmailJobResult"],
        ["--registry", "app_tasks:registry"],
    ],
    ids=["model", "registry"],
)
def test_the_command_serves_the_dashboard(
    tmp_path: Path, queue_engine: sa.Engine, seeded: Seeded, named: list[str]
) -> None:
    (tmp_path / "app_tasks.py").write_text(APP_TASKS)
    with queue_engine.begin() as connection:
        connection.execute(sa.update(EmailJob).values(time_limit=None))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = queue_engine.url.render_as_string(hide_password=False)
    command = [
        sys.executable,
        "-m",
        "sqla_jobs",
        "dashboard",
        *named,
        "--port",
        str(port),
        "--read-only",
    ]
    log = tmp_path / "dashboard.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=tmp_path, env=subprocess_env(url), stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/jobs/{seeded.succeeded}"
                ) as r:
                    page = r.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        assert "R-77" in page
        assert 'id="read-only"' in page
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/") as r:
            running = running_cells(r.read().decode(), seeded.running)
        # The seeded running job (20 s into its attempt, no limit of its own) and its task's
        # limit, known only from the registry.
        known = "10 min of 10 min" if "--registry" in named else "its task's, if any"
        assert known in running
        # A TLS proxy on this machine says the request came over HTTPS: uvicorn believes it
        # (FORWARDED_ALLOW_IPS: 127.0.0.1 by default), so the cookie is Secure.
        for proto, secure in (("https", True), ("http", False)):
            forwarded = urllib.request.Request(
                f"http://127.0.0.1:{port}/", headers={"X-Forwarded-Proto": proto}
            )
            with urllib.request.urlopen(forwarded) as r:
                (nonce,) = [c for c in r.headers.get_all("Set-Cookie") if CSRF_COOKIE in c]
            assert ("; Secure" in nonce) is secure, nonce
        assert f"sqla-jobs dashboard on http://127.0.0.1:{port}/ (read-only)" in log.read_text()
        # Another name for this machine's address (DNS rebinding) is refused.
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/", headers={"Host": "rebound.example"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
        refused.value.close()
        assert refused.value.code == 400
    finally:
        process.terminate()
        process.wait(30)


def test_the_job_list_merges_a_second_source(queue_engine: sa.Engine) -> None:
    """A second table of jobs (as finished jobs moved into a history table would be) merges
    into the same list: every match once, newest first, whatever the windows."""
    jobs = cast(sa.Table, EmailJob.__table__)
    history = cast(sa.Table, ReportJob.__table__)
    with queue_engine.begin() as connection:
        for job_id in range(1, 61):
            # Ids interleave unevenly between the two tables, like jobs finishing out of order.
            target = history if job_id % 3 else jobs
            connection.execute(
                sa.insert(target).values(id=job_id, task="even" if job_id % 2 == 0 else "odd")
            )
    sources = [TableSource(jobs, scan=7), TableSource(history, scan=11)]
    for task, expected in (("even", list(range(60, 0, -2))), (None, list(range(60, 0, -1)))):
        seen: list[int] = []
        before = MAX_ID
        with queue_engine.connect() as connection:
            for _ in range(100):
                query = ListQuery(queue=None, task=task, status=None, before=before)
                page = read_page(connection, sources, query, 4)
                seen += [row.id for row in page.rows]
                if page.next_before is None:
                    break
                before = page.next_before
            assert find_job(connection, sources, 3) is not None
            assert find_job(connection, sources, 61) is None
        assert seen == expected


def test_job_detail_shows_progress_time_limit_and_snoozes(
    client: TestClient, queue_engine: sa.Engine
) -> None:
    with Session(queue_engine) as session, session.begin():
        job = EmailJob(task="import", time_limit=timedelta(seconds=90))
        session.add(job)
        session.flush()
        job_id = job.id
    with Session(queue_engine) as session, session.begin():
        (claimed,) = sqla_jobs.claim(session, EmailJob)
        assert sqla_jobs.report_progress(session, claimed, 0.25, "250 of <1000> rows")
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text("UPDATE email_jobs SET snoozes = 2 WHERE id = :id"), {"id": job_id}
        )
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200
    assert 'aria-label="25.0% done"' in page.text  # a quarter of the bar
    assert '<rect width="30.0" height="10"' in page.text
    assert "250 of &lt;1000&gt; rows" in page.text  # escaped
    assert re.search(r'id="time-limit">90\.0 s \(its own\)', page.text)
    assert 'id="snoozes">2<' in page.text
    with queue_engine.begin() as connection:  # no progress section for a job without one
        connection.execute(sa.text("UPDATE email_jobs SET progress = NULL"))
    assert 'id="progress"' not in client.get(f"/jobs/{job_id}").text


def running_jobs(queue_engine: sa.Engine, *jobs: EmailJob, started: list[int]) -> list[int]:
    """Enqueue ``jobs``, claim them (a lease of an hour) and set each one's attempt start
    back by its ``started`` seconds, as if it had run that long; their ids."""
    ids = enqueue(queue_engine, *jobs)
    with Session(queue_engine) as session, session.begin():
        claimed = sqla_jobs.claim(session, EmailJob, limit=len(ids), lease=3600)
    assert sorted(job.id for job in claimed) == ids
    with queue_engine.begin() as connection:
        for job_id, seconds in zip(ids, started, strict=True):
            connection.execute(
                sa.text(
                    "UPDATE email_jobs SET attempted_at = attempted_at - make_interval(secs => :s) "
                    "WHERE id = :id"
                ),
                {"s": seconds, "id": job_id},
            )
    return ids


def running_cells(page: str, job_id: int) -> str:
    found = re.search(rf'<tr data-job-id="{job_id}">(.*?)</tr>', page, re.S)
    assert found is not None, f"job {job_id} is not in the running table"
    return found.group(1)


def test_overview_shows_each_running_jobs_progress_and_time_left(
    queue_engine: sa.Engine,
) -> None:
    own, tasks, unlimited, late = running_jobs(
        queue_engine,
        EmailJob(task="resize", time_limit=timedelta(seconds=90)),
        EmailJob(task="import"),
        EmailJob(task="other"),
        EmailJob(task="resize", time_limit=timedelta(seconds=1)),
        started=[30, 60, 5, 30],
    )
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text(
                "UPDATE email_jobs SET progress = jsonb_build_object('value', 0.4, "
                "'message', '4 of <10> pages', 'at', now()) WHERE id = :id"
            ),
            {"id": own},
        )
        connection.execute(  # its worker stopped: the lease ran out
            sa.text(
                "UPDATE email_jobs SET lease_expires_at = now() - interval '1 second' "
                "WHERE id = :id"
            ),
            {"id": unlimited},
        )
    app = create_app(queue_engine, EmailJob, time_limits={"import": timedelta(minutes=5)})
    with TestClient(app) as client:
        page = client.get("/").text
    assert 'id="running"' in page
    shown = re.findall(r'<tr data-job-id="(\d+)">', page)
    assert [int(i) for i in shown] == [tasks, own, late, unlimited]  # longest running first
    cells = running_cells(page, own)
    assert 'aria-label="40.0% done"' in cells
    assert "4 of &lt;10&gt; pages" in cells  # escaped
    assert re.search(r'<span class="left">(59|60) s of 90 s</span>', cells)
    assert re.search(r'<span class="left">4 min of 5 min</span>', running_cells(page, tasks))
    assert "no limit" in running_cells(page, unlimited)
    assert "lease expired" in running_cells(page, unlimited)
    assert "lease expired" not in cells
    assert re.search(
        r'<span class="left overdue">(29|30) s past 1 s</span>', running_cells(page, late)
    )
    # Not given the tasks' limits, the dashboard does not guess them.
    with TestClient(create_app(queue_engine, EmailJob)) as client:
        page = client.get("/").text
        detail = client.get(f"/jobs/{tasks}").text
    assert "its task's, if any" in running_cells(page, tasks)
    assert re.search(r'<span class="left">(59|60) s of 90 s</span>', running_cells(page, own))
    assert "its task's, if any</dd>" in detail
    with TestClient(app) as client:
        limit = 'id="time-limit">300.0 s (its task' + "'s)</dd>"
        assert limit in client.get(f"/jobs/{tasks}").text
        assert 'id="time-limit">none</dd>' in client.get(f"/jobs/{unlimited}").text
        assert re.search(r'id="attempted-at">\d{4}-', client.get(f"/jobs/{own}").text)


def test_overview_says_when_no_job_runs(client: TestClient, queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="waiting"))
    page = client.get("/").text
    assert 'id="none-running"' in page
    assert 'id="running"' not in page


def test_a_registrys_time_limits_are_its_tasks_with_one() -> None:
    registry = Registry(EmailJob)

    @registry.task(time_limit=30)
    def limited(ctx: JobContext) -> None: ...

    @registry.task
    def free(ctx: JobContext) -> None: ...

    assert registry.time_limits == {"limited": timedelta(seconds=30)}
