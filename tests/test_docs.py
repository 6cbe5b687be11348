"""The documentation pages under docs/, as a reader uses them: their code runs, and what they
state holds.

Every fenced block of every page follows the rules of tests/doc_blocks.py (with the marker
``docs-test``): each page's Python blocks run top to bottom in a namespace of their own, on a
fresh database of their own, after the blocks of the page it continues (its ``<!-- docs-test:
after PAGE -->`` line), if any; revision blocks run in an Alembic migration context;
``sqla-jobs`` commands parse; ``ini`` blocks parse. After a page has run, the checks below
look at what it did, and the rest of the module checks claims the pages make in prose (each
test names its page).
"""

from __future__ import annotations

import configparser
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from doc_blocks import (
    Page,
    chain,
    check_blocks,
    commands,
    docs_pages,
    engine_holders,
    parse_command,
    revision_groups,
    run_revisions,
    running,
    scalar,
)
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import Registry

PAGES = docs_pages()
BY_SOURCE = {page.source: page for page in PAGES}
LANGUAGES = frozenset({"python", "sh", "ini", "text", "sql"})


def page(source: str) -> Page:
    assert source in BY_SOURCE, f"no page {source}"
    return BY_SOURCE[source]


def test_there_are_pages() -> None:
    assert "docs/tutorial.md" in BY_SOURCE


@pytest.mark.parametrize("doc", PAGES, ids=lambda doc: doc.source)
def test_every_block_is_labelled_and_every_python_block_is_run_or_marked(doc: Page) -> None:
    check_blocks(doc, "docs-test", LANGUAGES)
    chain(doc)  # a prelude names a page, and there is no cycle


# -- running the pages ----------------------------------------------------------------------


@dataclass
class Ran:
    """A page's blocks, run: their namespace and their database."""

    namespace: dict[str, Any]
    url: str
    engine: sa.Engine


Runner = Callable[[str], Ran]


@pytest.fixture(scope="module")
def ran(fresh_database: FreshDatabase) -> Iterator[Runner]:
    """``ran(source)``: the page's blocks (after its preludes'), run once per module."""
    done: dict[str, Ran] = {}
    with ExitStack() as stack:

        def run(source: str) -> Ran:
            if source not in done:
                pages = chain(page(source))
                blocks = [block for p in pages for block in p.blocks]
                holders = engine_holders(blocks)
                assert len(holders) == 1, (
                    f"{source}: exactly one block (here or in its preludes) should create the "
                    f"engine on the placeholder URL, not {[b.where for b in holders]}"
                )
                slug = source.removeprefix("docs/").removesuffix(".md").replace("/", "_")
                url = fresh_database(f"sqla_jobs_docs_{slug.replace('-', '_')}"[:50])
                name = f"docs_{slug.replace('-', '_')}"
                namespace = stack.enter_context(running(blocks, url, name))
                engine = namespace["engine"]
                assert isinstance(engine, sa.Engine)
                assert engine.url.render_as_string(hide_password=False) == url
                done[source] = Ran(namespace, url, engine)
            return done[source]

        yield run


RUNNABLE = [doc.source for doc in PAGES if doc.runnable]


@pytest.mark.parametrize("source", RUNNABLE)
def test_the_python_blocks_of_each_page_run(source: str, ran: Runner) -> None:
    ran(source)


REVISIONS = [
    pytest.param(doc.source, index, id=f"{doc.source}:{group[0].line}")
    for doc in PAGES
    for index, group in enumerate(revision_groups(doc))
]


@pytest.mark.parametrize(("source", "index"), REVISIONS)
def test_revision_blocks_upgrade_and_downgrade(
    source: str, index: int, fresh_database: FreshDatabase
) -> None:
    group = revision_groups(page(source))[index]
    engine = sa.create_engine(fresh_database("sqla_jobs_docs_revision"), poolclass=sa.NullPool)
    try:
        with engine.begin() as connection:  # what the examples' revisions refer to
            connection.execute(sa.text("CREATE TABLE orders (id integer PRIMARY KEY)"))
            connection.execute(sa.text("CREATE TABLE shows (id integer PRIMARY KEY)"))
        run_revisions(group, engine)
    finally:
        engine.dispose()


def test_every_sqla_jobs_command_in_the_docs_parses() -> None:
    seen = 0
    for doc in PAGES:
        for block in doc.blocks:
            if block.language == "sh":
                for argv in commands(block):
                    seen += 1
                    parse_command(argv, block.where)
    assert seen >= 2


def test_ini_blocks_parse() -> None:
    for doc in PAGES:
        for block in doc.blocks:
            if block.language == "ini":
                configparser.ConfigParser(interpolation=None).read_string(block.code, block.where)


# -- the tutorial --------------------------------------------------------------------------


def test_tutorial_enqueues_in_the_transaction_and_the_worker_runs_the_job(ran: Runner) -> None:
    engine = ran("docs/tutorial.md").engine
    assert scalar(engine, "SELECT count(*) FROM orders") == 1
    assert scalar(engine, "SELECT status FROM email_jobs WHERE order_id = 7") == "succeeded"
    value = scalar(engine, "SELECT value FROM email_job_results")
    assert value == "receipt for order 7"


# Used by the checks of later sections.
__all__ = ["Registry", "Session", "sqla_jobs", "threading", "wait_until"]
