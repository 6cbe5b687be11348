"""The partitioned history (issue 11, item 1): finished jobs leave the hot table.

Moves are atomic and fenced, partitions are made ahead, retention drops only old partitions
and two runs never collide, the full record stays readable by id, retry brings a job back.
"""

from __future__ import annotations

import threading
from datetime import date, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations
from history_jobs import enqueue, where
from ledger_models import LedgerJob, LedgerJobResult, LedgerWorkflow
from models import ArchiveJob, ArchiveJobHistory, EmailJob
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import NullPool
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import (
    ClaimedJob,
    ConfigurationError,
    InvalidJobError,
    JobContext,
    JobNotFoundError,
    JobResultMixin,
    JobStateError,
    JobStatus,
    LeaseLostError,
    Registry,
    Worker,
)
from sqla_jobs import migrations as jobs
from sqla_jobs._queries import history as history_sql
from sqla_jobs.ddl import executable
from sqla_jobs.history import (
    MaintenanceReport,
    create_partitions,
    drop_partitions,
    history_names,
    job_record,
    list_partitions,
    move_finished,
)
from sqla_jobs.schema.history import create_partition

NAMES = history_names("archive_jobs")

pytestmark = pytest.mark.usefixtures("history_default_partition_only")


def claim(engine: sa.Engine, **kwargs: Any) -> list[ClaimedJob]:
    with Session(engine) as session, session.begin():
        return sqla_jobs.claim(session, ArchiveJob, **kwargs)


def db_today(engine: sa.Engine) -> date:
    with engine.connect() as connection:
        today: date = connection.scalar(
            sa.text("SELECT (statement_timestamp() AT TIME ZONE 'UTC')::date")
        )
    return today


def test_complete_moves_the_job_and_its_result_into_the_history(queue_engine: sa.Engine) -> None:
    job_id = enqueue(queue_engine, args={"to": "a@example.com"}, tenant="acme")
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job, result={"sent": True})
    assert where(queue_engine, job_id) == (0, 1)
    with Session(queue_engine) as session:
        record = job_record(session, ArchiveJob, job_id)
        assert record is not None
        assert record.in_history
        assert (record.status, record.args, record.attempts) == (
            "succeeded",
            {"to": "a@example.com"},
            1,
        )
        assert (record.tenant, record.result) == ("acme", {"sent": True})
        assert record.finished_at is not None
        assert record.lease_expires_at is None
        # The user's own mapped class reads it by id too.
        row = session.scalars(
            sa.select(ArchiveJobHistory).where(ArchiveJobHistory.id == job_id)
        ).one()
        assert (row.status, row.result, row.tenant) == ("succeeded", {"sent": True}, "acme")


def test_complete_many_moves_a_batch_with_results_and_none(queue_engine: sa.Engine) -> None:
    ids = [enqueue(queue_engine) for _ in range(3)]
    jobs = claim(queue_engine, limit=3)
    with Session(queue_engine) as session, session.begin():
        lost = sqla_jobs.complete_many(session, jobs, results=[1, None, "three"])
    assert lost == []
    with Session(queue_engine) as session:
        results = {i: job_record(session, ArchiveJob, i).result for i in ids}  # type: ignore[union-attr]
    assert results == {jobs[0].id: 1, jobs[1].id: None, jobs[2].id: "three"}


def test_a_stale_attempt_neither_completes_nor_moves(queue_engine: sa.Engine) -> None:
    job_id = enqueue(queue_engine)
    (stale,) = claim(queue_engine, lease=0.001)
    with queue_engine.begin() as connection:  # its lease has run out for sure
        connection.execute(
            sa.text("UPDATE archive_jobs SET lease_expires_at = now() - interval '1 s'")
        )
    (current,) = claim(queue_engine)
    assert (current.id, current.attempt) == (job_id, 2)
    with Session(queue_engine) as session, session.begin(), pytest.raises(LeaseLostError):
        sqla_jobs.complete(session, stale, result="stale")
    assert where(queue_engine, job_id) == (1, 0)
    with Session(queue_engine) as session, session.begin(), pytest.raises(LeaseLostError):
        sqla_jobs.fail(session, stale, "stale", retry=False)
    assert where(queue_engine, job_id) == (1, 0)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, current, result="current")
    assert where(queue_engine, job_id) == (0, 1)
    with Session(queue_engine) as session:
        record = job_record(session, ArchiveJob, job_id)
        assert record is not None
        assert (record.attempts, record.result) == (2, "current")


