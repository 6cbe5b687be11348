"""The migrations build what the models declare, and the NOTIFY trigger does what it says.

Every test works in a database of its own (``fresh_database``). The example application
environment is ``alembic/`` at the repository root (found from this file, so it works with
the installed wheel too); the library's own revisions are found through the installed
``sqla_jobs.migrations`` package.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import models
import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata, produce_migrations
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.operations import Operations
from alembic.operations.ops import ModifyTableOps
from conftest import FreshDatabase
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import sqla_jobs
import sqla_jobs.models
from sqla_jobs import _queries as statements
from sqla_jobs import ddl, migrations, names
from sqla_jobs.schema.pauses import pause_table
from sqla_jobs.schema.workflows import workflow_names
from sqla_jobs.urls import libpq_url

EXAMPLE_ENV = Path(__file__).resolve().parents[1] / "alembic"
JOB_MODELS = (
    models.EmailJob,
    models.ReportJob,
    models.ArchiveJob,
    models.TenantJob,
    models.OrderJob,
    sqla_jobs.models.Job,
)
VERSION_TABLES = ("alembic_version", migrations.VERSION_TABLE)


def example_config(url: str, output: io.StringIO | None = None) -> Config:
    """The example environment, as ``alembic -c alembic/alembic.ini -x url=<url>``."""
    return Config(
        EXAMPLE_ENV / "alembic.ini",
        cmd_opts=argparse.Namespace(x=[f"url={url}"]),
        attributes={"configure_logger": False},
        output_buffer=output,
    )


@pytest.fixture
def db_engine(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(fresh_database("sqla_jobs_mig"), poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


def url_of(engine: sa.Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def all_metadata() -> sa.MetaData:
    """The application's tables and the default tables in one MetaData, for comparison."""
    merged = sa.MetaData()
    for metadata in (models.Base.metadata, sqla_jobs.models.metadata):
        for table in metadata.tables.values():
            table.to_metadata(merged)
    return merged


def schema_differences(engine: sa.Engine, metadata: sa.MetaData) -> list[Any]:
    """Alembic autogenerate's diff between the database and ``metadata``."""
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={
                "compare_type": True,
                "compare_server_default": True,
                "include_name": lambda name, type_, parent: (
                    (type_ != "table" or name not in VERSION_TABLES)
                    and migrations.include_name(name, type_, parent)
                ),
            },
        )
        return list(compare_metadata(context, metadata))


