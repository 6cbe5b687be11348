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
from datetime import timedelta
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
    normalized,
    parse_command,
    revision_groups,
    run_revisions,
    running,
    scalar,
    table_rows,
)
from models import EmailJob, EmailJobResult, Order
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import PendingRollbackError
from sqlalchemy.orm import MappedColumn, Session
from sqlalchemy.schema import DefaultClause, FetchedValue
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import InvalidJobError, JobMixin, JobResultMixin, Registry, validation
from sqla_jobs.migrations import check_job_tables
from sqla_jobs.schema.pauses import pause_names

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
    engine: sa.Engine  # on the page's database, for the checks


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
                # The checks read through an engine of their own that keeps no connection
                # (so that twenty pages' pools do not add up on the server).
                checks = sa.create_engine(url, poolclass=sa.NullPool)
                stack.callback(checks.dispose)
                done[source] = Ran(namespace, url, checks)
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


# -- how-to/enqueueing.md ----------------------------------------------------------------------

ENQUEUEING = "docs/how-to/enqueueing.md"


def test_enqueueing_writes_its_jobs(ran: Runner) -> None:
    engine = ran(ENQUEUEING).engine
    assert scalar(engine, "SELECT count(*) FROM email_jobs WHERE args->>'order' = '20'") == 4


def test_bad_input_block_commits_the_order_without_the_job(ran: Runner) -> None:
    engine = ran(ENQUEUEING).engine
    assert scalar(engine, "SELECT count(*) FROM orders WHERE id = 10") == 1
    assert scalar(engine, "SELECT count(*) FROM email_jobs WHERE task = '-x'") == 0


PG_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]


def described(column: sa.Column[Any]) -> list[str]:
    """``[name, type, default]`` as the page's tables write them."""
    sql_type = column.type.compile(dialect=PG_DIALECT).lower()
    sql_type = sql_type.replace("timestamp with time zone", "timestamptz")
    if column.nullable:
        sql_type += ", null"
    default = column.server_default
    if column.identity is not None:
        shown = "identity"
    elif isinstance(default, DefaultClause):
        arg = default.arg
        if isinstance(arg, str):
            shown = f"'{arg}'"
        elif isinstance(arg, sa.TextClause):
            shown = arg.text
        else:
            shown = str(arg.compile(dialect=PG_DIALECT))
    else:
        assert default is None or type(default) is FetchedValue
        shown = ""
    return [column.name, sql_type, shown]


def mixin_columns(mixin: type, model: type) -> list[list[str]]:
    names = [name for name, value in vars(mixin).items() if isinstance(value, MappedColumn)]
    table: sa.Table = model.__table__  # type: ignore[attr-defined]
    return [described(table.c[name]) for name in names]


def test_column_tables_match_the_mixins() -> None:
    job_table, result_table = table_rows(page(ENQUEUEING).section("## The columns"))
    assert [row[:3] for row in job_table] == mixin_columns(JobMixin, EmailJob)
    assert [row[:3] for row in result_table] == mixin_columns(JobResultMixin, EmailJobResult)
    assert all(row[3] for row in job_table + result_table), "every column has a meaning"


def test_the_page_quotes_the_name_rule_the_code_enforces() -> None:
    assert normalized(validation.NAME_RULE) in normalized(page(ENQUEUEING).text)
    with pytest.raises(InvalidJobError, match="malformed") as info:
        validation.check_name("task", "-x")
    assert validation.NAME_RULE in str(info.value)


@pytest.mark.parametrize(
    "name", ["a", "Z", "7", "_", "billing.tasks:send-receipt", "x" * validation.MAX_NAME_LENGTH]
)
def test_names_the_rule_accepts(name: str) -> None:
    assert validation.check_name("queue", name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "-x",
        ".x",
        ":x",
        "a b",
        "é",
        "café",
        "\uff58",
        "a\n",
        "x" * (validation.MAX_NAME_LENGTH + 1),
    ],
)
def test_names_the_rule_refuses(name: str) -> None:
    with pytest.raises(InvalidJobError):
        validation.check_name("queue", name)


# What a failed check leaves behind (how-to/enqueueing.md, "Bad input").