def test_a_rolled_back_completion_leaves_the_job_where_it_was(queue_engine: sa.Engine) -> None:
    job_id = enqueue(queue_engine)
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job)
        assert where(queue_engine, job_id) == (1, 0)  # not committed: others see it hot
        session.rollback()
    assert where(queue_engine, job_id) == (1, 0)


def test_dead_jobs_move_and_retry_brings_them_back(queue_engine: sa.Engine) -> None:
    job_id = enqueue(queue_engine, max_attempts=1)
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        outcome = sqla_jobs.fail(session, job, RuntimeError("boom"))
    assert outcome.status is sqla_jobs.JobStatus.DEAD
    assert where(queue_engine, job_id) == (0, 1)
    with Session(queue_engine) as session:
        record = job_record(session, ArchiveJob, job_id)
        assert record is not None
        assert record.status == "dead"
        assert "boom" in record.last_error
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.retry(session, ArchiveJob, job_id)
    assert where(queue_engine, job_id) == (1, 0)
    with Session(queue_engine) as session:
        record = job_record(session, ArchiveJob, job_id)
        assert record is not None
        assert not record.in_history
        assert (record.status, record.attempts, record.max_attempts) == ("pending", 1, 2)
        assert record.finished_at is None
        assert "boom" in record.last_error
    (again,) = claim(queue_engine)
    assert (again.id, again.attempt) == (job_id, 2)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, again)
    assert where(queue_engine, job_id) == (0, 1)


def test_cancel_moves_and_retry_errors(queue_engine: sa.Engine) -> None:
    job_id = enqueue(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.cancel(session, ArchiveJob, job_id)
    assert where(queue_engine, job_id) == (0, 1)
    with Session(queue_engine) as session, session.begin():
        # idempotent: a job already cancelled (and moved) is cancelled
        assert sqla_jobs.cancel(session, ArchiveJob, job_id) is JobStatus.CANCELLED
        with pytest.raises(JobNotFoundError):
            sqla_jobs.retry(session, ArchiveJob, 10**12)
    done = enqueue(queue_engine)
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job)
    with Session(queue_engine) as session, session.begin(), pytest.raises(JobStateError):
        sqla_jobs.retry(session, ArchiveJob, done)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.retry(session, ArchiveJob, job_id)
    assert where(queue_engine, job_id) == (1, 0)


def test_the_mover_takes_finished_rows_left_in_the_hot_table(queue_engine: sa.Engine) -> None:
    # A claim makes a job dead whose last attempt lost its lease: no move there. Rows of a
    # table from before it had a history are the same case.
    job_id = enqueue(queue_engine, max_attempts=1)
    claim(queue_engine, lease=0.001)
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text("UPDATE archive_jobs SET lease_expires_at = now() - interval '1 s'")
        )
    assert claim(queue_engine) == []
    pending = enqueue(queue_engine)
    assert where(queue_engine, job_id) == (1, 0)
    assert move_finished(queue_engine, ArchiveJob, scan=1) == 1
    assert where(queue_engine, job_id) == (0, 1)
    assert where(queue_engine, pending) == (1, 0)
    assert move_finished(queue_engine, ArchiveJob) == 0


def test_partitions_are_made_ahead_once(queue_engine: sa.Engine) -> None:
    today = db_today(queue_engine)
    report = create_partitions(queue_engine, ArchiveJob, days_ahead=3)
    wanted = [NAMES.partition(today + timedelta(days=d)) for d in range(4)]
    assert set(wanted) <= {p.name for p in list_partitions(queue_engine, ArchiveJob)}
    assert report.skipped == []
    again = create_partitions(queue_engine, ArchiveJob, days_ahead=3)
    assert again.created == []
    assert again.skipped == []
    # A job finished now lands in today's partition, not in the default one.
    enqueue(queue_engine)
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job)
    with queue_engine.connect() as connection:
        where_ = connection.scalar(
            sa.text("SELECT tableoid::regclass::text FROM archive_jobs_history")
        )
    assert where_ == NAMES.partition(today)


