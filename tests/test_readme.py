"""The README, the project's front page, as a new user reads it: its code runs, and what it
states holds.

Its blocks follow the rules of tests/doc_blocks.py with the marker ``readme-test``: every
``python`` block runs, top to bottom, in one namespace, on a fresh database whose URL
replaces the placeholder; every ``sqla-jobs`` command of its ``sh`` blocks parses with the
command's own parser. The README stays a front page (at most 250 lines) whose links into
the documentation lead to pages that exist; the manual is under docs/ (tests/test_docs.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from doc_blocks import (
    ROOT,
    Page,
    check_blocks,
    commands,
    engine_holders,
    load,
    parse_command,
    running,
    scalar,
)

LANGUAGES = frozenset({"python", "sh", "ini", "text"})
TEST_COMMAND = 'python3 -m pip install --quiet "nox[uv]" && python3 -m nox'


def readme() -> Page:
    return load(ROOT / "README.md")


def test_every_block_is_labelled_and_every_python_block_is_run_or_marked() -> None:
    page = readme()
    assert page.runnable, "the quick start runs"
    check_blocks(page, "readme-test", LANGUAGES)


def test_the_readme_is_a_front_page() -> None:
    assert len(readme().text.splitlines()) <= 250


def test_the_readme_links_to_pages_that_exist() -> None:
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme().text)
    assert any(link.startswith("docs/") for link in links)
    # docs/benchmarks.md, docs/contributing.md and docs/operations/upgrading.md are written
    # beside this change; until they exist, they are the only ones allowed to be missing.
    pending = {"docs/benchmarks.md", "docs/contributing.md", "docs/operations/upgrading.md"}
    missing = sorted({link for link in links if not (ROOT / link).exists()} - pending)
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_the_readme_gives_the_test_command() -> None:
    (block,) = [b for b in readme().blocks if b.code.strip() == TEST_COMMAND]
    assert block.language == "sh"


@dataclass
class Snippets:
    """The README's Python blocks, run: their namespace and their database."""

    namespace: dict[str, Any]
    url: str
    engine: sa.Engine


@pytest.fixture(scope="module")
def snippets(fresh_database: FreshDatabase) -> Iterator[Snippets]:
    """Run every unmarked Python block of the README, in order, in one module namespace."""
    blocks = list(readme().blocks)
    assert len(engine_holders(blocks)) == 1, "exactly one block should create the engine"
    url = fresh_database("sqla_jobs_readme")
    with running(blocks, url, "readme_snippets") as namespace:
        engine = namespace["engine"]
        assert isinstance(engine, sa.Engine)
        assert engine.url.render_as_string(hide_password=False) == url
        yield Snippets(namespace, url, engine)


def test_quick_start_enqueues_and_completes_a_job(snippets: Snippets) -> None:
    engine = snippets.engine
    status = scalar(engine, "SELECT status FROM email_jobs WHERE order_id = 7")
    assert status == "succeeded"
    value = scalar(
        engine,
        "SELECT r.value FROM email_job_results r JOIN email_jobs j ON j.id = r.job_id "
        "WHERE j.order_id = 7",
    )
    assert value == "receipt for order 7"


def test_every_sqla_jobs_command_in_the_readme_parses() -> None:
    seen = 0
    for block in readme().blocks:
        if block.language == "sh":
            for argv in commands(block):
                seen += 1
                parse_command(argv, block.where)
    assert seen >= 2
