"""Lock-held mode's group commit (sqla_jobs/worker/locked.py), with a real worker: the
attempts of a group share one transaction and one commit, yet each handler's writes commit
with its own job's completion or not at all."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from in_process import enqueue
from models import EmailJob, EmailJobResult, Order
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import JobContext, Registry, RetryPolicy, Worker
from sqla_jobs.worker import locked, runner

FAST_RETRY = RetryPolicy(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=100))
#: How long a handler waits for what the test does meanwhile (a failing test, not a hang).
PATIENCE = 20.0


@pytest.fixture
def engine(queue_engine: sa.Engine) -> Iterator[sa.Engine]:
    """The emptied models' database, with a pool that holds a worker's connections."""
    engine = sa.create_engine(queue_engine.url, pool_size=20, max_overflow=10)
    yield engine
    engine.dispose()


@pytest.fixture
def one_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs claimed together run as one group: no idle thread is woken to take queued jobs
    (the runner's spill), and the group stays young as long as the test lasts."""
    monkeypatch.setattr(runner, "SPILL", 60.0)
    monkeypatch.setattr(locked, "WINDOW", 60.0)
    monkeypatch.setattr(locked, "AGE", 60.0)


@contextmanager
def running(registry: Registry, engine: sa.Engine, **options: Any) -> Iterator[Worker]:
    # Every job is enqueued before the worker starts: its first claim takes them all.
    worker = Worker(registry, engine, concurrency=8, poll_interval=0.1, grace=5, **options)
    with worker:
        yield worker


def statuses(engine: sa.Engine, ids: list[int]) -> list[str]:
    query = sa.select(EmailJob.id, EmailJob.status).where(EmailJob.id.in_(ids))
    with engine.connect() as connection:
        rows = {row[0]: row[1] for row in connection.execute(query)}
    return [rows[i] for i in ids]


def attempts(engine: sa.Engine, job_id: int) -> int:
    with engine.connect() as connection:
        return int(
            connection.execute(
                sa.select(EmailJob.attempts).where(EmailJob.id == job_id)
            ).scalar_one()
        )


def max_attempts(engine: sa.Engine, job_id: int) -> int:
    with engine.connect() as connection:
        query = sa.select(EmailJob.max_attempts).where(EmailJob.id == job_id)
        return int(connection.execute(query).scalar_one())


def orders(engine: sa.Engine) -> dict[int, str]:
    """Each order by id: the customer column holds the writing transaction's id."""
    with engine.connect() as connection:
        query = sa.select(Order.id, Order.customer)
        return {row[0]: row[1] for row in connection.execute(query)}


def results(engine: sa.Engine) -> dict[int, Any]:
    with Session(engine) as session:
        return {r.job_id: r.value for r in session.scalars(sa.select(EmailJobResult))}


def wait_for_statuses(engine: sa.Engine, ids: list[int], expected: list[str]) -> None:
    wait_until(
        lambda: statuses(engine, ids) == expected,
        timeout=PATIENCE,
        message=f"jobs {ids} are {expected} (now {statuses(engine, ids)})",
    )


def write_order(ctx: JobContext) -> str:
    """Write the job's order through the group's session, named after the transaction."""
    session = ctx.session
    xid = str(session.execute(sa.text("SELECT pg_current_xact_id()")).scalar_one())
    session.add(Order(id=ctx.args["order"], customer=xid))
    session.flush()
    return xid


def wait_for(flag: Any) -> bool:
    deadline = time.monotonic() + PATIENCE
    while not flag():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- what PostgreSQL does for us ------------------------------------------------------------


def test_a_row_lock_taken_in_a_savepoint_goes_with_its_rollback(engine: sa.Engine) -> None:
    (job_id,) = enqueue(engine, EmailJob(task="t"))
    probe = sa.text("SELECT id FROM email_jobs WHERE id = :id FOR UPDATE NOWAIT")
    with engine.connect() as holder, engine.connect() as other:
        holder.execute(sa.text("SAVEPOINT member"))
        holder.execute(
            sa.text("SELECT id FROM email_jobs WHERE id = :id FOR KEY SHARE"), {"id": job_id}
        )
        with pytest.raises(sa.exc.OperationalError, match="could not obtain lock"):
            other.execute(probe, {"id": job_id})
        other.rollback()
        holder.execute(sa.text("ROLLBACK TO SAVEPOINT member"))
        assert other.execute(probe, {"id": job_id}).scalar_one() == job_id  # released
        other.rollback()
        holder.rollback()


# -- one group, one commit ------------------------------------------------------------------


