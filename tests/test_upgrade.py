"""A job table of an older schema version, full of jobs, upgraded to the current one.

Each test builds the table as an older release's revision did (``create_job_table`` at
version 1 or 2, the package's frozen definitions), fills it with jobs in every status as the
workers of that release left them (their workers are stopped), checks that a worker of this
version refuses to start on it with one line naming the helpers to run (from Python and from
the command line) and claims nothing, runs the helpers in that order as a revision runs
them, then drains the table with a real worker and checks from SQL that nothing was lost.
See docs/operations/upgrading.md.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import models
import pytest
import sqlalchemy as sa
import worker_tasks
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from conftest import FreshDatabase
from doc_blocks import DOCS, load
from sqlalchemy.pool import NullPool
from worker_harness import JobDatabase, running, subprocess_env, wait_until
from worker_tasks import WorkerJob, registry

from sqla_jobs import migrations, names
from sqla_jobs._queries import table_layout
from sqla_jobs.errors import ConfigurationError, SchemaVersionError
from sqla_jobs.worker import Worker
from sqla_jobs.worker.table_version import table_version

TABLE = "worker_jobs"
V2 = "sqla_jobs.migrations.upgrade_job_table_to_v2('worker_jobs')"
V3 = "sqla_jobs.migrations.upgrade_job_table_to_v3('worker_jobs')"
V4 = "sqla_jobs.migrations.upgrade_job_table_to_v4('worker_jobs')"
# What each older layout's refusal says, word for word (docs/operations/upgrading.md).
REFUSALS = {
    1: (
        "job table 'worker_jobs' has the layout of schema version 1 and this worker needs "
        f"version 4: upgrade it from an Alembic revision with {V2}, then {V3}, then {V4}"
    ),
    2: (
        "job table 'worker_jobs' has the layout of schema version 2 and this worker needs "
        f"version 4: upgrade it from an Alembic revision with {V3}, then {V4}"
    ),
    3: (
        "job table 'worker_jobs' has the layout of schema version 3 and this worker needs "
        f"version 4: upgrade it from an Alembic revision with {V4}"
    ),
}
# The columns every schema version has: what the old workers wrote, compared before and after.
V1_COLUMNS = (
    "id, queue, task, args, status, priority, run_at, attempts, max_attempts, "
    "lease_expires_at, leased_by, last_error, created_at, finished_at"
)
PER_KIND = 5
# Jobs in every status, as an older release's workers left them, told apart by args->>'kind'
# (the handler ignores it): status, attempts, max_attempts, run_at, lease_expires_at,
# leased_by, last_error, finished_at.
OLD_JOBS = """
    INSERT INTO worker_jobs (queue, task, args, status, attempts, max_attempts, run_at,
                             lease_expires_at, leased_by, last_error, finished_at)
    SELECT 'work', 'sleepy_locked', jsonb_build_object('kind', k.kind), k.status, k.attempts,
           k.max_attempts, now() + k.run_in, now() + k.lease_in, k.leased_by, k.last_error,
           now() + k.finished_in
    FROM generate_series(1, :per_kind) AS n, (VALUES
        ('due',       'pending',   0, 20, interval '-1 minute', NULL::interval, NULL, NULL,
         NULL::interval),
        ('delayed',   'pending',   0, 20, interval '1 hour', NULL, NULL, NULL, NULL),
        ('retry',     'pending',   1, 20, interval '-1 second', NULL, NULL, 'boom', NULL),
        ('live',      'running',   1, 20, interval '-1 minute', interval '1 hour',
         'old-worker', NULL, NULL),
        ('expired',   'running',   1, 20, interval '-2 minutes', interval '-1 minute',
         'old-worker', NULL, NULL),
        ('succeeded', 'succeeded', 1, 20, interval '-2 hours', NULL, NULL, NULL,
         interval '-1 hour'),
        ('dead',      'dead',      3, 3, interval '-2 hours', NULL, NULL, 'boom',
         interval '-1 hour'),
        ('cancelled', 'cancelled', 0, 20, interval '-2 hours', NULL, NULL, NULL,
         interval '-1 hour')
    ) AS k(kind, status, attempts, max_attempts, run_in, lease_in, leased_by, last_error,
           finished_in)
    ORDER BY n, k.kind
