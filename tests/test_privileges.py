"""Each role's work with exactly the grants docs/privileges.md lists, and nothing more.

A fresh database, its ``PUBLIC`` privileges revoked (``CONNECT``, ``TEMP``, the schema's
``USAGE``, ``EXECUTE`` on the owner's functions), roles of this run's own, and the SQL
blocks of the page run as written (role and database names replaced). Then each role does
its job on engines that connect as it: the owner migrates, the application enqueues, a
real :class:`~sqla_jobs.Worker` drains (plain, unique, keyed, limited, lock-held and
periodic jobs, results, a partitioned history), the maintainer keeps the partitions, the
dashboard reads and the operator acts. Any privilege missing is an error, and fails here.

Also the worker without DDL rights on a partitioned history: one warning, then the mover
only; and ``history_partitions=False``.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations
from conftest import FreshDatabase
from dashboard_pages import csrf_of
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.pool import NullPool
from starlette.testclient import TestClient
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import (
    JobContext,
    JobMixin,
    JobResultMixin,
    Registry,
    Schedule,
    ScheduleMixin,
    Worker,
    cli,
    history,
    migrations,
)
from sqla_jobs.dashboard import create_app
from sqla_jobs.health import read_gauges
from sqla_jobs.schema.history import create_partition

PAGE = Path(__file__).resolve().parents[1] / "docs" / "operations" / "privileges.md"
ROLES = ("owner", "app", "worker", "maintainer", "dashboard", "operator")


class Base(DeclarativeBase):
    pass


class EmailJob(JobMixin, Base):
    __tablename__ = "email_jobs"


class EmailJobResult(JobResultMixin, Base):
    __tablename__ = "email_job_results"


class EmailJobSchedule(ScheduleMixin, Base):
    __tablename__ = "email_job_schedules"


class InvoiceJob(JobMixin, Base):
    __tablename__ = "invoice_jobs"
    partitioned_history = True


def page_sql(label: str) -> str:
    """The SQL block of docs/privileges.md marked ``<!-- privileges-test: label -->``."""
    text = PAGE.read_text()
    match = re.search(rf"<!-- privileges-test: {label} -->\n```sql\n(.*?)```", text, re.S)
    assert match is not None, f"docs/privileges.md has no SQL block {label!r}"
    return match.group(1)


@dataclass
class Deployment:
    """The database, its roles' engines (``engines[role]``) and a superuser's."""

    url: str
    roles: dict[str, str]
    engines: dict[str, sa.Engine]
    admin: sa.Engine

    def sql(self, label: str) -> str:
        """A block of the page with this run's role and database names."""
        text = re.sub(
            r"\bjobs_(" + "|".join(ROLES) + r")\b",
            lambda m: self.roles[m.group(1)],
            page_sql(label),
        )
        database = make_url(self.url).database
        return text.replace("DATABASE app", f'DATABASE "{database}"')


def _statements(sql: str) -> list[str]:
    lines = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    return [part.strip() for part in "\n".join(lines).split(";") if part.strip()]


