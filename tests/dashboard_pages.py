"""Reading the dashboard's HTML in tests: a page's CSRF token and the jobs it lists."""

from __future__ import annotations

import re

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