def count(engine: sa.Engine, table: str) -> int:
    return int(scalar(engine, f"SELECT count(*) FROM {table}"))


def test_an_error_at_construction_leaves_the_session_to_commit(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(Order(id=1, customer="ada"))
        with pytest.raises(InvalidJobError):
            session.add(EmailJob(task="-x"))
    assert count(queue_engine, "orders") == 1
    assert count(queue_engine, "email_jobs") == 0


def test_an_error_at_assignment_keeps_the_previous_value(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        job = EmailJob(task="t", priority=3)
        session.add(job)
        with pytest.raises(InvalidJobError):
            job.priority = 1000
    assert scalar(queue_engine, "SELECT priority FROM email_jobs") == 3


def nan_job() -> EmailJob:
    job = EmailJob(task="t", args={"values": [1.0]})
    job.args["values"].append(float("nan"))  # no validator sees this; the flush does
    return job


def test_an_error_at_flush_writes_nothing_even_when_caught(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session:
        session.begin()
        session.add(Order(id=1, customer="ada"))
        session.flush()
        session.add(nan_job())
        with pytest.raises(InvalidJobError):
            session.flush()
        with pytest.raises(PendingRollbackError):
            session.commit()
    with Session(queue_engine) as session, session.begin():
        session.add(Order(id=2, customer="bob"))
        session.add(nan_job())
        with pytest.raises(InvalidJobError):
            session.flush()
    # the block was left normally, and ended rolled back
    assert count(queue_engine, "orders") == 0
    assert count(queue_engine, "email_jobs") == 0


# The column table's last_error (how-to/enqueueing.md), Task.job with a relationship
# (how-to/workers.md).


def test_last_error_is_kept_when_a_later_attempt_succeeds(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="t"))
    with Session(queue_engine) as session, session.begin():
        (first,) = sqla_jobs.claim(session, EmailJob)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.fail(session, first, "the mail server was down", delay=0.001)
    second: list[sqla_jobs.ClaimedJob] = []

    def claimed() -> bool:
        with Session(queue_engine) as session, session.begin():
            second.extend(sqla_jobs.claim(session, EmailJob))
        return bool(second)

    wait_until(claimed, timeout=10, message="the retry is claimed")
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, second[0])
    with Session(queue_engine) as session:
        job = session.get_one(EmailJob, first.id)
        assert (job.status, job.attempts) == ("succeeded", 2)
        assert job.last_error == "the mail server was down"


def test_task_job_takes_a_relationship(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)

    @registry.task(queue="email")
    def send_receipt(ctx: sqla_jobs.JobContext) -> None:
        """Never run here."""

    with Session(queue_engine) as session, session.begin():
        order = Order(id=7, customer="ada")
        job = send_receipt.job({"order": 7}, order=order)
        assert isinstance(job, EmailJob)
        assert job.order is order
        session.add(job)  # the order comes along (save-update cascade)
        send_receipt.enqueue(session, {"order": 7}, order=order)
    with Session(queue_engine) as session:
        rows = session.execute(sa.select(EmailJob.order_id, EmailJob.task, EmailJob.queue)).all()
    assert [tuple(row) for row in rows] == [(7, "send_receipt", "email")] * 2


# -- how-to/migrations.md ----------------------------------------------------------------------


def test_the_revisions_build_what_the_models_declare(
    ran: Runner, fresh_database: FreshDatabase
) -> None:
    namespace = ran("docs/tutorial.md").namespace
    job_model, result_model = namespace["EmailJob"], namespace["EmailJobResult"]
    first, upgrades = revision_groups(page("docs/how-to/migrations.md"))
    assert [len(first), len(upgrades)] == [1, 4]
    for group, models in ((first, (job_model, result_model)), (upgrades, (job_model,))):
        engine = sa.create_engine(fresh_database("sqla_jobs_docs_models"), poolclass=sa.NullPool)

        def check(engine: sa.Engine = engine, models: tuple[type, ...] = models) -> None:
            with engine.connect() as connection:
                assert check_job_tables(connection, job_model) == []
                inspector = sa.inspect(connection)
                # Schema version 4's pause table, which every claim reads.
                assert pause_names(job_model.__tablename__).table in inspector.get_table_names()
                for model in models:
                    table = model.__table__  # type: ignore[attr-defined]
                    columns = {c["name"] for c in inspector.get_columns(table.name)}
                    assert columns == {c.name for c in table.columns}

        try:
            with engine.begin() as connection:
                connection.execute(sa.text("CREATE TABLE orders (id integer PRIMARY KEY)"))
            run_revisions(group, engine, check)
        finally:
            engine.dispose()


# -- how-to/async.md ---------------------------------------------------------------------------


def test_async_block_enqueues_and_completes_through_asyncpg(ran: Runner) -> None:
    done = ran("docs/how-to/async.md")
    assert done.namespace["async_engine"].dialect.driver == "asyncpg"
    assert scalar(done.engine, "SELECT count(*) FROM orders WHERE id = 11") == 1
    value = scalar(
        done.engine,
        "SELECT r.value FROM email_job_results r JOIN email_jobs j ON j.id = r.job_id "
        "WHERE j.order_id = 11 AND j.status = 'succeeded'",
    )
    assert value == "receipt for order 11"


# -- how-to/workers.md -------------------------------------------------------------------------


def test_workers_page_jobs_run_in_a_worker(ran: Runner) -> None:
    done = ran("docs/how-to/workers.md")
    registry = done.namespace["registry"]
    assert isinstance(registry, Registry)
    engine = sa.create_engine(done.url, pool_size=10, pool_pre_ping=True)
    worker = sqla_jobs.Worker(
        registry, engine, concurrency=2, poll_interval=0.1, grace=5.0, handle_signals=False
    )
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(worker.run()))
    thread.start()
    try:
        wait_until(
            lambda: (
                scalar(
                    engine,
                    "SELECT count(*) FROM email_jobs WHERE args->>'order' = '8' "
                    "AND status = 'succeeded'",
                )
                == 2
            ),
            timeout=30,
            message="both jobs of order 8 succeed",
        )
    finally:
        worker.stop()
        thread.join(30)
        engine.dispose()
    assert status == [0]

    db = done.engine
    receipt_id = scalar(
        db, "SELECT id FROM email_jobs WHERE task = 'send_receipt' AND order_id = 8"
    )
    assert receipt_id is not None  # Task.job(..., order=order) set the foreign key
    value = scalar(db, "SELECT value FROM email_job_results WHERE job_id = :id", id=receipt_id)
    assert value == f"message-receipt-{receipt_id}"  # keyed by ctx.job.id
    assert scalar(db, "SELECT count(*) FROM payments WHERE order_id = 8") == 1
    assert scalar(db, "SELECT queue FROM email_jobs WHERE task = 'charge'") == "billing"