@pytest.fixture(scope="module")
def deployment(fresh_database: FreshDatabase) -> Iterator[Deployment]:
    url = fresh_database("sqla_jobs_privileges")
    prefix = f"sqla_jobs_priv_{secrets.token_hex(3)}"
    roles = {name: f"{prefix}_{name}" for name in ROLES}
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    database = make_url(url).database
    with admin.connect() as connection:
        for role in roles.values():
            connection.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        # Nothing through PUBLIC: every privilege a role uses is one the page grants.
        connection.execute(sa.text(f'REVOKE ALL ON DATABASE "{database}" FROM PUBLIC'))
        connection.execute(sa.text("REVOKE ALL ON SCHEMA public FROM PUBLIC"))
        connection.execute(
            sa.text(
                f"ALTER DEFAULT PRIVILEGES FOR ROLE {roles['owner']} "
                "REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC"
            )
        )
    engines = {
        name: sa.create_engine(
            make_url(url).set(username=role, password=None), pool_size=10, max_overflow=10
        )
        for name, role in roles.items()
    }
    deployed = Deployment(url, roles, engines, admin)
    try:
        with admin.connect() as connection:
            for statement in _statements(deployed.sql("admin")):
                connection.execute(sa.text(statement))
        # The owner migrates, then grants (the page's second block).
        with (
            engines["owner"].begin() as connection,
            Operations.context(MigrationContext.configure(connection)),
        ):
            migrations.create_job_table("email_jobs", version=4)
            migrations.create_result_table("email_job_results")
            migrations.create_schedule_table("email_job_schedules")
            migrations.create_job_table("invoice_jobs", version=4, history=True)
        with engines["owner"].begin() as connection:
            assert migrations.check_job_tables(connection, EmailJob, InvoiceJob) == []
            for statement in _statements(deployed.sql("owner")):
                connection.execute(sa.text(statement))
        yield deployed
    finally:
        for engine in engines.values():
            engine.dispose()
        with admin.connect() as connection:
            listed = ", ".join(roles.values())
            connection.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE usename = ANY (:roles)"
                ),
                {"roles": list(roles.values())},
            )
            connection.execute(sa.text(f"DROP OWNED BY {listed} CASCADE"))
            for role in roles.values():
                connection.execute(sa.text(f"DROP ROLE {role}"))
        admin.dispose()


def rows(deployment: Deployment, sql: str, **params: Any) -> list[Any]:
    """Read as the superuser: what the roles did, not what they could see."""
    with deployment.admin.connect() as connection:
        return list(connection.execute(sa.text(sql), params))


def drop_day_partitions(deployment: Deployment) -> None:
    with deployment.admin.connect() as connection:
        for partition in history.list_partitions(deployment.admin, InvoiceJob):
            if partition.start is not None:
                connection.execute(sa.text(f'DROP TABLE "{partition.name}"'))


def finished_row(deployment: Deployment, status: str = "dead") -> int:
    """A finished job left in the invoice job table (from before the table had a history,
    or made dead by a claim): the mover's to move."""
    found = rows(
        deployment,
        "INSERT INTO invoice_jobs (task, queue, status, finished_at) "
        "VALUES ('invoice', 'invoices', :status, now()) RETURNING id",
        status=status,
    )
    return int(found[0][0])


def in_history(deployment: Deployment, job_id: int) -> bool:
    found = rows(deployment, "SELECT 1 FROM invoice_jobs_history WHERE id = :id", id=job_id)
    return bool(found)


def mover_runs(deployment: Deployment, times: int = 3) -> None:
    """Wait for the mover to move a new finished row, ``times`` times in a row: as many
    runs of the worker's history role, at least."""
    for _ in range(times):
        job_id = finished_row(deployment)
        wait_until(
            functools.partial(in_history, deployment, job_id),
            timeout=30,
            message=f"the mover moved job {job_id}",
        )