def catalog(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    """What PostgreSQL holds in ``public``, beyond Alembic's version tables."""
    queries = {
        "tables": """
            SELECT relname, reloptions FROM pg_class
            WHERE relnamespace = 'public'::regnamespace AND relkind = 'r'
              AND relname <> ALL (:version_tables)
        """,
        "columns": """
            SELECT table_name, column_name, data_type, character_maximum_length,
                   is_nullable, column_default, is_identity, identity_generation
            FROM information_schema.columns
            WHERE table_schema = 'public' AND table_name <> ALL (:version_tables)
        """,
        "constraints": """
            SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
            FROM pg_constraint
            WHERE connamespace = 'public'::regnamespace
              AND conrelid::regclass::text <> ALL (:version_tables)
        """,
        "indexes": """
            SELECT tablename, indexname, indexdef FROM pg_indexes
            WHERE schemaname = 'public' AND tablename <> ALL (:version_tables)
        """,
        "triggers": """
            SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger
            WHERE NOT tgisinternal
        """,
        "functions": """
            SELECT proname, pg_get_functiondef(oid) FROM pg_proc
            WHERE pronamespace = 'public'::regnamespace
        """,
    }
    params = {"version_tables": list(VERSION_TABLES)}
    with engine.connect() as connection:
        return {
            key: sorted(tuple(row) for row in connection.execute(sa.text(sql), params))
            for key, sql in queries.items()
        }


def test_upgrade_heads_matches_the_models(db_engine: sa.Engine) -> None:
    command.upgrade(example_config(url_of(db_engine)), "heads")

    assert schema_differences(db_engine, all_metadata()) == []
    with db_engine.connect() as connection:
        assert migrations.check_job_tables(connection, *JOB_MODELS) == []
        versions = connection.execute(sa.text("SELECT version_num FROM alembic_version"))
        assert sorted(versions.scalars()) == ["0008_order_workflows", "sqla_jobs_0004"]
    triggers = {(table, name) for table, name, _definition in catalog(db_engine)["triggers"]}
    steps = workflow_names("order_jobs", "order_workflows")
    assert triggers == {
        (model.__tablename__, names(model.__tablename__).notify_trigger) for model in JOB_MODELS
    } | {("order_jobs", steps.trigger), ("order_jobs", steps.delete_trigger)}


def test_migrations_build_what_create_all_builds(
    db_engine: sa.Engine, fresh_database: FreshDatabase
) -> None:
    # Autogenerate does not compare check constraints, triggers, functions or storage
    # parameters; the catalog of a migrated database and of a create_all() one must match.
    command.upgrade(example_config(url_of(db_engine)), "heads")
    declared = sa.create_engine(fresh_database("sqla_jobs_mig"), poolclass=NullPool)
    try:
        models.Base.metadata.create_all(declared)
        sqla_jobs.models.metadata.create_all(declared)
        expected = catalog(declared)
        with declared.connect() as connection:
            assert migrations.check_job_tables(connection, *JOB_MODELS) == []
    finally:
        declared.dispose()

    migrated = catalog(db_engine)
    assert migrated == expected
    assert {row[0]: row[1] for row in migrated["tables"]}["email_jobs"] == [
        f"{key}={value}" for key, value in ddl.STORAGE_PARAMETERS.items()
    ]
    assert len(migrated["functions"]) == len(JOB_MODELS) + 1  # and order_jobs' workflow trigger's


def test_downgrade_base_leaves_nothing_of_ours(db_engine: sa.Engine) -> None:
    config = example_config(url_of(db_engine))
    command.upgrade(config, "heads")
    command.downgrade(config, "base")

    assert catalog(db_engine) == {
        "tables": [],
        "columns": [],
        "constraints": [],
        "indexes": [],
        "triggers": [],
        "functions": [],
    }
    # And the cycle can start again.
    command.upgrade(config, "heads")
    assert schema_differences(db_engine, all_metadata()) == []


def test_library_branch_alone(db_engine: sa.Engine) -> None:
    command.upgrade(example_config(url_of(db_engine)), "sqla_jobs@head")

    tables = {row[0] for row in catalog(db_engine)["tables"]}
    assert tables == {"sqla_jobs", "sqla_jobs_pauses", "sqla_jobs_results", "sqla_jobs_schedules"}


def test_offline_sql_renders_the_trigger(db_engine: sa.Engine) -> None:
    output = io.StringIO()
    command.upgrade(example_config(url_of(db_engine), output), "heads", sql=True)

    sql = output.getvalue()
    assert "CREATE TRIGGER email_jobs_notify_tg AFTER INSERT ON email_jobs" in sql
    assert "CREATE INDEX email_jobs_claim_idx ON email_jobs" in sql  # version 1 (0001)
    # ... upgraded to version 2 by 0002, concurrently, outside a transaction
    upgrade_2 = sql[sql.index("DROP INDEX CONCURRENTLY IF EXISTS email_jobs_pending_idx") :]
    assert sql[: len(sql) - len(upgrade_2)].rstrip().endswith("COMMIT;")
    for line in (
        "CREATE INDEX CONCURRENTLY email_jobs_pending_idx ON email_jobs",
        "CREATE INDEX CONCURRENTLY email_jobs_running_idx ON email_jobs",
        "DROP INDEX CONCURRENTLY IF EXISTS email_jobs_claim_idx",
    ):
        assert line in upgrade_2
    assert catalog(db_engine)["tables"] == []  # offline mode only prints


def test_programmatic_upgrade_creates_the_default_tables(db_engine: sa.Engine) -> None:
    migrations.upgrade(db_engine.url)

    assert {row[0] for row in catalog(db_engine)["tables"]} == {
        "sqla_jobs",
        "sqla_jobs_pauses",
        "sqla_jobs_results",
        "sqla_jobs_schedules",
    }
    assert schema_differences(db_engine, sqla_jobs.models.metadata) == []
    with db_engine.connect() as connection:
        assert migrations.check_job_tables(connection, sqla_jobs.models.Job) == []
        recorded = connection.execute(
            sa.text(f"SELECT version_num FROM {migrations.VERSION_TABLE}")
        )
        assert recorded.scalars().all() == ["sqla_jobs_0004"]

    migrations.downgrade(url_of(db_engine), "base")
    assert catalog(db_engine)["tables"] == []


def test_versions_path_is_the_installed_package_directory() -> None:
    path = migrations.versions_path()
    assert path == Path(migrations.__file__).resolve().parent / "versions"
    assert sorted(p.name for p in path.glob("*.py")) == [
        "0001_default_tables.py",
        "0002_claim_indexes.py",
        "0003_schema_v3.py",
        "0004_schema_v4.py",
    ]
    assert (path.parent / "env.py").is_file()
    assert (path.parent / "script.py.mako").is_file()


def test_check_claim_indexes_reports_differences(db_engine: sa.Engine) -> None:
    command.upgrade(example_config(url_of(db_engine)), "heads")
    index = names("email_jobs").pending_index
    with db_engine.begin() as connection:
        connection.execute(sa.text(f"DROP INDEX {index}"))
        connection.execute(
            sa.text(
                f"CREATE INDEX {index} ON email_jobs (queue, run_at) "
                "WHERE status IN ('pending', 'running')"
            )
        )
        problems = migrations.check_claim_indexes(connection, models.EmailJob, models.ReportJob)
        assert len(problems) == 2
        assert "predicate" in problems[0]
        assert "column list" in problems[1]

        connection.execute(sa.text(f"DROP INDEX {index}"))
        assert migrations.check_claim_indexes(connection, models.EmailJob) == [
            f"index {index} on email_jobs: missing from the database"
        ]
        # The check leaves no scratch table behind in the caller's transaction.
        scratch = connection.execute(sa.text("SELECT to_regclass('pg_temp.sqla_jobs_index_check')"))
        assert scratch.scalar() is None


def test_claim_indexes_can_be_rebuilt_concurrently(db_engine: sa.Engine) -> None:
    command.upgrade(example_config(url_of(db_engine)), "heads")

    with db_engine.connect() as connection:
        context = MigrationContext.configure(connection)
        with Operations.context(context), context.begin_transaction():
            migrations.drop_claim_indexes("email_jobs", concurrently=True, version=3)
            assert len(migrations.check_claim_indexes(connection, models.EmailJob)) == 4
            migrations.create_claim_indexes("email_jobs", concurrently=True, version=3)
    with db_engine.connect() as connection:
        assert migrations.check_claim_indexes(connection, models.EmailJob) == []


def test_the_version_1_claim_index_can_still_be_rebuilt_concurrently(
    db_engine: sa.Engine,
) -> None:
    # The version-1 helpers are frozen: an old revision that calls them still works.
    migrate(db_engine, lambda: migrations.create_job_table("email_jobs_v1"))
    v1 = names("email_jobs_v1")
    migrate(db_engine, lambda: migrations.drop_claim_index("email_jobs_v1", concurrently=True))
    assert index_definitions(db_engine, "email_jobs_v1") == {}
    migrate(db_engine, lambda: migrations.create_claim_index("email_jobs_v1", concurrently=True))
    assert index_definitions(db_engine, "email_jobs_v1") == {
        v1.claim_index: (
            "CREATE INDEX email_jobs_v1_claim_idx ON public.email_jobs_v1 USING btree "
            "(queue, priority, run_at, id) WHERE ((status)::text = ANY "
            "((ARRAY['pending'::character varying, 'running'::character varying])::text[]))"
        )
    }


def index_definitions(engine: sa.Engine, table: str) -> dict[str, str]:
    """The table's indexes but its primary key: name -> definition."""
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text(
                "SELECT indexname, indexdef FROM pg_indexes "
                "WHERE tablename = :table AND indexname <> :pkey"
            ),
            {"table": table, "pkey": f"{table}_pkey"},
        )
        return {row.indexname: row.indexdef for row in rows}