# -- how-to/testing.md -------------------------------------------------------------------------


def test_the_test_functions_the_testing_page_defines_pass(ran: Runner) -> None:
    done = ran("docs/how-to/testing.md")
    own = {block.code for block in page("docs/how-to/testing.md").runnable}
    tests = {
        name: value
        for name, value in done.namespace.items()
        if name.startswith("test_") and callable(value)
    }
    assert len(tests) >= 2
    assert all(any(f"def {name}(" in code for code in own) for name in tests)
    rolled_back = done.namespace["rolled_back"]  # the page's own fixture, as a context manager
    for test in tests.values():
        with rolled_back(done.engine) as session:
            test(session)
    assert scalar(done.engine, "SELECT count(*) FROM orders WHERE id IN (9, 12)") == 0
    assert scalar(done.engine, "SELECT count(*) FROM payments WHERE order_id = 12") == 0


# -- the other pages' own results --------------------------------------------------------------


def test_outcomes_page_leaves_the_retried_job_pending(ran: Runner) -> None:
    engine = ran("docs/how-to/outcomes.md").engine
    rows = scalar(
        engine,
        "SELECT string_agg(queue || ':' || status || ':' || attempts, ',' ORDER BY id) "
        "FROM email_jobs WHERE queue IN ('flaky', 'broken')",
    )
    assert rows == "flaky:pending:1,broken:pending:1"