def _old_partition(engine: sa.Engine, day: date, rows: int) -> str:
    with engine.begin() as connection:
        connection.execute(executable(create_partition("archive_jobs", day)))
        connection.execute(
            sa.text(
                "INSERT INTO archive_jobs_history (id, queue, task, args, status, priority, "
                "run_at, attempts, max_attempts, created_at, finished_at) "
                "SELECT 1000000 + g + :base, 'default', 't', '{}', 'succeeded', 0, now(), 1, "
                "1, now(), CAST(:day AS timestamptz) + interval '1 hour' "
                "FROM generate_series(1, :n) AS g"
            ),
            {"day": day.isoformat() + " 00:00:00+00", "n": rows, "base": day.toordinal() * 10},
        )
    return NAMES.partition(day)


def test_retention_drops_only_whole_old_partitions(queue_engine: sa.Engine) -> None:
    today = db_today(queue_engine)
    old = _old_partition(queue_engine, today - timedelta(days=10), 5)
    recent = _old_partition(queue_engine, today - timedelta(days=6), 5)
    create_partitions(queue_engine, ArchiveJob, days_ahead=1)
    report = drop_partitions(queue_engine, ArchiveJob, older_than=timedelta(days=7))
    assert report.dropped == [old]
    assert report.skipped == []
    names = {p.name for p in list_partitions(queue_engine, ArchiveJob)}
    assert old not in names
    assert recent in names
    assert NAMES.partition(today) in names
    with queue_engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM archive_jobs_history")) == 5


def test_retention_deletes_old_rows_of_the_default_partition(queue_engine: sa.Engine) -> None:
    # No partition for that day: the row went to the default partition.
    today = db_today(queue_engine)
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text(
                "INSERT INTO archive_jobs_history (id, queue, task, args, status, priority, "
                "run_at, attempts, max_attempts, created_at, finished_at) VALUES "
                "(1, 'default', 't', '{}', 'dead', 0, now(), 1, 1, now(), "
                "now() - interval '30 days'),"
                "(2, 'default', 't', '{}', 'dead', 0, now(), 1, 1, now(), now() - interval '1 day')"
            )
        )
    report = drop_partitions(queue_engine, ArchiveJob, older_than=timedelta(days=7), batch_size=1)
    assert report.default_rows_deleted == 1
    with Session(queue_engine) as session:
        assert job_record(session, ArchiveJob, 1) is None
        assert job_record(session, ArchiveJob, 2) is not None
    # And a partition whose day already has rows in the default one is left alone.
    del today


def test_a_second_run_skips_while_another_holds_the_lock(queue_engine: sa.Engine) -> None:
    today = db_today(queue_engine)
    old = _old_partition(queue_engine, today - timedelta(days=10), 1)
    with queue_engine.connect() as other, other.begin():
        held = other.execute(history_sql.try_lock(), {"lock_key": NAMES.lock_key}).scalar()
        assert held is True
        report = drop_partitions(queue_engine, ArchiveJob, older_than=timedelta(days=7))
        assert report.dropped == []
        assert report.skipped == [f"drop {old}"]
    report = drop_partitions(queue_engine, ArchiveJob, older_than=timedelta(days=7))
    assert report.dropped == [old]


def test_partition_ddl_gives_up_after_lock_timeout(queue_engine: sa.Engine) -> None:
    today = db_today(queue_engine)
    old = _old_partition(queue_engine, today - timedelta(days=10), 1)
    # An open completion holds ROW EXCLUSIVE on the history, which a DROP must wait for.
    enqueue(queue_engine)
    (job,) = claim(queue_engine)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete(session, job)
        report = drop_partitions(
            queue_engine, ArchiveJob, older_than=timedelta(days=7), lock_timeout=0.05
        )
        assert report.dropped == []
        assert report.skipped == [f"drop {old}"]
    assert drop_partitions(queue_engine, ArchiveJob, older_than=timedelta(days=7)).dropped == [old]