"""
RUNNABLE = ("due", "retry", "expired")  # run by the first drain
WAITING = ("delayed", "live")  # not yet: their run_at, or another worker's lease
FINISHED = ("succeeded", "dead", "cancelled")  # never again


def migrate(engine: sa.Engine, step: Callable[[], object]) -> None:
    """Run migration helpers as a revision's ``upgrade()`` runs them, and commit."""
    with engine.connect() as connection:
        context = MigrationContext.configure(connection)
        with Operations.context(context), context.begin_transaction():
            step()


Rows = dict[int, dict[str, Any]]


def rows(engine: sa.Engine, where: str = "true") -> Rows:
    """The jobs by id, each with the columns of every version and its kind."""
    query = f"SELECT {V1_COLUMNS}, args->>'kind' AS kind FROM {TABLE} WHERE {where}"
    with engine.connect() as connection:
        return {row.id: dict(row._mapping) for row in connection.execute(sa.text(query))}


def of_kind(jobs: Rows, *kinds: str) -> Rows:
    return {job_id: job for job_id, job in jobs.items() if job["kind"] in kinds}


def results(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        query = "SELECT job_id, task, value, finished_at FROM worker_job_results ORDER BY 1"
        return [tuple(row) for row in connection.execute(sa.text(query))]


def effects(engine: sa.Engine) -> list[tuple[int, int]]:
    """(job id, attempt) of every effect a handler committed, in order."""
    with engine.connect() as connection:
        query = "SELECT job_id, attempt FROM worker_effects WHERE kind = 'effect' ORDER BY 1, 2"
        return [(row.job_id, row.attempt) for row in connection.execute(sa.text(query))]


def count_by_status(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as connection:
        query = f"SELECT status, count(*) AS n FROM {TABLE} GROUP BY status"
        return {row.status: int(row.n) for row in connection.execute(sa.text(query))}


@pytest.fixture
def old_table(
    request: pytest.FixtureRequest, fresh_database: FreshDatabase, monkeypatch: pytest.MonkeyPatch
) -> Iterator[JobDatabase]:
    """The worker tests' database with the job table at schema version ``request.param``,
    full of jobs in every status; the handlers of :mod:`worker_tasks` connect to it."""
    version: int = request.param
    url = fresh_database("sqla_jobs_upgrade")
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        migrate(
            engine,
            lambda: (
                migrations.create_job_table(TABLE, version=version),
                migrations.create_result_table("worker_job_results"),
            ),
        )
        with engine.begin() as connection:
            connection.execute(sa.text(OLD_JOBS), {"per_kind": PER_KIND})
            connection.execute(
                sa.text(
                    "INSERT INTO worker_job_results (job_id, task, value, finished_at) "
                    f"SELECT id, task, jsonb_build_object('id', id), finished_at FROM {TABLE} "
                    "WHERE status = 'succeeded'"
                )
            )
    finally:
        engine.dispose()
    database = JobDatabase(url)  # creates what is missing: the effects table
    monkeypatch.setenv(worker_tasks.DATABASE_URL_VARIABLE, url)
    try:
        yield database
    finally:
        worker_tasks.forget_engines()
        database.dispose()


def refusal(db: JobDatabase) -> SchemaVersionError:
    """Start a worker of this version in a thread, as an application would; return what it
    raised."""
    engine = sa.create_engine(db.url, pool_size=10)
    try:
        worker = Worker(registry, engine, handle_signals=False, poll_interval=0.1)
        with pytest.raises(SchemaVersionError) as raised:
            worker.start()
        assert not worker.is_healthy()
    finally:
        engine.dispose()
    return raised.value


def command_line_refusal(db: JobDatabase, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``sqla-jobs worker worker_tasks:registry`` on the table, as a deployment runs it."""
    return subprocess.run(
        [sys.executable, "-m", "sqla_jobs", "worker", "worker_tasks:registry", "--queues", "work"],
        cwd=tmp_path,
        env=subprocess_env(db.url),
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_refused(db: JobDatabase, tmp_path: Path, version: int, helpers: list[str]) -> None:
    before = rows(db.engine)
    error = refusal(db)
    assert str(error) == REFUSALS[version]
    assert (error.table, error.version, list(error.helpers)) == (TABLE, version, helpers)
    assert isinstance(error, ConfigurationError)  # what Worker.start() documents
    cli = command_line_refusal(db, tmp_path)
    assert (cli.returncode, cli.stdout) == (1, "")
    assert cli.stderr.splitlines() == [f"sqla-jobs: error: {REFUSALS[version]}"]
    assert rows(db.engine) == before  # nothing claimed, nothing touched
    assert effects(db.engine) == []


def drain_and_check(db: JobDatabase, before: Rows, finished_results: list[tuple[Any, ...]]) -> None:
    """Drain the upgraded table with a real worker; check from SQL that every runnable job
    ran exactly once, that the waiting ones waited, and that the finished ones are as the
    old workers left them."""
    runnable = of_kind(before, *RUNNABLE)
    waiting = of_kind(before, *WAITING)
    finished = of_kind(before, *FINISHED)
    ids = ", ".join(str(job_id) for job_id in runnable)
    with running(db, concurrency=4):
        wait_until(
            lambda: all(
                job["status"] == "succeeded" for job in rows(db.engine, f"id IN ({ids})").values()
            ),
            timeout=60,
            message="the runnable jobs of the old table succeeded",
        )
        # The delayed jobs wait for their run_at, the live leases for their holder (a worker
        # of the old version that is gone, so here for their end): untouched until then.
        assert of_kind(rows(db.engine), *WAITING) == waiting
        with db.engine.begin() as connection:
            connection.execute(
                sa.text(
                    f"UPDATE {TABLE} SET run_at = now(), "
                    "lease_expires_at = CASE WHEN status = 'running' THEN now() END "
                    "WHERE args->>'kind' IN ('delayed', 'live')"
                )
            )
        wait_until(
            lambda: count_by_status(db.engine).keys() <= {"succeeded", "dead", "cancelled"},
            timeout=60,
            message="every job of the old table finished",
        )
    after = rows(db.engine)
    assert set(after) == set(before)  # none lost, none added
    # Every runnable job ran exactly once (one committed effect, by the attempt that
    # succeeded), after the old workers' last attempt. Usually as the very next attempt; on a
    # busy machine a claimed job whose 1 s lease ran out before it started is given back
    # unstarted, and the attempt that runs it has a higher number.
    ran = {**runnable, **waiting}
    assert effects(db.engine) == sorted((job_id, after[job_id]["attempts"]) for job_id in ran)
    for job_id, job in ran.items():
        assert after[job_id]["status"] == "succeeded"
        assert after[job_id]["attempts"] > job["attempts"]
    # The finished jobs, and the results of the succeeded ones, are as they were.
    assert of_kind(after, *FINISHED) == finished
    assert [r for r in results(db.engine) if r[0] in finished] == finished_results
    assert count_by_status(db.engine) == {
        "succeeded": PER_KIND * (1 + len(RUNNABLE) + len(WAITING)),
        "dead": PER_KIND,
        "cancelled": PER_KIND,
    }


def assert_current(db: JobDatabase) -> None:
    """What the upgrade guide says to verify: check_job_tables, and autogenerate's diff of the
    job table (what ``alembic check`` compares) against the model."""
    with db.engine.connect() as connection:
        assert migrations.check_job_tables(connection, WorkerJob) == []
        context = MigrationContext.configure(
            connection,
            opts={
                "compare_type": True,
                "compare_server_default": True,
                "include_object": lambda _, name, type_, *__: type_ != "table" or name == TABLE,
            },
        )
        assert compare_metadata(context, worker_tasks.Base.metadata) == []


@pytest.mark.parametrize("old_table", [1], indirect=True)
def test_a_version_1_table_is_refused_then_upgraded_and_drained_with_nothing_lost(
    old_table: JobDatabase, tmp_path: Path
) -> None:
    db = old_table
    before = rows(db.engine)
    assert count_by_status(db.engine) == {
        "pending": 3 * PER_KIND,
        "running": 2 * PER_KIND,
        "succeeded": PER_KIND,
        "dead": PER_KIND,
        "cancelled": PER_KIND,
    }
    finished_results = results(db.engine)
    assert len(finished_results) == PER_KIND
    assert_refused(db, tmp_path, 1, [V2, V3, V4])

    migrate(db.engine, lambda: migrations.upgrade_job_table_to_v2(TABLE))
    assert_refused(db, tmp_path, 2, [V3, V4])  # half-way: the next helpers only
    migrate(db.engine, lambda: migrations.upgrade_job_table_to_v3(TABLE))
    assert_refused(db, tmp_path, 3, [V4])
    migrate(db.engine, lambda: migrations.upgrade_job_table_to_v4(TABLE))

    assert rows(db.engine) == before
    assert_current(db)
    drain_and_check(db, before, finished_results)


@pytest.mark.parametrize("old_table", [2], indirect=True)
def test_a_version_2_table_is_refused_until_the_whole_version_3_upgrade_has_run(
    old_table: JobDatabase, tmp_path: Path
) -> None:
    db = old_table
    before = rows(db.engine)
    finished_results = results(db.engine)
    assert_refused(db, tmp_path, 2, [V3, V4])

    # One feature of version 3 alone (what an interrupted upgrade leaves): still refused,
    # with the same helpers, which run again over what is already there.
    migrate(db.engine, lambda: migrations.add_unique_keys(TABLE))
    assert_refused(db, tmp_path, 2, [V3, V4])
    migrate(db.engine, lambda: migrations.add_job_control(TABLE))  # version 4's alone
    assert_refused(db, tmp_path, 2, [V3, V4])
    migrate(db.engine, lambda: migrations.upgrade_job_table_to_v3(TABLE))
    migrate(db.engine, lambda: migrations.upgrade_job_table_to_v4(TABLE))

    assert rows(db.engine) == before
    assert_current(db)
    drain_and_check(db, before, finished_results)


# -- the upgrade guide's revisions ------------------------------------------------------------

GUIDE = DOCS / "operations" / "upgrading.md"


def test_the_upgrade_guide_quotes_each_refusal_word_for_word() -> None:
    text = GUIDE.read_text()
    for version, refusal in REFUSALS.items():
        line = f"sqla-jobs: error: {refusal}".replace(repr(TABLE), "'email_jobs'")
        assert f"\n{line}\n" in text, f"the guide does not quote the version-{version} refusal"


def guide_revisions() -> dict[str, dict[str, Any]]:
    """The revision files of the upgrade guide by file name (``0007_email_jobs_v2.py``), each
    executed into a namespace of its own (tests/test_docs.py runs them too, without looking
    at the data)."""
    found: dict[str, dict[str, Any]] = {}
    for block in load(GUIDE).blocks:
        name = re.match(r"# alembic/versions/(\w+\.py)", block.code)
        if block.language == "python" and name:
            namespace: dict[str, Any] = {}
            exec(compile(block.code, block.where, "exec"), namespace)
            found[name.group(1)] = namespace
    assert len(found) == 6, sorted(found)
    return found


def tables(engine: sa.Engine) -> set[str]:
    with engine.connect() as connection:
        return set(sa.inspect(connection).get_table_names())


def layout_version(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as connection:
        found = connection.execute(table_layout(table)).one()
    return table_version(table, found.columns, found.indexes, pauses=found.pauses)


@pytest.fixture
def guide_engine(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(fresh_database("sqla_jobs_guide"), poolclass=NullPool)
    with engine.begin() as connection:  # what the guide's first revision refers to
        connection.execute(sa.text("CREATE TABLE orders (id integer PRIMARY KEY)"))
    try:
        yield engine
    finally:
        engine.dispose()


def test_the_upgrade_guides_revisions_upgrade_a_version_1_table_and_back(
    guide_engine: sa.Engine,
) -> None:
    revisions = guide_revisions()
    names = (
        "0001_email_jobs.py",
        "0007_email_jobs_v2.py",
        "0008_email_jobs_v3.py",
        "0009_email_jobs_v4.py",
    )
    steps = [revisions[name] for name in names]
    email_jobs: sa.Table = models.EmailJob.__table__  # type: ignore[assignment]
    before = tables(guide_engine)
    versions = []
    for revision in steps:
        migrate(guide_engine, revision["upgrade"])
        versions.append(layout_version(guide_engine, email_jobs))
    assert versions == [1, 2, 3, 4]
    with guide_engine.connect() as connection:
        assert migrations.check_job_tables(connection, models.EmailJob) == []
    for revision in reversed(steps):
        migrate(guide_engine, revision["downgrade"])
    assert tables(guide_engine) == before


def test_the_upgrade_guides_downgrade_keeps_the_finished_jobs_of_a_history(
    guide_engine: sa.Engine,
) -> None:
    revisions = guide_revisions()
    made, back = revisions["0010_invoice_jobs.py"], revisions["0012_invoice_jobs_back_to_v2.py"]
    before = tables(guide_engine)
    migrate(guide_engine, made["upgrade"])
    with guide_engine.begin() as connection:
        connection.execute(
            sa.text(
                "INSERT INTO invoice_jobs_history (id, queue, task, args, status, priority, "
                "run_at, attempts, max_attempts, created_at, finished_at, customer, result) "
                "VALUES (41, 'q', 'bill', '{}', 'succeeded', 0, now(), 1, 20, now(), now(), "
                "'ada', '1')"
            )
        )
        connection.execute(sa.text("INSERT INTO invoice_jobs (task) VALUES ('bill')"))
    assert "invoice_jobs_history" in tables(guide_engine)

    assert "invoice_jobs_pauses" in tables(guide_engine)  # made at version 4

    migrate(guide_engine, back["upgrade"])
    assert {"invoice_jobs_history", "invoice_jobs_pauses"}.isdisjoint(tables(guide_engine))
    invoice_jobs = sa.Table("invoice_jobs", sa.MetaData(), autoload_with=guide_engine)
    assert "ordering_key" not in invoice_jobs.c  # version 2
    assert "snoozes" not in invoice_jobs.c
    with guide_engine.connect() as connection:
        kept = connection.execute(
            sa.text("SELECT id, status, customer FROM invoice_jobs ORDER BY status")
        ).all()
    assert [tuple(row) for row in kept] == [(1, "pending", None), (41, "succeeded", "ada")]

    migrate(guide_engine, back["downgrade"])
    assert {"invoice_jobs_history", "invoice_jobs_pauses"} <= tables(guide_engine)
    migrate(guide_engine, made["downgrade"])
    assert tables(guide_engine) == before


def test_the_version_is_told_by_the_mixins_columns_and_indexes_alone() -> None:
    # A copy of the model with a column and a partial index of the application's own, which
    # no helper of the library makes: their absence is not an older schema version.
    model: sa.Table = WorkerJob.__table__  # type: ignore[assignment]
    table = model.to_metadata(sa.MetaData())
    table.append_column(sa.Column("note", sa.Text))
    sa.Index("worker_jobs_note_idx", table.c.note, postgresql_where=sa.text("note IS NOT NULL"))
    n = names(TABLE)
    columns = [c.name for c in model.columns]
    v3 = [n.pending_index, n.running_index, n.dead_index, n.unique_index]
    v3 += [n.keyed_pending_index, n.key_index]
    assert table_version(table, columns, v3) == 4  # version 4 changed no index
    assert table_version(table, [c for c in columns if c != "snoozes"], v3) == 3
    assert table_version(table, columns, [*v3, n.claim_index]) == 1  # the old index left over
    assert table_version(table, columns, v3[1:]) == 1  # no pending index
    assert table_version(table, [c for c in columns if c != "trace_context"], v3) == 2
    assert table_version(table, columns, [i for i in v3 if i != n.key_index]) == 2


def test_a_version_4_table_without_its_pause_table_is_version_3() -> None:
    model: sa.Table = WorkerJob.__table__  # type: ignore[assignment]
    n = names(TABLE)
    columns = [c.name for c in model.columns]
    indexes = [n.pending_index, n.running_index, n.dead_index, n.unique_index]
    indexes += [n.keyed_pending_index, n.key_index]
    assert table_version(model, columns, indexes, pauses=True) == 4
    assert table_version(model, columns, indexes, pauses=False) == 3