def test_ordering_keys_page_handler_read_its_key(ran: Runner) -> None:
    engine = ran("docs/how-to/ordering-keys.md").engine
    value = scalar(
        engine,
        "SELECT r.value FROM email_job_results r JOIN email_jobs j ON j.id = r.job_id "
        "WHERE j.ordering_key = 'account:7' AND j.status = 'succeeded'",
    )
    assert value == "posted to account:7"


def test_history_page_retention_dropped_the_old_partition(ran: Runner) -> None:
    engine = ran("docs/how-to/history.md").engine
    assert scalar(engine, "SELECT count(*) FROM invoice_jobs_history WHERE id = 10000") == 0


def test_embedding_page_worker_refused_the_missing_database(ran: Runner) -> None:
    assert isinstance(ran("docs/how-to/embedding.md").namespace["worker"], sqla_jobs.Worker)


def test_dashboard_page_retried_the_job(ran: Runner) -> None:
    engine = ran("docs/operations/dashboard.md").engine
    assert scalar(engine, "SELECT status FROM email_jobs WHERE args->>'order' = '40'") == "pending"


# -- prose that names the code's values ---------------------------------------------------------


def test_the_dashboard_page_names_its_routes_and_cookies() -> None:
    pytest.importorskip("starlette")
    from sqla_jobs.dashboard import access, create_app

    text = page("docs/operations/dashboard.md").section("## URLs, forms, cookies and status codes")
    app = create_app(sa.create_engine("postgresql+psycopg://"), EmailJob)
    paths = {route.path for route in app.routes}  # type: ignore[attr-defined]
    assert paths == {
        "/",
        "/jobs",
        "/jobs/{job_id}",
        "/jobs/{job_id}/{action}",
        "/queues/{queue}/{action}",
        "/activity",
        "/failures",
        "/login",
        "/logout",
    }
    for shown in (
        "`GET /`",
        "`GET /jobs`",
        "`GET /jobs/{id}`",
        "`POST /jobs/{id}/retry`",
        "`POST /queues/{name}/pause`",
        "`GET /activity`",
        "`GET /failures`",
        "`POST /logout`",
    ):
        assert shown in text
    assert f"`{access.CSRF_COOKIE}`" in text
    assert f"`{access.AUTH_COOKIE}`" in text
    assert timedelta(hours=12) == access.SESSION_LIFETIME
    assert timedelta(days=7) == access.SESSION_MAX_AGE
    assert "12 hours unused or 7 days since the login" in normalized(text)


def test_the_metrics_page_names_the_other_label() -> None:
    from sqla_jobs.metrics import OTHER

    assert f"`{OTHER}`" in page("docs/operations/metrics.md").text


def test_the_outcomes_page_gives_the_retry_policys_defaults() -> None:
    policy = sqla_jobs.RetryPolicy()
    assert (policy.base, policy.cap, policy.jitter) == (
        timedelta(seconds=1),
        timedelta(hours=1),
        0.1,
    )
    assert "defaults to `base` 1 s, `cap` one hour and `jitter` 0.1" in normalized(
        page("docs/how-to/outcomes.md").text
    )


def test_the_periodic_page_gives_the_longest_unique_key() -> None:
    from sqla_jobs.queue.enqueueing import MAX_UNIQUE_KEY_LENGTH

    assert MAX_UNIQUE_KEY_LENGTH == 200
    assert "longer than 200 characters" in normalized(page("docs/how-to/periodic-jobs.md").text)


def test_the_fair_shares_page_gives_the_fair_claim_s_bounds() -> None:
    from sqla_jobs._queries import claiming, fair

    assert claiming.FAIR_ALONE == 0.1
    assert claiming.FAIR_PASS == 64
    assert fair.DUE_LOOKAHEAD == 16
    assert validation.MAX_FAIR_WEIGHT == 1_000
    text = normalized(page("docs/how-to/fair-shares.md").text)
    for shown in (
        "plain ones for 0.1 s",
        "at most 64 such tenants",
        "one of its first 16 jobs in claim order is due",
        "an integer from 1 to 1,000",
    ):
        assert shown in text
