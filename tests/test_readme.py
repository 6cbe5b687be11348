"""The README, as a new user reads it: its code runs, and what it states holds.

Every fenced block of README.md has a language, one of :data:`LANGUAGES`. Every ``python``
block runs, top to bottom, in one namespace (each continues the ones before it, as the README
says), on a fresh database whose URL replaces :data:`README_URL`, unless an HTML comment right
before its fence marks it:

``<!-- readme-test: not run, REASON -->``
    compiled only; the README's text must say what the block leaves out.
``<!-- readme-test: alembic revision ... -->``
    a revision file: its ``upgrade()`` and ``downgrade()`` run inside an Alembic migration
    context on a database of their own.

An unmarked block that does not run fails, and so does a block in an unknown language (a
Python block hidden as ```` ```py ```` or an unlabelled fence), or a marker that is not right
before a Python block. After the blocks, the test checks what they did, runs the jobs the
Workers section enqueued through a real :class:`~sqla_jobs.Worker`, calls the ``test_*``
functions the blocks define with a session whose transaction is rolled back, and parses every
``sqla-jobs`` command of the ``sh`` blocks with the command's own parser.

The rest of the module checks claims the README makes in prose: the column tables against
the mixins, the name rule against the code, what a failed check leaves behind, ``last_error``
after a later success, ``Task.job`` with a relationship.
"""

from __future__ import annotations

import re
import shlex
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations
from conftest import FreshDatabase
from models import EmailJob, EmailJobResult, Order
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import PendingRollbackError
from sqlalchemy.orm import MappedColumn, Session
from sqlalchemy.schema import DefaultClause, FetchedValue
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import InvalidJobError, JobMixin, JobResultMixin, Registry, validation
from sqla_jobs.cli import build_parser
from sqla_jobs.migrations import check_claim_indexes

README = Path(__file__).resolve().parents[1] / "README.md"
README_URL = "postgresql+psycopg://app@localhost/app"
LANGUAGES = frozenset({"python", "sh", "ini", "text"})
MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
NOT_RUN = "not run"
ALEMBIC = "alembic revision"


@dataclass(frozen=True)
class Block:
    """One fenced block of the README."""

    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # the readme-test comment right before the fence, if any
    marker_line: int | None

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language == "python" and self.marker is None


def read_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.lstrip().startswith(("```", "~~~")):
            index += 1
            continue
        assert line.startswith("```"), f"README.md:{index + 1}: indent fences with ``` only"
        language = line[3:].strip()
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"README.md:{index + 1}: the block is never closed"
        before = index - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        found = MARKER.fullmatch(lines[before].strip()) if before >= 0 else None
        blocks.append(
            Block(
                line=index + 1,
                language=language,
                code="\n".join(lines[index + 1 : end]) + "\n",
                marker=found.group(1) if found else None,
                marker_line=before + 1 if found else None,
            )
        )
        index = end + 1
    return blocks


def markers(text: str) -> list[tuple[int, str]]:
    return [
        (number, found.group(1))
        for number, line in enumerate(text.splitlines(), start=1)
        if (found := MARKER.fullmatch(line.strip()))
    ]


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def normalized(text: str) -> str:
    return " ".join(text.split())


# -- the blocks -------------------------------------------------------------------------------


def test_every_block_is_labelled_and_every_python_block_is_run_or_marked() -> None:
    text = readme_text()
    blocks = read_blocks(text)
    assert any(block.runs for block in blocks)
    for block in blocks:
        assert block.language in LANGUAGES, (
            f"{block.where}: fence language {block.language!r}; use one of {sorted(LANGUAGES)}"
        )
        if block.marker is not None:
            assert block.language == "python", f"{block.where}: a marker before a non-Python block"
            kind, _, reason = block.marker.partition(",")
            known = block.marker.startswith(ALEMBIC) or (kind == NOT_RUN and reason.strip())
            assert known, (
                f"{block.where}: unknown marker {block.marker!r}; use "
                f"'{NOT_RUN}, REASON' or '{ALEMBIC}'"
            )
        if block.language == "python":
            compile(block.code, block.where, "exec")
    attached = {block.marker_line for block in blocks}
    for number, marker in markers(text):
        assert number in attached, (
            f"README.md:{number}: marker {marker!r} is not right before a Python block"
        )