NO_TRIGGER_ON_EMAIL_JOBS = (
    "wake-up trigger email_jobs_notify_tg on email_jobs: missing, disabled or not the one "
    "sqla_jobs creates (autogenerate and a plain create_table make none), so workers see new "
    "jobs only when they poll; add it from a revision with "
    "sqla_jobs.migrations.create_notify_trigger('email_jobs') (after "
    "drop_notify_trigger('email_jobs') to replace one that is there but wrong)"
)


def create_as_autogenerate_would(engine: sa.Engine) -> None:
    """Create the models' tables with the operations of a revision that autogenerate wrote."""
    with engine.begin() as connection:
        context = MigrationContext.configure(connection)
        operations = Operations(context)
        upgrade = produce_migrations(context, models.Base.metadata).upgrade_ops
        assert upgrade is not None
        for operation in upgrade.ops:
            # A new table's indexes come as a ModifyTableOps that holds CreateIndexOps.
            nested = operation.ops if isinstance(operation, ModifyTableOps) else [operation]
            for each in nested:
                operations.invoke(each)


def migrate(engine: sa.Engine, step: Callable[[], object]) -> None:
    """Run migration helpers as a revision's ``upgrade()`` runs them, and commit."""
    with engine.connect() as connection:
        context = MigrationContext.configure(connection)
        with Operations.context(context), context.begin_transaction():
            step()


def wakeup_trigger_exists(connection: sa.Connection, table: sa.Table) -> bool:
    found = connection.execute(statements.wakeup_trigger_exists(table)).scalar_one()
    assert isinstance(found, bool)
    return found


def test_a_table_autogenerate_made_is_reported_until_the_helper_adds_the_trigger(
    db_engine: sa.Engine,
) -> None:
    create_as_autogenerate_would(db_engine)
    email_jobs: sa.Table = models.EmailJob.__table__  # type: ignore[assignment]

    with db_engine.connect() as connection:
        assert not wakeup_trigger_exists(connection, email_jobs)
        assert migrations.check_claim_indexes(connection, models.EmailJob) == []
        problems = migrations.check_job_tables(
            connection, models.EmailJob, models.EmailJobResult, models.ReportJob
        )
        assert problems == [NO_TRIGGER_ON_EMAIL_JOBS, problems[1]]
        assert "create_notify_trigger('report_jobs')" in problems[1]
        assert migrations.check_job_tables(connection, models.ReportJob, notify=False) == []

    migrate(db_engine, lambda: migrations.create_notify_trigger("email_jobs"))  # as it says
    with db_engine.connect() as connection:
        assert wakeup_trigger_exists(connection, email_jobs)
        assert migrations.check_job_tables(connection, models.EmailJob) == []


def test_a_table_the_helpers_made_is_clean_and_notify_false_is_reported(
    db_engine: sa.Engine,
) -> None:
    migrate(db_engine, lambda: migrations.create_job_table("report_jobs", version=4))
    migrate(db_engine, lambda: migrations.create_job_table("sqla_jobs", notify=False, version=4))
    with db_engine.connect() as connection:
        assert migrations.check_job_tables(connection, models.ReportJob) == []
        (problem,) = migrations.check_job_tables(connection, sqla_jobs.models.Job)
        assert "create_notify_trigger('sqla_jobs')" in problem
        assert migrations.check_job_tables(connection, sqla_jobs.models.Job, notify=False) == []


def test_the_trigger_is_found_by_quoted_names_in_another_schema(db_engine: sa.Engine) -> None:
    schema, name = "Job Schema", "MixedJobs"
    with db_engine.begin() as connection:
        connection.execute(sa.text(f"CREATE SCHEMA {ddl.quote(schema)}"))
    made: list[sa.Table] = []
    migrate(
        db_engine,
        lambda: made.append(migrations.create_job_table(name, schema=schema, version=4)),
    )
    migrate(db_engine, lambda: migrations.drop_notify_trigger(name, schema=schema))
    (table,) = made
    with db_engine.connect() as connection:
        assert not wakeup_trigger_exists(connection, table)
        (problem,) = migrations.check_job_tables(connection, table)
        assert "create_notify_trigger('MixedJobs', schema='Job Schema')" in problem
    migrate(db_engine, lambda: migrations.create_notify_trigger(name, schema=schema))
    with db_engine.connect() as connection:
        assert wakeup_trigger_exists(connection, table)
        assert migrations.check_job_tables(connection, table) == []


