"""The dashboard's cookies against an attacker who can set cookies for its host (a sibling
subdomain, another service on the same host): CSRF tokens bound to the server and the
session, a login cookie that expires, rotates and is Secure over HTTPS (issue 29, findings 6
and 12). Every refusal is checked in the rows: nothing changed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from dashboard_data import Seeded, seed, statuses
from dashboard_pages import csrf_of
from models import EmailJob
from starlette.testclient import TestClient

from sqla_jobs.dashboard import create_app
from sqla_jobs.dashboard.app import AUTH_COOKIE, CSRF_COOKIE, LOGIN_LIFETIME

TOKEN = "a-long-enough-dashboard-token"


@pytest.fixture
def seeded(queue_engine: sa.Engine) -> Seeded:
    return seed(queue_engine)


@pytest.fixture
def open_client(queue_engine: sa.Engine) -> Iterator[TestClient]:
    with TestClient(create_app(queue_engine, EmailJob)) as client:
        yield client


def _log_in(client: TestClient) -> None:
    assert client.post("/login", data={"token": TOKEN, "next": "/"}).status_code == 200


def test_a_csrf_cookie_and_field_the_attacker_chose_change_nothing(
    open_client: TestClient, seeded: Seeded, queue_engine: sa.Engine
) -> None:
    before = statuses(queue_engine)
    # The attacker plants a cookie of their choosing, and a form with the same value.
    chosen = "A" * 43
    open_client.cookies.set(CSRF_COOKIE, chosen)
    for action, job_id in (
        ("retry", seeded.dead),
        ("cancel", seeded.pending),
        ("delete", seeded.succeeded),
    ):
        forged = open_client.post(f"/jobs/{job_id}/{action}", data={"csrf": chosen})
        assert forged.status_code == 403, action
        assert "CSRF" in forged.text
    assert statuses(queue_engine) == before
    # A token made by one dashboard's key is refused by another's.
    with TestClient(create_app(queue_engine, EmailJob)) as other:
        token = csrf_of(other, f"/jobs/{seeded.dead}")
        open_client.cookies.set(CSRF_COOKIE, other.cookies[CSRF_COOKIE])
        assert (
            open_client.post(f"/jobs/{seeded.dead}/retry", data={"csrf": token}).status_code == 403
        )
    assert statuses(queue_engine) == before
    # The page's own token still works (and is not the cookie's value).
    open_client.cookies.clear()
    token = csrf_of(open_client, f"/jobs/{seeded.dead}")
    assert token != open_client.cookies[CSRF_COOKIE]
    assert open_client.post(f"/jobs/{seeded.dead}/retry", data={"csrf": token}).status_code == 200
    assert statuses(queue_engine)[seeded.dead] == "pending"


def test_a_csrf_token_is_bound_to_the_login_session(
    queue_engine: sa.Engine, seeded: Seeded
) -> None:
    before = statuses(queue_engine)
    app = create_app(queue_engine, EmailJob, token=TOKEN)
    with TestClient(app) as attacker, TestClient(app) as victim:
        # The attacker has logged in too (say, a former operator): a valid pair of theirs
        # does not work in the victim's session.
        _log_in(attacker)
        token = csrf_of(attacker, f"/jobs/{seeded.dead}")
        _log_in(victim)
        victim.cookies.set(CSRF_COOKIE, attacker.cookies[CSRF_COOKIE])
        assert victim.post(f"/jobs/{seeded.dead}/retry", data={"csrf": token}).status_code == 403
        assert statuses(queue_engine) == before
        own = csrf_of(victim, f"/jobs/{seeded.dead}")
        assert victim.post(f"/jobs/{seeded.dead}/retry", data={"csrf": own}).status_code == 200
    assert statuses(queue_engine)[seeded.dead] == "pending"


def test_the_login_cookie_is_signed_expires_and_rotates(
    queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(queue_engine, EmailJob, token=TOKEN)
    with TestClient(app) as client:
        _log_in(client)
        cookie = client.cookies[AUTH_COOKIE]
        assert TOKEN not in cookie
        issued, login, _ = cookie.split(".")
        assert client.get("/jobs").status_code == 200
        # Forged: another issue time with the old signature, or a made-up signature.
        signature = cookie.split(".")[2]
        for forged in (f"{int(issued) + 3600}.{login}.{signature}", f"{issued}.{login}.{'0' * 64}"):
            client.cookies.clear()
            client.cookies.set(AUTH_COOKIE, forged)
            assert client.get("/jobs").status_code == 403
        client.cookies.clear()
        client.cookies.set(AUTH_COOKIE, cookie)
        now = time.time()
        # Past half its lifetime: still valid, and re-issued (a new value, the same session).
        monkeypatch.setattr(time, "time", lambda: now + LOGIN_LIFETIME * 0.75)
        page = client.get("/jobs")
        assert page.status_code == 200
        rotated = page.cookies.get(AUTH_COOKIE)
        assert rotated is not None
        assert rotated != cookie
        assert rotated.split(".")[1] == login
        # Past its lifetime, the old cookie is refused.
        monkeypatch.setattr(time, "time", lambda: now + LOGIN_LIFETIME + 1)
        client.cookies.clear()
        client.cookies.set(AUTH_COOKIE, cookie)
        expired = client.get("/jobs")
        assert expired.status_code == 403
        assert "expired" in expired.text


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_cookies_are_secure_over_https(queue_engine: sa.Engine, scheme: str) -> None:
    app = create_app(queue_engine, EmailJob, token=TOKEN)
    with TestClient(app, base_url=f"{scheme}://testserver") as client:
        login = client.post("/login", data={"token": TOKEN, "next": "/"}, follow_redirects=False)
        headers = login.headers.get_list("set-cookie")
        page = client.get("/")
        headers += page.headers.get_list("set-cookie")
    auth = [h for h in headers if h.startswith(f"{AUTH_COOKIE}=")]
    csrf = [h for h in headers if h.startswith(f"{CSRF_COOKIE}=")]
    assert auth
    assert csrf
    for header in auth + csrf:
        assert ("; secure" in header.lower()) is (scheme == "https"), header
        assert "httponly" in header.lower()
        assert "samesite=strict" in header.lower()
    assert f"max-age={LOGIN_LIFETIME}" in auth[0].lower()