def test_a_group_commits_once_and_a_failure_rolls_back_only_its_own_writes(
    engine: sa.Engine, one_group: None
) -> None:
    registry = Registry(EmailJob, result_model=EmailJobResult)
    ran: list[tuple[int, int]] = []

    @registry.task(queue="group", mode="lock", max_attempts=2, retry=FAST_RETRY)
    def write(ctx: JobContext) -> str:
        ran.append((ctx.id, ctx.attempt))
        xid = write_order(ctx)
        if ctx.args.get("fail") and ctx.attempt == 1:
            raise RuntimeError("refused after writing")
        return xid

    @registry.task(queue="group", mode="lock")
    def untouched(ctx: JobContext) -> dict[str, int]:
        ran.append((ctx.id, ctx.attempt))
        return {"job": ctx.id}  # never asks for the session: no savepoint

    ids = enqueue(
        engine,
        write.job({"order": 1}),
        untouched.job(),
        write.job({"order": 2, "fail": True}),
        write.job({"order": 3}),
        untouched.job(),
    )
    with running(registry, engine):
        wait_for_statuses(engine, ids, ["succeeded"] * 5)
    written = orders(engine)
    first_group = {written[1], written[3]}
    assert len(first_group) == 1  # one transaction for the group
    assert written[2] not in first_group  # the failed attempt's write rolled back; the retry's
    assert attempts(engine, ids[2]) == 2
    assert [attempts(engine, i) for i in (ids[0], ids[1], ids[3], ids[4])] == [1, 1, 1, 1]
    assert ran.count((ids[2], 1)) == 1
    assert ran.count((ids[2], 2)) == 1
    stored = results(engine)
    assert stored[ids[0]] == written[1]
    assert stored[ids[3]] == written[3]
    assert stored[ids[1]] == {"job": ids[1]}
    assert stored[ids[4]] == {"job": ids[4]}


def test_a_cancel_mid_group_rolls_back_only_that_jobs_writes(
    engine: sa.Engine, one_group: None
) -> None:
    registry = Registry(EmailJob)
    waiting = threading.Event()

    @registry.task(queue="group", mode="lock", lease=60)
    def write(ctx: JobContext) -> None:
        write_order(ctx)
        if ctx.args.get("wait"):
            waiting.set()
            # It ignores the request and returns: its writes roll back all the same.
            assert wait_for(lambda: ctx.cancelled)

    @registry.task(queue="group", mode="lock", lease=60)
    def untouched(ctx: JobContext) -> None:
        if ctx.args.get("wait"):
            waiting.set()
            assert wait_for(lambda: ctx.cancelled)

    ids = enqueue(
        engine,
        write.job({"order": 1}),
        write.job({"order": 2, "wait": True}),
        untouched.job({"wait": True}),
        write.job({"order": 3}),
    )
    with running(registry, engine):
        for job_id in (ids[1], ids[2]):
            assert waiting.wait(PATIENCE)
            waiting.clear()
            with Session(engine) as session, session.begin():
                sqla_jobs.cancel(session, EmailJob, job_id)
        wait_for_statuses(engine, ids, ["succeeded", "cancelled", "cancelled", "succeeded"])
    written = orders(engine)
    assert sorted(written) == [1, 3]
    assert written[1] == written[3]  # the others still committed together


def test_an_attempt_taken_over_mid_group_is_lost_and_its_writes_roll_back(
    engine: sa.Engine, one_group: None
) -> None:
    registry = Registry(EmailJob)

    def take_over(job_id: int) -> None:
        # Another worker's claim of a new attempt, as the fence sees it (a plain UPDATE of
        # a non-key column does not wait for the group's FOR KEY SHARE lock).
        with engine.begin() as connection:
            connection.execute(
                sa.update(EmailJob)
                .where(EmailJob.id == job_id)
                .values(attempts=EmailJob.attempts + 1)
            )

    @registry.task(queue="group", mode="lock", lease=60)
    def write(ctx: JobContext) -> None:
        write_order(ctx)
        if ctx.args.get("taken"):
            take_over(ctx.id)

    @registry.task(queue="group", mode="lock", lease=60)
    def untouched(ctx: JobContext) -> None:
        take_over(ctx.id)

    ids = enqueue(
        engine,
        write.job({"order": 1}),
        write.job({"order": 2, "taken": True}),
        untouched.job(),
        write.job({"order": 3}),
    )
    with running(registry, engine):
        wait_for_statuses(engine, [ids[0], ids[3]], ["succeeded", "succeeded"])
    # Lost: nothing written for them, their rows left to the attempt that owns them now.
    assert statuses(engine, [ids[1], ids[2]]) == ["running", "running"]
    assert [attempts(engine, i) for i in ids] == [1, 2, 2, 1]
    written = orders(engine)
    assert sorted(written) == [1, 3]
    assert written[1] == written[3]


