"""Reading the dashboard's HTML in tests: a page's CSRF token and the jobs it lists; a
browser's cookies, to keep and to forge."""

from __future__ import annotations

import re
from http.cookies import Morsel, SimpleCookie

from httpx2 import Response
from starlette.testclient import TestClient


def csrf_of(client: TestClient, path: str) -> str:
    """The CSRF token of the action form on the page at ``path``."""
    page = client.get(path)
    assert page.status_code == 200
    match = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert match is not None, "the page has no action form"
    return match.group(1)


def ids_on(html: str) -> list[int]:
    """The ids of the jobs a page lists, in order."""
    return [int(job_id) for job_id in re.findall(r'data-job-id="(\d+)"', html)]


class Browser:
    """A browser's cookies for the dashboard, kept here (not in the client) so that a test
    can read, keep, replace and forge them: each request sends exactly ``cookies`` (or the
    ``Cookie`` header given), follows no redirect, and takes what ``Set-Cookie`` says."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.cookies: dict[str, str] = {}

    def request(
        self,
        method: str,
        path: str,
        *,
        data: dict[str, str] | None = None,
        cookie: str | None = None,
    ) -> Response:
        if cookie is None:
            cookie = "; ".join(f"{name}={value}" for name, value in self.cookies.items())
        self.client.cookies.clear()
        response = self.client.request(
            method,
            path,
            data=data,
            headers={"Cookie": cookie} if cookie else {},
            follow_redirects=False,
        )
        self.client.cookies.clear()
        for name, morsel in set_cookies(response).items():
            self.cookies[name] = morsel.value
        return response

    def get(self, path: str) -> Response:
        return self.request("GET", path)

    def post(self, path: str, data: dict[str, str], cookie: str | None = None) -> Response:
        return self.request("POST", path, data=data, cookie=cookie)

    def csrf(self, path: str) -> str:
        """The CSRF token of the action form on the page at ``path``."""
        page = self.get(path)
        assert page.status_code == 200, page.text
        match = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert match is not None, "the page has no action form"
        return match.group(1)


def set_cookies(response: Response) -> dict[str, Morsel[str]]:
    """The cookies ``response`` sets, by name, with their attributes."""
    found: dict[str, Morsel[str]] = {}
    for header in response.headers.get_list("set-cookie"):
        parsed: SimpleCookie = SimpleCookie()
        parsed.load(header)
        found.update(parsed)
    return found