def test_concurrent_retention_runs_never_collide(queue_engine: sa.Engine) -> None:
    today = db_today(queue_engine)
    olds = {_old_partition(queue_engine, today - timedelta(days=d), 2) for d in range(10, 16)}
    reports: list[Any] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def run() -> None:
        start.wait()
        try:
            reports.extend(
                drop_partitions(queue_engine, ArchiveJob, older_than=timedelta(days=7))
                for _ in range(20)
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    dropped = [name for report in reports for name in report.dropped]
    # IF EXISTS makes a late second drop a no-op, so count the partitions gone instead.
    assert olds <= set(dropped)
    assert not olds & {p.name for p in list_partitions(queue_engine, ArchiveJob)}


def test_bad_input_is_refused_before_any_sql(queue_engine: sa.Engine) -> None:
    with pytest.raises(InvalidJobError, match="days_ahead"):
        create_partitions(queue_engine, ArchiveJob, days_ahead=-1)
    with pytest.raises(InvalidJobError, match="lock_timeout"):
        drop_partitions(queue_engine, ArchiveJob, older_than=60, lock_timeout=0)
    with pytest.raises(InvalidJobError, match="older_than"):
        drop_partitions(queue_engine, ArchiveJob, older_than=-5)
    with pytest.raises(ConfigurationError, match="partitioned_history"):
        create_partitions(queue_engine, EmailJob)
    with Session(queue_engine) as session:
        with pytest.raises(InvalidJobError, match="job_id"):
            job_record(session, ArchiveJob, "1")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="partitioned history"):
            sqla_jobs.prune(session, ArchiveJob, older_than=60)


def test_a_model_with_history_and_delete_on_success_is_refused() -> None:
    class Base(DeclarativeBase):
        pass

    with pytest.raises(ConfigurationError, match="delete_on_success"):

        class Both(sqla_jobs.JobMixin, Base):
            __tablename__ = "both_jobs"
            partitioned_history = True
            delete_on_success = True


def test_rows_of_a_day_without_its_partition_move_into_it_when_it_is_made(
    queue_engine: sa.Engine,
) -> None:
    today = db_today(queue_engine)
    ids = [enqueue(queue_engine) for _ in range(3)]
    jobs = claim(queue_engine, limit=3)
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.complete_many(session, jobs, results=["a", "b", "c"])
    with queue_engine.connect() as connection:
        where_ = connection.scalars(
            sa.text("SELECT tableoid::regclass::text FROM archive_jobs_history")
        )
        assert set(where_) == {NAMES.default_partition}
    report = create_partitions(queue_engine, ArchiveJob, days_ahead=0)
    assert report.created == [NAMES.partition(today)]
    assert report.moved_from_default == 3
    with queue_engine.connect() as connection:
        where_ = connection.scalars(
            sa.text("SELECT tableoid::regclass::text FROM archive_jobs_history")
        )
        assert set(where_) == {NAMES.partition(today)}
    with Session(queue_engine) as session:
        assert [job_record(session, ArchiveJob, i).result for i in ids] == ["a", "b", "c"]  # type: ignore[union-attr]