def test_a_failed_commit_gives_the_whole_group_back_and_it_runs_again(
    engine: sa.Engine, one_group: None
) -> None:
    registry = Registry(EmailJob)
    ran: list[int] = []

    @registry.task(queue="group", mode="lock")
    def write(ctx: JobContext) -> None:
        ran.append(ctx.id)
        write_order(ctx)

    @registry.task(queue="group", mode="lock")
    def untouched(ctx: JobContext) -> None:
        ran.append(ctx.id)

    # A deferred constraint trigger of the test's own: the first commit that inserts an
    # order fails (a sequence, which no rollback undoes, counts the tries).
    setup = [
        "CREATE SEQUENCE refuse_once",
        (
            "CREATE FUNCTION refuse_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF nextval('refuse_once') = 1 THEN RAISE EXCEPTION 'refused at commit'; END IF; "
            "RETURN NULL; END $$"
        ),
        (
            "CREATE CONSTRAINT TRIGGER refuse_once AFTER INSERT ON orders "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_once()"
        ),
    ]
    with engine.begin() as connection:
        for sql in setup:
            connection.execute(sa.text(sql))
    try:
        ids = enqueue(engine, write.job({"order": 1}), untouched.job(), write.job({"order": 2}))
        allowed = [max_attempts(engine, i) for i in ids]
        with running(registry, engine):
            wait_for_statuses(engine, ids, ["succeeded"] * 3)
    finally:
        with engine.begin() as connection:
            connection.execute(sa.text("DROP TRIGGER refuse_once ON orders"))
            connection.execute(sa.text("DROP FUNCTION refuse_once()"))
            connection.execute(sa.text("DROP SEQUENCE refuse_once"))
    assert sorted(ran) == sorted(ids + ids)  # every job of the group ran again
    assert [attempts(engine, i) for i in ids] == [2, 2, 2]  # given back once, run again
    assert [max_attempts(engine, i) for i in ids] == [m + 1 for m in allowed]  # not charged
    written = orders(engine)
    assert sorted(written) == [1, 2]


# -- parallel all the same ------------------------------------------------------------------


def test_slow_lock_mode_handlers_still_run_in_parallel(engine: sa.Engine) -> None:
    registry = Registry(EmailJob)
    count = 4
    # Each handler waits for all the others to be running: only parallel handlers pass.
    barrier = threading.Barrier(count, timeout=PATIENCE)

    @registry.task(queue="group", mode="lock", max_attempts=1)
    def meet(ctx: JobContext) -> None:
        write_order(ctx)
        barrier.wait()

    ids = enqueue(engine, *[meet.job({"order": n}) for n in range(count)])
    with running(registry, engine):
        wait_for_statuses(engine, ids, ["succeeded"] * count)
    assert len(set(orders(engine).values())) == count  # a transaction each


# -- chunks: a group takes queued attempts two, four, ... at a time -------------------------


def test_a_chunk_member_taken_over_before_its_lock_is_lost_and_never_runs(
    engine: sa.Engine, one_group: None
) -> None:
    registry = Registry(EmailJob)
    ran: list[int] = []
    ids: list[int] = []

    @registry.task(queue="group", mode="lock", lease=60)
    def write(ctx: JobContext) -> None:
        ran.append(ctx.id)
        write_order(ctx)
        if ctx.id == ids[0]:
            # The group's first attempt: its next chunk is [ids[1], ids[2]], locked in one
            # statement after this returns. Another worker's claim takes ids[2] first.
            with engine.begin() as connection:
                connection.execute(
                    sa.update(EmailJob)
                    .where(EmailJob.id == ids[2])
                    .values(attempts=EmailJob.attempts + 1)
                )

    ids.extend(enqueue(engine, *[write.job({"order": n}) for n in range(4)]))
    with running(registry, engine):
        wait_for_statuses(engine, [ids[0], ids[1], ids[3]], ["succeeded"] * 3)
    assert ids[2] not in ran  # lost at its chunk's lock: its handler never started
    assert sorted(ran) == [ids[0], ids[1], ids[3]]
    assert statuses(engine, [ids[2]]) == ["running"]  # the new attempt's
    assert attempts(engine, ids[2]) == 2
    written = orders(engine)
    assert sorted(written) == [0, 1, 3]
    assert len(set(written.values())) == 1  # one group, one transaction