@dataclass
class Snippets:
    """The README's Python blocks, run: their namespace and their database."""

    namespace: dict[str, Any]
    url: str
    engine: sa.Engine


@pytest.fixture(scope="module")
def snippets(fresh_database: FreshDatabase) -> Iterator[Snippets]:
    """Run every unmarked Python block of the README, in order, in one module namespace."""
    url = fresh_database("sqla_jobs_readme")
    runnable = [block for block in read_blocks(readme_text()) if block.runs]
    literal = f'"{README_URL}"'
    holders = [block for block in runnable if literal in block.code]
    assert len(holders) == 1, f"exactly one block should create the engine on {README_URL}"
    module = types.ModuleType("readme_snippets")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    try:
        for block in runnable:
            code = compile(block.code.replace(literal, repr(url)), block.where, "exec")
            try:
                exec(code, namespace)
            except Exception as exc:
                raise AssertionError(f"the block at {block.where} failed: {exc!r}") from exc
        engine = namespace["engine"]
        assert isinstance(engine, sa.Engine)
        assert engine.url.render_as_string(hide_password=False) == url
        yield Snippets(namespace, url, engine)
    finally:
        engine = namespace.get("engine")
        if isinstance(engine, sa.Engine):
            engine.dispose()
        del sys.modules[module.__name__]


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as connection:
        return connection.execute(sa.text(sql), params).scalar()


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


def test_bad_input_block_commits_the_order_without_the_job(snippets: Snippets) -> None:
    assert scalar(snippets.engine, "SELECT count(*) FROM orders WHERE id = 10") == 1
    assert scalar(snippets.engine, "SELECT count(*) FROM email_jobs WHERE task = '-x'") == 0


def test_async_block_enqueues_and_completes_through_asyncpg(snippets: Snippets) -> None:
    async_engine = snippets.namespace["async_engine"]
    assert async_engine.dialect.driver == "asyncpg"
    assert scalar(snippets.engine, "SELECT count(*) FROM orders WHERE id = 11") == 1
    value = scalar(
        snippets.engine,
        "SELECT r.value FROM email_job_results r JOIN email_jobs j ON j.id = r.job_id "
        "WHERE j.order_id = 11 AND j.status = 'succeeded'",
    )
    assert value == "receipt for order 11"


def test_the_test_functions_the_blocks_define_pass(snippets: Snippets) -> None:
    tests = {
        name: value
        for name, value in snippets.namespace.items()
        if name.startswith("test_") and callable(value)
    }
    assert tests, "the Testing section defines a test"
    for test in tests.values():
        with snippets.engine.connect() as connection:
            outer = connection.begin()
            session = Session(bind=connection, join_transaction_mode="create_savepoint")
            try:
                test(session)
            finally:
                session.close()
                outer.rollback()
    assert scalar(snippets.engine, "SELECT count(*) FROM orders WHERE id = 9") == 0


def test_workers_section_jobs_run_in_a_worker(snippets: Snippets) -> None:
    namespace = snippets.namespace
    registry = namespace["registry"]
    assert isinstance(registry, Registry)
    engine = sa.create_engine(snippets.url, pool_size=10, pool_pre_ping=True)
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

    db = snippets.engine
    receipt_id = scalar(
        db, "SELECT id FROM email_jobs WHERE task = 'send_receipt' AND order_id = 8"
    )
    assert receipt_id is not None  # Task.job(..., order=order) set the foreign key
    value = scalar(db, "SELECT value FROM email_job_results WHERE job_id = :id", id=receipt_id)
    assert value == f"message-receipt-{receipt_id}"  # keyed by ctx.job.id
    assert scalar(db, "SELECT count(*) FROM payments WHERE order_id = 8") == 1
    assert scalar(db, "SELECT queue FROM email_jobs WHERE task = 'charge'") == "billing"