def test_a_live_table_gets_its_history_without_a_lock_and_moves_in_batches(
    fresh_database: Any,
) -> None:

    class Base(DeclarativeBase):
        pass

    class LiveJob(sqla_jobs.JobMixin, Base):
        __tablename__ = "live_jobs"
        partitioned_history = True
        tenant: Mapped[str | None] = mapped_column(sa.String(50))

    class LiveResult(JobResultMixin, Base):
        __tablename__ = "live_job_results"

    engine = sa.create_engine(fresh_database("sqla_jobs_history"), poolclass=NullPool)

    def migrate(step: Any) -> None:
        with engine.connect() as connection:
            connection.execute(sa.text("SET lock_timeout = '1s'"))
            context = MigrationContext.configure(connection)
            with Operations.context(context), context.begin_transaction():
                step()
            connection.commit()

    tenant = sa.Column("tenant", sa.String(50), nullable=True)
    try:
        migrate(lambda: jobs.create_job_table("live_jobs", tenant, version=4))
        migrate(lambda: jobs.create_result_table("live_job_results"))
        with engine.connect() as connection:
            missing = (
                "history table live_jobs_history of live_jobs: missing from the database; "
                "create it from a revision with "
                "sqla_jobs.migrations.add_history('live_jobs', version=4) "
                "(with your own columns)"
            )
            assert jobs.check_job_tables(connection, LiveJob) == [missing]
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    "INSERT INTO live_jobs (task, status, tenant, attempts, finished_at) "
                    "SELECT 't', s, 'acme', 1, CASE WHEN s = 'pending' THEN NULL ELSE now() END "
                    "FROM unnest(ARRAY['succeeded', 'pending', 'dead', 'cancelled', 'pending']) "
                    "WITH ORDINALITY AS u(s, n) ORDER BY n"
                )
            )
            connection.execute(
                sa.text("INSERT INTO live_job_results (job_id, task, value) VALUES (1, 't', '42')")
            )
        # A live claim holds row locks and ROW EXCLUSIVE on the job table meanwhile: the
        # upgrade takes no lock of the job table, so it does not wait (lock_timeout 1 s).
        with engine.connect() as live, live.begin():
            live.execute(sa.text("SELECT id FROM live_jobs WHERE id = 2 FOR UPDATE"))
            live.execute(sa.text("UPDATE live_jobs SET priority = 1 WHERE id = 5"))
            migrate(lambda: jobs.add_history("live_jobs", tenant, version=4))
        assert move_finished(engine, LiveJob, result_model=LiveResult, scan=2) == 3
        with Session(engine) as session:
            statuses = session.scalars(sa.select(LiveJob.status).order_by(LiveJob.id)).all()
            assert statuses == ["pending", "pending"]
            first = job_record(session, LiveJob, 1)
            assert first is not None
            assert first.in_history
            assert (first.status, first.result, first.tenant) == ("succeeded", 42, "acme")
            assert session.get(LiveResult, 1) is None  # moved with its job, not orphaned
            assert [job_record(session, LiveJob, i).status for i in (3, 4)] == ["dead", "cancelled"]  # type: ignore[union-attr]
        # The upgraded table works as a history table.
        with Session(engine) as session, session.begin():
            jobs_ = sqla_jobs.claim(session, LiveJob, limit=2)
        with Session(engine) as session, session.begin():
            sqla_jobs.complete_many(session, jobs_)
        create_partitions(engine, LiveJob, days_ahead=1)
        with Session(engine) as session:
            assert session.scalars(sa.select(LiveJob.id)).all() == []
            assert {job_record(session, LiveJob, i).status for i in (2, 5)} == {"succeeded"}  # type: ignore[union-attr]
        with engine.connect() as connection:
            assert jobs.check_job_tables(connection, LiveJob) == []
        migrate(lambda: jobs.drop_history("live_jobs"))
        with engine.connect() as connection:
            assert not sa.inspect(connection).has_table("live_jobs_history")
    finally:
        engine.dispose()


def test_the_worker_keeps_the_history(queue_engine: sa.Engine) -> None:
    today = db_today(queue_engine)
    old = _old_partition(queue_engine, today - timedelta(days=40), 3)
    registry = Registry(ArchiveJob)

    @registry.task(queue="archive")
    def double(ctx: JobContext) -> int:
        return 2 * int(ctx.args["n"])

    @registry.task(queue="archive", mode="lock")
    def locked(ctx: JobContext) -> str:
        return "locked"

    @registry.task(queue="archive")
    def explode(ctx: JobContext) -> None:
        raise RuntimeError("no")

    # A finished job from before the table had a history: the role moves it.
    left = enqueue(queue_engine, task="double", queue="archive", args={"n": 0})
    with queue_engine.begin() as connection:
        connection.execute(
            sa.text("UPDATE archive_jobs SET status = 'succeeded', finished_at = now()")
        )
    worker = Worker(
        registry,
        queue_engine,
        poll_interval=0.1,
        history_retention=timedelta(days=30),
        history_every=0.2,
    )
    with worker:
        ids = [
            enqueue(queue_engine, task="double", queue="archive", args={"n": n}) for n in range(5)
        ]
        boom = enqueue(queue_engine, task="explode", queue="archive", max_attempts=1)
        held = enqueue(queue_engine, task="locked", queue="archive")

        def settled() -> bool:
            with queue_engine.connect() as connection:
                hot = connection.scalar(sa.text("SELECT count(*) FROM archive_jobs"))
            return (
                hot == 0 and worker.history_keeper is not None and worker.history_keeper.runs >= 2
            )

        wait_until(settled, timeout=30, message="every job is in the history")
    with Session(queue_engine) as session:
        assert [job_record(session, ArchiveJob, i).result for i in ids] == [0, 2, 4, 6, 8]  # type: ignore[union-attr]
        dead = job_record(session, ArchiveJob, boom)
        assert dead is not None
        assert dead.status == "dead"
        assert "no" in dead.last_error
        assert job_record(session, ArchiveJob, left).in_history  # type: ignore[union-attr]
        assert job_record(session, ArchiveJob, held).result == "locked"  # type: ignore[union-attr]
    names = {p.name for p in list_partitions(queue_engine, ArchiveJob)}
    assert {NAMES.partition(today + timedelta(days=d)) for d in range(8)} <= names
    assert old not in names