def test_a_chunk_member_whose_cancel_is_requested_before_its_turn_never_runs(
    engine: sa.Engine, one_group: None
) -> None:
    registry = Registry(EmailJob)
    ran: list[int] = []
    ids: list[int] = []
    holder: list[Worker] = []

    def cancel_known(job_id: int) -> bool:
        return any(a.job.id == job_id and a.cancel_requested for a in holder[0]._state.snapshot())

    @registry.task(queue="group", mode="lock", lease=60)
    def write(ctx: JobContext) -> None:
        ran.append(ctx.id)
        write_order(ctx)
        if ctx.id == ids[1]:
            # In the chunk [ids[1], ids[2]], both locked already: ids[2]'s cancel is
            # requested, and heard by the worker, while it waits for its turn.
            with Session(engine) as session, session.begin():
                sqla_jobs.cancel(session, EmailJob, ids[2])
            assert wait_for(lambda: cancel_known(ids[2]))

    ids.extend(enqueue(engine, *[write.job({"order": n}) for n in range(4)]))
    with running(registry, engine) as worker:
        holder.append(worker)
        wait_for_statuses(engine, ids, ["succeeded", "succeeded", "cancelled", "succeeded"])
    assert ids[2] not in ran
    written = orders(engine)
    assert sorted(written) == [0, 1, 3]
    assert len(set(written.values())) == 1  # the others still committed together


def test_quick_handlers_make_large_groups(engine: sa.Engine, one_group: None) -> None:
    # One group however many chunks it takes (one_group: a busy machine's slow statements
    # would otherwise cut it short).
    registry = Registry(EmailJob)

    @registry.task(queue="group", mode="lock")
    def write(ctx: JobContext) -> None:
        write_order(ctx)

    count = 40
    ids = enqueue(engine, *[write.job({"order": n}) for n in range(count)])
    with running(registry, engine, batch_size=count, prefetch=count):
        wait_for_statuses(engine, ids, ["succeeded"] * count)
    assert len(set(orders(engine).values())) == 1


def test_slow_handlers_of_a_new_task_run_in_parallel_after_quick_ones(
    engine: sa.Engine,
) -> None:
    # The quick task's pace sizes its own chunks only: the slow task's jobs, not seen yet,
    # each go alone, and idle threads take the rest.
    registry = Registry(EmailJob)
    count = 4
    barrier = threading.Barrier(count, timeout=PATIENCE)

    @registry.task(queue="group", mode="lock")
    def quick(ctx: JobContext) -> None:
        pass

    @registry.task(queue="group", mode="lock", max_attempts=1)
    def meet(ctx: JobContext) -> None:
        write_order(ctx)
        barrier.wait()

    with running(registry, engine):
        quick_ids = enqueue(engine, *[quick.job() for _ in range(50)])
        wait_for_statuses(engine, quick_ids, ["succeeded"] * 50)
        ids = enqueue(engine, *[meet.job({"order": n}) for n in range(count)])
        wait_for_statuses(engine, ids, ["succeeded"] * count)
    assert len(set(orders(engine).values())) == count  # a transaction each


# -- the group's own completion ---------------------------------------------------------------


def test_a_cancel_found_by_the_groups_completion_ends_only_that_job(
    engine: sa.Engine, one_group: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Neither handler touches the session: both wait for the group's one completion
    # statement, which finds the first job's cancel requested (the worker heard of it
    # while the handler ran, and the handler ignored it).
    registry = Registry(EmailJob)
    waiting = threading.Event()

    @registry.task(queue="group", mode="lock", lease=60)
    def untouched(ctx: JobContext) -> None:
        if ctx.args.get("wait"):
            waiting.set()
            assert wait_for(lambda: ctx.cancelled)

    ids = enqueue(engine, untouched.job({"wait": True}), untouched.job(), untouched.job())
    caplog.set_level("INFO", logger="sqla_jobs.worker")
    with running(registry, engine):
        assert waiting.wait(PATIENCE)
        with Session(engine) as session, session.begin():
            sqla_jobs.cancel(session, EmailJob, ids[0])
        wait_for_statuses(engine, ids, ["cancelled", "succeeded", "succeeded"])
    actions = {(getattr(r, "job_id", None), getattr(r, "action", None)) for r in caplog.records}
    assert (ids[0], "job_cancelled") in actions
    assert not [r for r in caplog.records if getattr(r, "action", None) == "lease_lost"]