def test_alembic_revision_block_builds_what_the_models_declare(
    snippets: Snippets, fresh_database: FreshDatabase
) -> None:
    (block,) = [b for b in read_blocks(readme_text()) if (b.marker or "").startswith(ALEMBIC)]
    revision: dict[str, Any] = {}
    exec(compile(block.code, block.where, "exec"), revision)
    engine = sa.create_engine(fresh_database("sqla_jobs_readme_alembic"))
    try:
        with engine.begin() as connection:
            connection.execute(sa.text("CREATE TABLE orders (id integer PRIMARY KEY)"))
            with Operations.context(MigrationContext.configure(connection)):
                revision["upgrade"]()
        with engine.connect() as connection:
            job_model = snippets.namespace["EmailJob"]
            assert check_claim_indexes(connection, job_model) == []
            inspector = sa.inspect(connection)
            for model in (job_model, snippets.namespace["EmailJobResult"]):
                table = model.__table__
                columns = {c["name"] for c in inspector.get_columns(table.name)}
                assert columns == {c.name for c in table.columns}
        with engine.begin() as connection:
            with Operations.context(MigrationContext.configure(connection)):
                revision["downgrade"]()
            assert set(sa.inspect(connection).get_table_names()) == {"orders"}
    finally:
        engine.dispose()


def commands(block: Block) -> Iterator[list[str]]:
    for line in block.code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "sqla-jobs":
            yield words[1:]


def test_every_sqla_jobs_command_in_the_readme_parses() -> None:
    from sqla_jobs.bench import runner as bench

    seen = 0
    for block in read_blocks(readme_text()):
        if block.language != "sh":
            continue
        for argv in commands(block):
            seen += 1
            if "--baseline" in argv:  # the checkout it names is the reader's: this one here
                argv[argv.index("--baseline") + 1] = str(Path(sqla_jobs.__file__).parent.parent)
            try:
                args, unknown = build_parser().parse_known_args(argv)
                if args.command == "bench":
                    bench._config(
                        bench._parser().parse_args([*unknown, *args.bench_args]), "postgresql://"
                    )
                else:
                    assert unknown == [], f"{block.where}: sqla-jobs {argv}: unknown {unknown}"
            except SystemExit as exc:
                raise AssertionError(f"{block.where}: `sqla-jobs {shlex.join(argv)}`") from exc
    assert seen >= 8


# -- the column tables ---------------------------------------------------------------------


def column_tables(text: str) -> list[list[list[str]]]:
    """The tables of the README's "The columns" section: rows of cells, backticks removed."""
    section = text.split("### The columns", 1)[1].split("\n#", 1)[0]
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*section.splitlines(), ""]:
        if line.startswith("| `"):
            current.append([cell.strip().replace("`", "") for cell in line.strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables


PG_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]


def described(column: sa.Column[Any]) -> list[str]:
    """``[name, type, default]`` as the README's tables write them."""
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
    job_table, result_table = column_tables(readme_text())
    assert [row[:3] for row in job_table] == mixin_columns(JobMixin, EmailJob)
    assert [row[:3] for row in result_table] == mixin_columns(JobResultMixin, EmailJobResult)
    assert all(row[3] for row in job_table + result_table), "every column has a meaning"


# -- the name rule -----------------------------------------------------------------------------


def test_readme_quotes_the_name_rule_the_code_enforces() -> None:
    assert normalized(validation.NAME_RULE) in normalized(readme_text())
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


# -- what a failed check leaves behind -----------------------------------------------------------


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


# -- last_error, Task.job ----------------------------------------------------------------------


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