def test_worker_history_options_are_checked(queue_engine: sa.Engine) -> None:
    with pytest.raises(ConfigurationError, match="history_retention"):
        Worker(Registry(ArchiveJob), queue_engine, history_retention=-1)
    with pytest.raises(ConfigurationError, match="history_every"):
        Worker(Registry(ArchiveJob), queue_engine, history_every=0)


def cli(capsys: pytest.CaptureFixture[str], engine: sa.Engine, *args: str) -> tuple[int, str, str]:
    from sqla_jobs import cli as command

    url = engine.url.render_as_string(hide_password=False)
    status = command.main([*args, "--database-url", url, "--model", "models:ArchiveJob"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.usefixtures("restore_root_logging")
def test_the_commands_make_list_and_prune_partitions(
    capsys: pytest.CaptureFixture[str], queue_engine: sa.Engine
) -> None:
    today = db_today(queue_engine)
    old = _old_partition(queue_engine, today - timedelta(days=40), 2)
    status, out, _ = cli(capsys, queue_engine, "history", "--days-ahead", "2")
    assert status == 0
    made = [NAMES.partition(today + timedelta(days=d)) for d in range(3)]
    assert out == f"created 3 partitions: {', '.join(made)}\n"
    status, out, _ = cli(capsys, queue_engine, "history", "--list")
    start = f"{today:%Y-%m-%d} 00:00 .. {today + timedelta(days=1):%Y-%m-%d} 00:00 UTC"
    assert status == 0
    assert f"{NAMES.partition(today)}  {start}\n" in out
    assert f"{NAMES.default_partition}  DEFAULT" in out
    assert old in out
    status, out, _ = cli(capsys, queue_engine, "prune", "--older-than", "30d")
    assert status == 0
    assert out == (
        f"dropped 1 partitions: {old}\n"
        "pruned the history of ArchiveJob: 1 partitions older than 30.0d dropped\n"
    )
    status, out, _ = cli(capsys, queue_engine, "history", "--days-ahead", "2", "--retention", "30d")
    assert (status, out) == (0, "the history is up to date\n")
    status, _, err = cli(capsys, queue_engine, "history", "--days-ahead", "-1")
    assert status == 1
    assert "days_ahead" in err
    assert len(err.splitlines()) == 1


# -- partitions made under load (issue 29, finding 5) ---------------------------------------


def test_partitions_are_made_under_a_load_of_completions_and_none_is_refused(
    queue_engine: sa.Engine,
) -> None:
    today = db_today(queue_engine)
    # Today's jobs finished before its partition existed: in DEFAULT (the crowded path).
    early = [enqueue(queue_engine) for _ in range(30)]
    for job in claim(queue_engine, limit=30):
        with Session(queue_engine) as session, session.begin():
            sqla_jobs.complete(session, job)
    with Session(queue_engine) as session, session.begin():
        session.add_all([ArchiveJob(task="t") for _ in range(600)])
    errors: list[BaseException] = []
    completed: list[int] = []
    lock = threading.Lock()

    def complete_all() -> None:
        try:
            while jobs := claim(queue_engine, limit=3):
                for job in jobs:
                    with Session(queue_engine) as session, session.begin():
                        sqla_jobs.complete(session, job)
                    with lock:
                        completed.append(job.id)
        except BaseException as exc:  # any refused completion fails the test
            errors.append(exc)

    threads = [threading.Thread(target=complete_all) for _ in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(completed) >= 60, timeout=30, message="completions are landing")
    reports: list[MaintenanceReport] = []
    # Completions keep landing in DEFAULT meanwhile; a run may skip today (its locks not
    # had in time): the next one makes it. The days ahead are made by the first run.
    while len(completed) < 600 and not any(NAMES.partition(today) in r.created for r in reports):
        reports.append(create_partitions(queue_engine, ArchiveJob, days_ahead=2, lock_timeout=1))
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert {NAMES.partition(today + timedelta(days=d)) for d in (1, 2)} <= set(reports[0].created)
    if not any(NAMES.partition(today) in r.created for r in reports):  # the load ended first
        reports.append(create_partitions(queue_engine, ArchiveJob, days_ahead=2))
    assert NAMES.partition(today) in {p for r in reports for p in r.created}
    with queue_engine.connect() as connection:
        rows = connection.execute(
            sa.text(
                "SELECT id, attempts, tableoid::regclass::text AS part FROM archive_jobs_history"
            )
        ).all()
        hot = connection.scalar(sa.text("SELECT count(*) FROM archive_jobs"))
    # Every job finished once, in the history, in today's partition: none ran twice, none
    # was refused, nothing of today is left in DEFAULT.
    assert hot == 0
    assert sorted(row.id for row in rows) == sorted(early + completed)
    assert len(rows) == 630
    assert {row.attempts for row in rows} == {1}
    assert {row.part for row in rows} == {NAMES.partition(today)}


def test_each_history_query_matches_its_statement() -> None:
    # Every Query of the history (the hot path's COMPLETE and MOVE_FINISHED included, which
    # queue/outcomes.py and queue/admin.py run) checks its record and row against its
    # statement when first built, in each variant the library builds.
    import inspect

    from sqla_jobs._queries.run import Query, QueryDefinitionError

    table: sa.Table = ArchiveJob.__table__  # type: ignore[assignment]
    sqla_jobs.history.history_table(ArchiveJob)  # the table the moves insert into
    # A model with workflow steps and a history: its own statements.
    steps: sa.Table = LedgerJob.__table__  # type: ignore[assignment]
    flows: sa.Table = LedgerWorkflow.__table__  # type: ignore[assignment]
    results: sa.Table = LedgerJobResult.__table__  # type: ignore[assignment]
    variants: dict[Any, list[tuple[sa.Table | None, dict[str, Any]]]] = {
        history_sql.COMPLETE: [(table, {}), (table, {"held": True})],
        history_sql.SWEEP: [
            (table, {"result_table": None}),
            (steps, {"result_table": results, "workflow": flows}),
        ],
        history_sql.MOVE_OUT_OF_DEFAULT: [
            (table, {"day_partition": NAMES.partition(date(2026, 1, 1))})
        ],
        history_sql.STEP_WORKFLOW: [(steps, {})],
        history_sql.LOCK_WORKFLOW: [(flows, {})],
        history_sql.BRING_BACK: [(steps, {}), (steps, {"result_table": results})],
        history_sql.PRUNE_ENDED_WORKFLOWS: [(steps, {"workflow": flows})],
    }
    queries = [value for value in vars(history_sql).values() if isinstance(value, Query)]
    default_table = {
        True: table,  # a builder of the job table
        False: None,  # of no table (the catalog's, the server's)
    }
    built = [
        query.statement(on, **options)
        for query in queries
        for on, options in variants.get(
            query,
            [(default_table["table" in inspect.signature(query.builder).parameters], {})],
        )
    ]
    assert len(queries) == 19
    assert len(built) == 22
    # A record that misses a bind fails the same check.
    with pytest.raises(QueryDefinitionError, match=r"takes \['job_id'\]"):
        Query(history_sql.status_of, history_sql.SweepParams).statement(table)