_OTHER_FUNCTION = (
    "CREATE FUNCTION other_notify_fn() RETURNS trigger LANGUAGE plpgsql AS "
    "$$BEGIN PERFORM pg_notify('email_jobs_jobs', 'x'); RETURN NULL; END$$"
)
_OTHER_CHANNEL = (
    "CREATE OR REPLACE FUNCTION email_jobs_notify_fn() RETURNS trigger LANGUAGE plpgsql AS "
    "$$BEGIN PERFORM pg_notify('elsewhere', 'x'); RETURN NULL; END$$"
)


def _replace_trigger(definition: str) -> list[str]:
    return [
        "DROP TRIGGER email_jobs_notify_tg ON email_jobs",
        f"CREATE TRIGGER email_jobs_notify_tg {definition}",
    ]


WRONG_TRIGGERS = {
    "disabled": ["ALTER TABLE email_jobs DISABLE TRIGGER email_jobs_notify_tg"],
    "dropped": ["DROP TRIGGER email_jobs_notify_tg ON email_jobs"],
    "per row": _replace_trigger(
        "AFTER INSERT ON email_jobs REFERENCING NEW TABLE AS new_jobs "
        "FOR EACH ROW EXECUTE FUNCTION email_jobs_notify_fn()"
    ),
    "before": _replace_trigger(
        "BEFORE INSERT ON email_jobs FOR EACH STATEMENT EXECUTE FUNCTION email_jobs_notify_fn()"
    ),
    "no transition table": _replace_trigger(
        "AFTER INSERT ON email_jobs FOR EACH STATEMENT EXECUTE FUNCTION email_jobs_notify_fn()"
    ),
    "not on insert": _replace_trigger(
        "AFTER UPDATE ON email_jobs REFERENCING NEW TABLE AS new_jobs "
        "FOR EACH STATEMENT EXECUTE FUNCTION email_jobs_notify_fn()"
    ),
    "another function": [
        _OTHER_FUNCTION,
        *_replace_trigger(
            "AFTER INSERT ON email_jobs REFERENCING NEW TABLE AS new_jobs "
            "FOR EACH STATEMENT EXECUTE FUNCTION other_notify_fn()"
        ),
    ],
    "another channel": [_OTHER_CHANNEL],
}


@pytest.mark.parametrize("wrong", sorted(WRONG_TRIGGERS))
def test_a_wrong_wakeup_trigger_is_reported(db_engine: sa.Engine, wrong: str) -> None:
    set_up_by_migrations(db_engine)
    with db_engine.begin() as connection:
        for sql in WRONG_TRIGGERS[wrong]:
            connection.execute(ddl.executable(sql))
        problems = migrations.check_job_tables(connection, models.EmailJob, models.ReportJob)
        assert len(problems) == 1
        assert problems[0].startswith("wake-up trigger email_jobs_notify_tg on email_jobs: ")
        # Following the message repairs it.
        context = MigrationContext.configure(connection)
        with Operations.context(context):
            migrations.drop_notify_trigger("email_jobs")
            migrations.create_notify_trigger("email_jobs")
        assert migrations.check_job_tables(connection, models.EmailJob, models.ReportJob) == []


def set_up_by_migrations(engine: sa.Engine) -> None:
    command.upgrade(example_config(url_of(engine)), "heads")


def set_up_by_create_all(engine: sa.Engine) -> None:
    models.Base.metadata.create_all(engine)


@pytest.mark.parametrize("set_up", [set_up_by_migrations, set_up_by_create_all])
def test_one_notification_per_queue_at_commit(
    db_engine: sa.Engine, set_up: Callable[[sa.Engine], None]
) -> None:
    set_up(db_engine)
    channel = names("email_jobs").channel
    with psycopg.connect(libpq_url(db_engine.url), autocommit=True) as conn:
        conn.execute(f'LISTEN "{channel}"')

        with Session(db_engine) as session, session.begin():
            session.add_all(
                [
                    models.EmailJob(task="send", queue="email"),
                    models.EmailJob(task="send", queue="email"),
                    models.EmailJob(task="send", queue="sms"),
                ]
            )
            session.flush()
            session.add(models.EmailJob(task="send", queue="email"))  # a second statement
            session.flush()
            before_commit = list(conn.notifies(timeout=0.5))
        after_commit = list(conn.notifies(timeout=10, stop_after=2))
        afterwards = list(conn.notifies(timeout=0.5))

    assert before_commit == []
    assert sorted((n.channel, n.payload) for n in after_commit) == [
        (channel, "email"),
        (channel, "sms"),
    ]
    assert afterwards == []


def test_no_notification_on_rollback(db_engine: sa.Engine) -> None:
    set_up_by_migrations(db_engine)
    with psycopg.connect(libpq_url(db_engine.url), autocommit=True) as conn:
        conn.execute(f'LISTEN "{names("email_jobs").channel}"')
        with Session(db_engine) as session:
            session.add(models.EmailJob(task="send"))
            session.flush()
            session.rollback()
        assert list(conn.notifies(timeout=0.5)) == []