def actions(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


# -- the application and the worker ------------------------------------------------------------


def test_the_app_enqueues_and_the_worker_drains(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    registry = Registry(
        EmailJob,
        result_model=EmailJobResult,
        schedule_model=EmailJobSchedule,
        queue_limits={"limited": 1},
    )

    @registry.task(queue="mail")
    def send(ctx: JobContext) -> dict[str, Any]:
        return {"sent": ctx.args["n"]}

    @registry.task(queue="mail", mode="lock")
    def held(ctx: JobContext) -> None:
        pass

    @registry.task(queue="mail", key_limit=2)
    def keyed(ctx: JobContext) -> None:
        pass

    @registry.task(queue="limited")
    def limited(ctx: JobContext) -> None:
        pass

    @registry.task(queue="mail", schedule=Schedule(every=1))
    def tick(ctx: JobContext) -> None:
        pass

    app = deployment.engines["app"]
    with Session(app) as session, session.begin():
        session.add_all([registry["send"].job({"n": n}) for n in range(5)])
        session.add(registry["held"].job({}))
        session.add_all([registry["keyed"].job({}, ordering_key="k") for _ in range(3)])
        session.add_all([registry["limited"].job({}) for _ in range(3)])
    with Session(app) as session, session.begin():
        first = sqla_jobs.enqueue_unique(session, registry["send"].job({"n": 99}))
        again = sqla_jobs.enqueue_unique(session, registry["send"].job({"n": 99}))
        sqla_jobs.enqueue_many(
            session, EmailJob, [{"task": "send", "queue": "mail", "args": {"n": 7}}]
        )
    assert first.inserted
    assert (again.inserted, again.id) == (False, first.id)

    def statuses() -> dict[tuple[str, str], int]:
        found = rows(
            deployment, "SELECT task, status, count(*) FROM email_jobs GROUP BY task, status"
        )
        return {(task, status): count for task, status, count in found}

    worker = Worker(registry, deployment.engines["worker"], poll_interval=0.05, concurrency=4)
    with worker:
        wait_until(
            lambda: (
                statuses().get(("tick", "succeeded"), 0) >= 1
                and sum(
                    n for (task, s), n in statuses().items() if s == "succeeded" and task != "tick"
                )
                == 14
            ),
            timeout=60,
            message="every job succeeded, and a periodic slot ran",
        )
    assert {s for (_, s) in statuses()} == {"succeeded"}
    results = rows(deployment, "SELECT value FROM email_job_results WHERE task = 'send'")
    assert sorted(r.value["sent"] for r in results) == [0, 1, 2, 3, 4, 7, 99]
    assert rows(deployment, "SELECT name FROM email_job_schedules") == [("tick",)]
    assert actions(caplog, "database_error") == []
    assert actions(caplog, "thread_crashed") == []


def test_a_worker_without_ddl_rights_moves_its_history_and_says_so_once(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's role may not make partitions, and there are none but DEFAULT: it warns
    once, naming the table and the fix, then keeps moving finished jobs, and retries no
    DDL (nor logs a database error) however many runs follow."""
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    drop_day_partitions(deployment)
    registry = Registry(InvoiceJob)

    @registry.task(queue="invoices")
    def invoice(ctx: JobContext) -> None:
        pass

    with Session(deployment.engines["app"]) as session, session.begin():
        jobs = [registry["invoice"].job({"n": n}) for n in range(3)]
        session.add_all(jobs)
        session.flush()
        ids = [job.id for job in jobs]
    ids.append(finished_row(deployment, "succeeded"))
    worker = Worker(registry, deployment.engines["worker"], poll_interval=0.05, history_every=0.05)
    with worker:
        wait_until(
            lambda: all(in_history(deployment, job_id) for job_id in ids),
            timeout=60,
            message="the jobs and the finished row left behind are in the history",
        )
        mover_runs(deployment)  # and the mover runs on
    (warned,) = actions(caplog, "history_partitions_not_permitted")
    assert warned.levelno == logging.WARNING
    message = warned.getMessage()
    for named in (
        "invoice_jobs_history",
        deployment.roles["worker"],  # the role refused
        deployment.roles["owner"],  # whose privileges it lacks
        "sqla-jobs history",  # what to run instead,
        "history_partitions=False",  # and how to say so
    ):
        assert named in message
    assert actions(caplog, "database_error") == []
    assert rows(deployment, "SELECT count(*) FROM invoice_jobs")[0][0] == 0
    # Nothing but the DEFAULT partition: the worker made none.
    assert [p.start for p in history.list_partitions(deployment.admin, InvoiceJob)] == [None]


def test_history_partitions_false_leaves_the_partitions_to_their_owner(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """As the maintainer, which may make partitions, with ``history_partitions=False``: the
    worker moves finished jobs and makes no partition (nor warns)."""
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    drop_day_partitions(deployment)
    registry = Registry(InvoiceJob)
    registry.task(name="invoice", queue="invoices")(lambda ctx: None)
    worker = Worker(
        registry,
        deployment.engines["maintainer"],
        poll_interval=0.05,
        history_every=0.05,
        history_partitions=False,
    )
    with worker:
        mover_runs(deployment)
    assert [p.start for p in history.list_partitions(deployment.admin, InvoiceJob)] == [None]
    assert actions(caplog, "history_partitions_not_permitted") == []
    assert actions(caplog, "history_partitions_created") == []


def test_a_refused_partition_operation_is_said_once_too(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """The maintainer may keep the partitions, but one of them belongs to a role it is not
    (made by hand as the superuser): the retention's drop is refused. The same warning,
    once, then the mover only."""
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    drop_day_partitions(deployment)
    with deployment.admin.connect() as connection:
        connection.execute(sa.text(create_partition("invoice_jobs", date(2020, 1, 2))))
    registry = Registry(InvoiceJob)
    registry.task(name="invoice", queue="invoices")(lambda ctx: None)
    worker = Worker(
        registry,
        deployment.engines["maintainer"],
        poll_interval=0.05,
        history_every=0.05,
        history_retention=30,
    )

    with worker:
        mover_runs(deployment)
    (warned,) = actions(caplog, "history_partitions_not_permitted")
    assert "must be owner" in warned.getMessage()
    assert actions(caplog, "database_error") == []
    starts = [p.start for p in history.list_partitions(deployment.admin, InvoiceJob)]
    assert len(starts) == history.DEFAULT_DAYS_AHEAD + 3  # ahead, DEFAULT, and 2020-01-02


def test_history_partitions_false_refuses_a_retention() -> None:
    registry = Registry(InvoiceJob)
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(sqla_jobs.ConfigurationError, match="history_retention drops partitions"):
        Worker(registry, engine, history_partitions=False, history_retention=30)
    with pytest.raises(sqla_jobs.ConfigurationError, match="history_partitions must be"):
        Worker(registry, engine, history_partitions="no")  # type: ignore[arg-type]


def test_the_worker_command_passes_no_history_partitions(
    capsys: pytest.CaptureFixture[str], restore_root_logging: None
) -> None:
    # Refused with the retention before any SQL: the flag reached the Worker.
    status = cli.main(
        [
            "worker",
            "worker_tasks:registry",
            "--database-url",
            "postgresql://nobody@127.0.0.1:1/none",
            "--no-history-partitions",
            "--history-retention",
            "30d",
        ]
    )
    assert status == 1
    assert "history_retention drops partitions" in capsys.readouterr().err


def test_the_maintainer_keeps_the_partitions(deployment: Deployment) -> None:
    """Partitions ahead (and a day whose rows sit in DEFAULT, moved into it), and retention
    of an old partition the owner made: as a member of the owner role, nothing more."""
    drop_day_partitions(deployment)
    with Session(deployment.engines["app"]) as session, session.begin():
        session.add(InvoiceJob(task="invoice", queue="maintained"))
    with Session(deployment.engines["worker"]) as session, session.begin():
        (job,) = sqla_jobs.claim(session, InvoiceJob, queues="maintained")
    with Session(deployment.engines["worker"]) as session, session.begin():
        sqla_jobs.complete(session, job)  # into DEFAULT: no partition for today yet
    old = date(2020, 1, 1)
    with deployment.engines["owner"].begin() as connection:
        connection.execute(sa.text(create_partition("invoice_jobs", old)))
    report = history.maintain(deployment.engines["maintainer"], InvoiceJob, retention=30)
    assert len(report.created) == history.DEFAULT_DAYS_AHEAD + 1
    assert report.moved_from_default >= 1
    assert report.dropped == ["invoice_jobs_history_p20200101"]
    assert report.skipped == []
    found = rows(
        deployment,
        "SELECT tableoid::regclass::text FROM invoice_jobs_history WHERE id = :id",
        id=job.id,
    )
    assert found[0][0] != "invoice_jobs_history_pdefault"


# -- the dashboard -----------------------------------------------------------------------------


def seed_dashboard(deployment: Deployment) -> dict[str, int]:
    """A pending, a dead and a succeeded email job (with a result), a dead invoice job in
    the history and two pending ones; enqueued by the application, run by the worker."""
    worker = deployment.engines["worker"]
    with Session(deployment.engines["app"]) as session, session.begin():
        jobs = [EmailJob(task="t", queue="shown", max_attempts=1) for _ in range(3)]
        invoices = [InvoiceJob(task="t", queue=q, max_attempts=1) for q in ("shown", "x", "x")]
        session.add_all([*jobs, *invoices])
        session.flush()
        ids = {job.id for job in jobs}
        pending_invoices = [invoice.id for invoice in invoices[1:]]
    with Session(worker) as session, session.begin():
        claimed = sqla_jobs.claim(session, EmailJob, queues="shown", limit=2)
        (invoice,) = sqla_jobs.claim(session, InvoiceJob, queues="shown")
    with Session(worker) as session, session.begin():
        sqla_jobs.fail(session, claimed[0], "broken")
        sqla_jobs.complete(session, claimed[1], result={"ok": 1}, result_model=EmailJobResult)
        sqla_jobs.fail(session, invoice, "broken")
    pending = (ids - {c.id for c in claimed}).pop()
    return {
        "pending": pending,
        "dead": claimed[0].id,
        "succeeded": claimed[1].id,
        "dead_invoice": invoice.id,
        "pending_invoice": pending_invoices[0],
        "another_pending_invoice": pending_invoices[1],
    }


def test_the_read_only_dashboard_reads(deployment: Deployment) -> None:
    ids = seed_dashboard(deployment)
    engine = deployment.engines["dashboard"]
    email = create_app(engine, EmailJob, result_model=EmailJobResult, read_only=True)
    with TestClient(email) as client:
        for path in ("/", "/jobs", "/jobs?status=dead", f"/jobs/{ids['succeeded']}"):
            page = client.get(path)
            assert page.status_code == 200, (path, page.text)
        assert "&#34;ok&#34;: 1" in client.get(f"/jobs/{ids['succeeded']}").text  # its result
    with TestClient(create_app(engine, InvoiceJob, read_only=True)) as client:
        for path in ("/", "/jobs", f"/jobs/{ids['dead_invoice']}"):
            page = client.get(path)
            assert page.status_code == 200, (path, page.text)
    with Session(engine) as session:
        assert read_gauges(session, EmailJob).dead >= 1
        assert read_gauges(session, InvoiceJob).dead >= 1
        assert history.job_record(session, InvoiceJob, ids["dead_invoice"]) is not None


def test_the_operator_retries_cancels_and_deletes(deployment: Deployment) -> None:
    ids = seed_dashboard(deployment)
    engine = deployment.engines["operator"]

    def act(client: TestClient, job_id: int, action: str) -> None:
        csrf = csrf_of(client, f"/jobs/{job_id}")
        done = client.post(f"/jobs/{job_id}/{action}", data={"csrf": csrf})
        assert done.status_code == 200, (action, done.text)
        assert "database error" not in done.text

    email = create_app(engine, EmailJob, result_model=EmailJobResult)
    with TestClient(email) as client:
        act(client, ids["dead"], "retry")
        act(client, ids["pending"], "cancel")
        act(client, ids["succeeded"], "delete")
    with TestClient(create_app(engine, InvoiceJob)) as client:
        act(client, ids["dead_invoice"], "retry")  # out of the history, back into the table
        act(client, ids["pending_invoice"], "cancel")  # into the history
        act(client, ids["another_pending_invoice"], "delete")
    assert rows(deployment, "SELECT status FROM email_jobs WHERE id = :id", id=ids["dead"]) == [
        ("pending",)
    ]
    assert rows(deployment, "SELECT status FROM email_jobs WHERE id = :id", id=ids["pending"]) == [
        ("cancelled",)
    ]
    assert rows(deployment, "SELECT 1 FROM email_jobs WHERE id = :id", id=ids["succeeded"]) == []
    assert rows(
        deployment, "SELECT status FROM invoice_jobs WHERE id = :id", id=ids["dead_invoice"]
    ) == [("pending",)]
    assert rows(
        deployment,
        "SELECT status FROM invoice_jobs_history WHERE id = :id",
        id=ids["pending_invoice"],
    ) == [("cancelled",)]
    gone = ids["another_pending_invoice"]
    assert rows(deployment, "SELECT 1 FROM invoice_jobs WHERE id = :id", id=gone) == []