def test_importing_the_library_does_not_import_alembic(tmp_path: Path) -> None:
    code = (
        "import sys, sqla_jobs, sqla_jobs.ddl, sqla_jobs.models; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


# -- schema version 2 ----------------------------------------------------------------------

V1 = ("0001_user_tables", "sqla_jobs_0001")
JOB_TABLES = ("email_jobs", "report_jobs", "sqla_jobs")


def upgrade_to_version_1(engine: sa.Engine) -> Config:
    config = example_config(url_of(engine))
    for revision in V1:
        command.upgrade(config, revision)
    return config


def add_jobs_in_every_state(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        for table in JOB_TABLES:
            connection.execute(
                sa.text(
                    f"INSERT INTO {table} (queue, task, status, attempts, lease_expires_at, "
                    "finished_at, run_at) "
                    "SELECT 'q' || (n % 3), 't', s.status, "
                    "CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END, "
                    "CASE WHEN s.status = 'running' THEN now() - interval '1 minute' END, "
                    "CASE WHEN s.status IN ('succeeded', 'dead', 'cancelled') THEN now() END, "
                    "now() - CASE WHEN s.status = 'running' THEN interval '1 hour' "
                    "ELSE interval '0' END "
                    "FROM generate_series(1, 200) AS n, (VALUES ('pending'), ('running'), "
                    "('succeeded'), ('dead'), ('cancelled')) AS s(status)"
                )
            )


def rows_by_status(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    with engine.connect() as connection:
        return {
            table: sorted(
                tuple(row)
                for row in connection.execute(
                    sa.text(f"SELECT status, count(*) FROM {table} GROUP BY status")
                )
            )
            for table in JOB_TABLES
        }


def test_the_0002_revisions_upgrade_version_1_tables_with_data_in_place(
    db_engine: sa.Engine,
) -> None:
    config = upgrade_to_version_1(db_engine)
    version_1 = catalog(db_engine)
    add_jobs_in_every_state(db_engine)
    before = rows_by_status(db_engine)
    with db_engine.connect() as connection:
        problems = migrations.check_job_tables(connection, *JOB_MODELS)
    # Each version-1 table: its six new indexes missing (two claim indexes of version 2; the
    # dead, unique, keyed pending and key indexes of version 3), its old one left over.
    # (archive_jobs comes with 0004, tenant_jobs with 0007, order_jobs with 0008: missing
    # altogether here.)
    later = ("archive_jobs", "tenant_jobs", "order_jobs")
    now = [p for p in problems if not any(name in p for name in later)]
    assert len(now) == 7 * (len(JOB_MODELS) - len(later))
    assert "add_unique_keys('email_jobs')" in "".join(problems)
    assert "upgrade_job_table_to_v2('email_jobs')" in "".join(problems)

    command.upgrade(config, "heads")

    assert rows_by_status(db_engine) == before
    for table in JOB_TABLES:
        n = names(table)
        assert set(index_definitions(db_engine, table)) == {
            n.pending_index,
            n.running_index,
            n.dead_index,
            n.unique_index,
            n.keyed_pending_index,
            n.key_index,
        }
    assert schema_differences(db_engine, all_metadata()) == []
    command.check(config)  # `alembic check`: autogenerate finds nothing to do
    with db_engine.connect() as connection:
        assert migrations.check_job_tables(connection, *JOB_MODELS) == []
    # The claim finds its jobs through the new indexes: the expired leases first (their
    # run_at is the oldest).
    with db_engine.begin() as connection:
        jobs = sqla_jobs.claim(
            connection, models.EmailJob, queues=["q0", "q1", "q2"], limit=250, lease=30
        )
    assert len(jobs) == 250
    assert sorted({job.attempt for job in jobs}) == [1, 2]
    assert sum(job.attempt == 2 for job in jobs) == 200  # the 200 expired leases

    # And back: the version-1 catalog exactly, with the data still there.
    command.downgrade(config, "0001_user_tables")
    command.downgrade(config, "sqla_jobs_0001")
    assert catalog(db_engine) == version_1
    assert sum(count for _, count in rows_by_status(db_engine)["sqla_jobs"]) == 1000
    command.upgrade(config, "heads")  # and up again
    assert schema_differences(db_engine, all_metadata()) == []


def test_the_upgrade_does_not_block_writers_of_the_live_table(db_engine: sa.Engine) -> None:
    upgrade_to_version_1(db_engine)
    config = example_config(url_of(db_engine))
    insert = sa.text("INSERT INTO email_jobs (task) VALUES ('live')")
    with db_engine.connect() as writer:
        writer.execute(insert)  # a transaction writing to the table stays open
        failure: list[BaseException] = []

        def upgrade() -> None:
            try:
                command.upgrade(config, "0002_claim_indexes")  # email_jobs first
            except BaseException as exc:  # pragma: no cover - reported below
                failure.append(exc)

        thread = threading.Thread(target=upgrade)
        thread.start()
        try:
            # CREATE INDEX CONCURRENTLY waits for that open transaction to end ...
            waiting = sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'CREATE INDEX "
                "CONCURRENTLY email_jobs_pending_idx%' AND wait_event_type = 'Lock'"
            )
            deadline = time.monotonic() + 30
            with db_engine.connect() as observer:
                while observer.execute(waiting).scalar_one() == 0:
                    observer.rollback()
                    assert time.monotonic() < deadline, "the upgrade never waited"
                    time.sleep(0.05)
            # ... while new writers go on: a plain CREATE INDEX would queue them behind it.
            with db_engine.begin() as other:
                other.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
                other.execute(insert)
        finally:
            writer.commit()
            thread.join(60)
    assert not thread.is_alive()
    assert failure == []
    command.upgrade(config, "heads")
    with db_engine.connect() as connection:
        assert migrations.check_job_tables(connection, *JOB_MODELS) == []
        assert connection.execute(sa.text("SELECT count(*) FROM email_jobs")).scalar() == 2


def test_the_upgrade_helper_can_run_again_after_an_interrupted_run(
    db_engine: sa.Engine,
) -> None:
    migrate(db_engine, lambda: migrations.create_job_table("email_jobs"))
    n = names("email_jobs")
    # What a failed CREATE INDEX CONCURRENTLY leaves: an invalid index of the same name.
    with db_engine.begin() as connection:
        connection.execute(sa.text(f"CREATE INDEX {n.pending_index} ON email_jobs (task)"))
        connection.execute(
            sa.text(
                "UPDATE pg_index SET indisvalid = false "
                f"WHERE indexrelid = '{n.pending_index}'::regclass"
            )
        )
    migrate(db_engine, lambda: migrations.upgrade_job_table_to_v2("email_jobs"))
    migrate(db_engine, lambda: migrations.upgrade_job_table_to_v2("email_jobs"))  # idempotent
    migrate(db_engine, lambda: migrations.upgrade_job_table_to_v3("email_jobs"))  # and to v3
    migrate(db_engine, lambda: migrations.upgrade_job_table_to_v3("email_jobs"))  # again
    with db_engine.connect() as connection:
        assert migrations.check_claim_indexes(connection, models.EmailJob) == []
    migrate(db_engine, lambda: migrations.downgrade_job_table_to_v2("email_jobs"))
    migrate(db_engine, lambda: migrations.downgrade_job_table_to_v1("email_jobs"))
    assert set(index_definitions(db_engine, "email_jobs")) == {n.claim_index}


def test_create_job_table_builds_version_3_on_request_and_version_1_by_default(
    db_engine: sa.Engine,
) -> None:
    migrate(db_engine, lambda: migrations.create_job_table("email_jobs", version=3))
    migrate(db_engine, lambda: migrations.create_job_table("report_jobs"))
    email, report = names("email_jobs"), names("report_jobs")
    assert set(index_definitions(db_engine, "email_jobs")) == {
        email.pending_index,
        email.running_index,
        email.dead_index,
        email.unique_index,
        email.keyed_pending_index,
        email.key_index,
    }
    assert set(index_definitions(db_engine, "report_jobs")) == {report.claim_index}
    with db_engine.connect() as connection:
        assert migrations.check_claim_indexes(connection, models.EmailJob) == []
        assert migrations.check_claim_indexes(connection, models.ReportJob) == [
            f"index {report.dead_index} on report_jobs: missing from the database",
            f"index {report.key_index} on report_jobs: missing from the database",
            f"index {report.keyed_pending_index} on report_jobs: missing from the database",
            f"index {report.pending_index} on report_jobs: missing from the database",
            f"index {report.running_index} on report_jobs: missing from the database",
            (
                f"index {report.unique_index} on report_jobs: missing from the database (a "
                "job table of schema version 2); upgrade it from a new revision with "
                "sqla_jobs.migrations.add_unique_keys('report_jobs')"
            ),
            (
                f"index {report.claim_index} on report_jobs: the claim index of schema "
                "version 1, which the model no longer has; upgrade the table from a new "
                "revision with sqla_jobs.migrations.upgrade_job_table_to_v2('report_jobs')"
            ),
        ]
    with pytest.raises(ValueError, match="schema version"):
        migrate(db_engine, lambda: migrations.create_job_table("other_jobs", version=5))
    assert migrations.SCHEMA_VERSION == 4


def test_the_dead_index_is_added_to_a_live_version_2_table_and_dropped(
    db_engine: sa.Engine,
) -> None:
    migrate(db_engine, lambda: migrations.create_job_table("email_jobs", version=2))
    n = names("email_jobs")
    with db_engine.begin() as connection:
        connection.execute(
            sa.text(
                "INSERT INTO email_jobs (task, status, finished_at) "
                "VALUES ('bad', 'dead', now()), ('ok', 'succeeded', now())"
            )
        )
        # What an interrupted CREATE INDEX CONCURRENTLY leaves: an invalid index of that name.
        connection.execute(sa.text(f"CREATE INDEX {n.dead_index} ON email_jobs (task)"))
        connection.execute(
            sa.text(
                "UPDATE pg_index SET indisvalid = false "
                f"WHERE indexrelid = '{n.dead_index}'::regclass"
            )
        )
    migrate(db_engine, lambda: migrations.add_dead_index("email_jobs"))
    migrate(db_engine, lambda: migrations.add_dead_index("email_jobs"))  # re-runnable
    migrate(db_engine, lambda: migrations.add_ordering_keys("email_jobs"))  # queue_stats reads it
    with db_engine.connect() as connection:
        problems = migrations.check_job_tables(connection, models.EmailJob)
        assert [p for p in problems if n.dead_index in p] == []
        with Session(bind=connection) as session:
            (dead,) = sqla_jobs.queue_stats(session, models.EmailJob)
        assert (dead.status, dead.count) == ("dead", 1)
    migrate(db_engine, lambda: migrations.drop_dead_index("email_jobs"))
    assert n.dead_index not in index_definitions(db_engine, "email_jobs")


# -- schema version 3 (unique jobs) ----------------------------------------------------------


def relfilenodes(engine: sa.Engine) -> dict[str, int]:
    """Each job table's storage file: a table rewrite would give it a new one."""
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text("SELECT relname, relfilenode FROM pg_class WHERE relname = ANY (:tables)"),
            {"tables": list(JOB_TABLES)},
        )
        return {str(row[0]): int(row[1]) for row in rows}


def test_the_0003_revisions_upgrade_version_2_tables_in_place_without_a_rewrite(
    db_engine: sa.Engine,
) -> None:
    config = example_config(url_of(db_engine))
    command.upgrade(config, "0002_claim_indexes")
    command.upgrade(config, "sqla_jobs_0002")
    version_2 = catalog(db_engine)
    add_jobs_in_every_state(db_engine)
    before, files = rows_by_status(db_engine), relfilenodes(db_engine)
    with db_engine.connect() as connection:
        problems = migrations.check_job_tables(connection, *JOB_MODELS)
    # Each table: the dead, unique, keyed pending and key indexes missing, and its pending
    # index of version 2 (without keyed jobs left out).
    # (archive_jobs comes with 0004, tenant_jobs with 0007, order_jobs with 0008: missing
    # altogether here.)
    later = ("archive_jobs", "tenant_jobs", "order_jobs")
    now = [p for p in problems if not any(name in p for name in later)]
    assert len(now) == 5 * (len(JOB_MODELS) - len(later))
    assert "add_unique_keys('email_jobs')" in "".join(problems)

    command.upgrade(config, "heads")

    assert relfilenodes(db_engine) == files  # the columns were added without a rewrite
    assert rows_by_status(db_engine) == before
    assert schema_differences(db_engine, all_metadata()) == []
    command.check(config)  # `alembic check`: autogenerate finds nothing to do
    with db_engine.connect() as connection:
        assert migrations.check_job_tables(connection, *JOB_MODELS) == []
    with Session(db_engine) as session, session.begin():
        first = sqla_jobs.enqueue_unique(session, models.EmailJob(task="t"), key="k")
        again = sqla_jobs.enqueue_unique(session, models.EmailJob(task="t"), key="k")
    assert first.inserted
    assert again.id == first.id

    # And back to version 2, with the old jobs still there.
    command.downgrade(config, "0002_claim_indexes")
    command.downgrade(config, "sqla_jobs_0002")
    assert catalog(db_engine) == version_2
    assert sum(count for _, count in rows_by_status(db_engine)["sqla_jobs"]) == 1000


def test_a_version_2_table_is_reported_and_upgraded_in_place_with_its_keyed_jobs_apart(
    db_engine: sa.Engine,
) -> None:
    migrate(db_engine, lambda: migrations.create_job_table("email_jobs", version=2))
    n = names("email_jobs")

    def key_problems() -> list[str]:
        with db_engine.connect() as connection:
            problems = migrations.check_claim_indexes(connection, models.EmailJob)
        keyed = (n.key_index, n.keyed_pending_index, "add_ordering_keys")
        return [p for p in problems if any(word in p for word in keyed)]

    problems = key_problems()
    assert problems[:2] == [
        f"index {n.key_index} on email_jobs: missing from the database",
        f"index {n.keyed_pending_index} on email_jobs: missing from the database",
    ]
    assert "add_ordering_keys" in problems[2]
    with db_engine.begin() as connection:
        connection.execute(sa.text("INSERT INTO email_jobs (task) VALUES ('old')"))
    migrate(db_engine, lambda: migrations.add_ordering_keys("email_jobs"))
    migrate(db_engine, lambda: migrations.add_ordering_keys("email_jobs"))  # re-runnable
    assert key_problems() == []
    assert set(index_definitions(db_engine, "email_jobs")) == {
        n.pending_index,
        n.running_index,
        n.keyed_pending_index,
        n.key_index,
    }
    migrate(db_engine, lambda: migrations.drop_ordering_keys("email_jobs"))
    assert set(index_definitions(db_engine, "email_jobs")) == {n.pending_index, n.running_index}
    with db_engine.connect() as connection:
        columns = {c["name"] for c in sa.inspect(connection).get_columns("email_jobs")}
        assert "ordering_key" not in columns
        assert "key_limit" not in columns
        assert connection.execute(sa.text("SELECT task FROM email_jobs")).scalars().all() == ["old"]


def test_the_0003_revisions_add_the_trace_context_column_in_place(db_engine: sa.Engine) -> None:
    config = example_config(url_of(db_engine))
    for revision in ("0002_claim_indexes", "sqla_jobs_0002"):
        command.upgrade(config, revision)
    add_jobs_in_every_state(db_engine)
    before = rows_by_status(db_engine)
    version_2 = catalog(db_engine)

    command.upgrade(config, "heads")

    assert rows_by_status(db_engine) == before
    assert schema_differences(db_engine, all_metadata()) == []
    command.check(config)
    columns = {(row[0], row[1]): row[2:] for row in catalog(db_engine)["columns"]}
    for table in JOB_TABLES:
        # jsonb, nullable, no default: added without rewriting the table.
        assert columns[(table, "trace_context")] == (
            "jsonb",
            None,
            "YES",
            None,
            "NO",
            None,
        )
    with db_engine.begin() as connection:
        (job,) = sqla_jobs.claim(connection, models.EmailJob, queues=["q0"], limit=1)
        # The jobs that were there before have no trace context.
        assert job.trace_context is None
        assert (
            connection.execute(
                sa.text("SELECT count(*) FROM email_jobs WHERE trace_context IS NOT NULL")
            ).scalar_one()
            == 0
        )

    command.downgrade(config, "0002_claim_indexes")
    command.downgrade(config, "sqla_jobs_0002")
    assert catalog(db_engine) == version_2


def test_drop_job_table_undoes_a_table_made_with_its_history(db_engine: sa.Engine) -> None:
    # A revision whose downgrade is the mirror of create_job_table(..., history=True)
    # (issue 29, finding 13): before, the history table was left, and the next upgrade
    # failed with DuplicateTable.
    def create() -> None:
        migrations.create_job_table("cycle_jobs", version=3, history=True)

    def tables() -> set[str]:
        with db_engine.connect() as connection:
            return set(sa.inspect(connection).get_table_names())

    migrate(db_engine, create)
    assert {"cycle_jobs", "cycle_jobs_history", "cycle_jobs_history_pdefault"} <= tables()
    migrate(db_engine, lambda: migrations.drop_job_table("cycle_jobs"))
    assert {name for name in tables() if name.startswith("cycle_jobs")} == set()
    migrate(db_engine, create)  # the cycle starts again
    # drop_history first, as the example's revision does, still works.
    migrate(db_engine, lambda: migrations.drop_history("cycle_jobs"))
    migrate(db_engine, lambda: migrations.drop_job_table("cycle_jobs"))
    assert {name for name in tables() if name.startswith("cycle_jobs")} == set()


# -- schema version 4 (job control) ------------------------------------------------------------


def test_version_4_is_added_in_place_to_live_version_3_tables_and_their_history(
    db_engine: sa.Engine,
) -> None:
    config = example_config(url_of(db_engine))
    command.upgrade(config, "heads")
    version_4 = catalog(db_engine)
    command.downgrade(config, "0004_history")
    command.downgrade(config, "sqla_jobs_0003")
    version_3 = catalog(db_engine)
    control = {"time_limit", "snoozes", "progress", "attempted_at"}
    assert not {column[1] for column in version_3["columns"]} & control
    with db_engine.begin() as connection:  # rows of version 3, in the table and the history
        connection.execute(sa.text("INSERT INTO email_jobs (task) VALUES ('old')"))
        connection.execute(
            sa.text(
                "INSERT INTO archive_jobs_history (id, queue, task, args, status, priority, "
                "run_at, attempts, max_attempts, created_at, finished_at) VALUES (1, 'default', "
                "'old', '{}', 'succeeded', 0, now(), 1, 3, now(), now())"
            )
        )

    command.upgrade(config, "heads")
    assert catalog(db_engine) == version_4  # as the heads built it: the same catalog
    migrate(db_engine, lambda: migrations.upgrade_job_table_to_v4("archive_jobs"))  # again
    assert catalog(db_engine) == version_4
    assert schema_differences(db_engine, all_metadata()) == []
    with db_engine.connect() as connection:
        for table in ("email_jobs", "archive_jobs_history"):
            old = connection.execute(
                sa.text(
                    f"SELECT time_limit, snoozes, progress, attempted_at FROM {table} "
                    "WHERE task = 'old'"
                )
            ).one()
            assert tuple(old) == (None, 0, None, None)
    migrate(db_engine, lambda: migrations.downgrade_job_table_to_v3("archive_jobs"))
    migrate(db_engine, lambda: migrations.downgrade_job_table_to_v3("archive_jobs"))  # again
    archive = {c[1] for c in catalog(db_engine)["columns"] if c[0].startswith("archive_jobs")}
    assert not archive & control


def test_create_job_table_builds_version_4_with_its_history(db_engine: sa.Engine) -> None:
    migrate(
        db_engine,
        lambda: migrations.create_job_table(
            "archive_jobs", sa.Column("tenant", sa.String(50)), version=4, history=True
        ),
    )
    with db_engine.connect() as connection:
        assert migrations.check_job_tables(connection, models.ArchiveJob) == []
    expected = sa.MetaData()
    for model in (models.ArchiveJob, models.ArchiveJobHistory):
        table: sa.Table = model.__table__  # type: ignore[assignment]
        table.to_metadata(expected)
    pause_table(models.ArchiveJob).to_metadata(expected)
    assert schema_differences(db_engine, expected) == []
    with pytest.raises(ValueError, match="schema version 3 or 4"):
        migrate(db_engine, lambda: migrations.add_history("other_jobs", version=5))


def test_a_history_added_at_version_3_beside_a_version_4_table_is_reported(
    db_engine: sa.Engine,
) -> None:
    tenant = sa.Column("tenant", sa.String(50))
    migrate(db_engine, lambda: migrations.create_job_table("archive_jobs", tenant, version=4))
    migrate(db_engine, lambda: migrations.add_history("archive_jobs", tenant))  # version 3
    with db_engine.connect() as connection:
        (problem,) = migrations.check_job_tables(connection, models.ArchiveJob)
    assert "lacks the column(s) time_limit, snoozes, progress, attempted_at" in problem
    assert "upgrade_job_table_to_v4('archive_jobs')" in problem
    migrate(db_engine, lambda: migrations.upgrade_job_table_to_v4("archive_jobs"))  # as it says
    with db_engine.connect() as connection:
        assert migrations.check_job_tables(connection, models.ArchiveJob) == []
