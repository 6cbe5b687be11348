"""Handlers in child processes (``process=True``, sqla_jobs/worker/processes.py), proven from
SQL with real workers: results and progress stored, a raised exception failing its attempt
with the child's traceback, a child that dies mid-job failing only that attempt, a time limit
and a cancel killing the child, snoozes; bad options refused before any SQL."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import process_tasks
import pytest
import sqlalchemy as sa
from in_process import PATIENCE, enqueue
from models import EmailJob, EmailJobResult
from process_tasks import registry
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import ConfigurationError, JobContext, Registry
from sqla_jobs.worker import Worker


def rows(engine: sa.Engine, ids: list[int]) -> dict[int, Any]:
    with engine.connect() as connection:
        found = connection.execute(
            sa.text(
                "SELECT id, status, attempts, snoozes, last_error, progress "
                "FROM email_jobs WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        )
        return {row.id: row for row in found}


def results(engine: sa.Engine) -> dict[int, Any]:
    with Session(engine) as session:
        return {r.job_id: r.value for r in session.scalars(sa.select(EmailJobResult))}


def finished(engine: sa.Engine, ids: list[int]) -> dict[int, Any]:
    """Wait until every job of ``ids`` has ended (succeeded, dead or cancelled)."""

    def ended() -> dict[int, Any] | None:
        found = rows(engine, ids)
        done = all(r.status in ("succeeded", "dead", "cancelled") for r in found.values())
        return found if done and len(found) == len(ids) else None

    found: dict[int, Any] = wait_until(ended, timeout=PATIENCE, message="the jobs ended")
    return found


@contextmanager
def running(engine: sa.Engine, **options: Any) -> Iterator[Worker]:
    worker = Worker(registry, engine, queues=["processes"], poll_interval=0.05, grace=5, **options)
    with worker:
        yield worker


def test_results_progress_and_errors_come_back_from_the_children(
    queue_engine: sa.Engine,
) -> None:
    ids = enqueue(
        queue_engine,
        process_tasks.square.job({"x": 7}),
        process_tasks.square.job({"x": 8}),
        process_tasks.thread_square.job({"x": 9}),
        process_tasks.fail.job(),
        process_tasks.raise_odd.job(),
        process_tasks.unpicklable_result.job(),
        process_tasks.read_columns.job(),
    )
    with running(queue_engine, concurrency=4, processes=2) as worker:
        found = finished(queue_engine, ids)
        assert worker.is_healthy()
    square7, square8, thread9, failed, odd, unpicklable, columns = (found[i] for i in ids)
    stored = results(queue_engine)
    assert (square7.status, square8.status, thread9.status) == ("succeeded",) * 3
    assert stored[ids[0]]["square"] == 49
    assert stored[ids[1]]["square"] == 64
    assert stored[ids[2]] == 81
    for value in (stored[ids[0]], stored[ids[1]]):  # run in a child of the worker's process
        assert value["pid"] != os.getpid()
        assert value["parent"] == os.getpid()
    assert (square7.progress["value"], square7.progress["message"]) == (1.0, "squared 7")
    # The exception, with the child's traceback as its cause.
    assert failed.status == "dead"
    assert failed.attempts == 1
    assert f"ValueError: boom from the child of job {ids[3]}" in failed.last_error
    assert re.search(r'process_tasks\.py", line \d+, in fail', failed.last_error)
    assert "ProcessHandlerError: process_tasks._OddError: odd 7" in odd.last_error
    assert "cannot be sent from its child process" in unpicklable.last_error
    assert "ctx.columns is not available there" in columns.last_error


def test_a_child_that_dies_mid_job_fails_only_its_attempt(queue_engine: sa.Engine) -> None:
    with running(queue_engine, concurrency=2, processes=1) as worker:
        [before] = enqueue(queue_engine, process_tasks.square.job({"x": 1}))
        finished(queue_engine, [before])
        killed, exited = enqueue(
            queue_engine, process_tasks.die_on_first_attempt.job(), process_tasks.exit_mid_job.job()
        )
        found = finished(queue_engine, [killed, exited])
        [after] = enqueue(queue_engine, process_tasks.square.job({"x": 2}))
        finished(queue_engine, [after])
        assert worker.is_healthy()
    stored = results(queue_engine)
    # Killed on its first attempt, retried: the second ran in a fresh child.
    assert (found[killed].status, found[killed].attempts) == ("succeeded", 2)
    assert "died (killed by SIGKILL)" in found[killed].last_error
    assert (found[exited].status, found[exited].attempts) == ("dead", 1)
    assert "died (exit code 3); only this attempt fails" in found[exited].last_error
    # One child at a time: the one that ran first died, and others took its place.
    assert stored[before]["pid"] not in (stored[killed], stored[after]["pid"])


def test_a_time_limit_kills_the_child_and_frees_its_slot(queue_engine: sa.Engine) -> None:
    with running(queue_engine, concurrency=1, processes=1) as worker:
        [spun] = enqueue(queue_engine, process_tasks.spin.job({"forever": True}))
        found = finished(queue_engine, [spun])
        # One slot, one process: the killed child's slot and place come back, and the next
        # job runs (a thread handler that ignores its limit would keep the slot).
        [quick] = enqueue(queue_engine, process_tasks.square.job({"x": 3}))
        found |= finished(queue_engine, [quick])
        wait_until(
            lambda: worker.health().overrunning == () and worker.is_healthy(),
            timeout=PATIENCE,
            message="no handler overruns its limit",
        )
    assert (found[spun].status, found[spun].attempts) == ("dead", 1)
    assert "ran past its time limit of 0.5 seconds" in found[spun].last_error
    assert found[quick].status == "succeeded"


def test_a_cancel_kills_the_child(queue_engine: sa.Engine) -> None:
    with running(queue_engine, concurrency=2, processes=1):
        [job_id] = enqueue(queue_engine, process_tasks.sleep_long.job())
        wait_until(
            lambda: rows(queue_engine, [job_id])[job_id].status == "running",
            timeout=PATIENCE,
            message="the job runs",
        )
        with Session(queue_engine) as session, session.begin():
            sqla_jobs.cancel(session, EmailJob, job_id)
        found = finished(queue_engine, [job_id])
        [after] = enqueue(queue_engine, process_tasks.square.job({"x": 4}))
        finished(queue_engine, [after])
    assert found[job_id].status == "cancelled"
    assert results(queue_engine)[after]["square"] == 16


def test_a_process_handler_snoozes(queue_engine: sa.Engine) -> None:
    [job_id] = enqueue(queue_engine, process_tasks.snooze_once.job())
    with running(queue_engine, concurrency=1, processes=1):
        found = finished(queue_engine, [job_id])
    assert (found[job_id].status, found[job_id].attempts, found[job_id].snoozes) == (
        "succeeded",
        3,
        2,
    )
    assert results(queue_engine)[job_id] == "woke"


# -- bad input, before any SQL ---------------------------------------------------------------


def handler(ctx: JobContext) -> None:
    """A top-level function of this module."""


def test_bad_process_options_are_refused_at_registration() -> None:
    tasks = Registry(EmailJob)
    with pytest.raises(ConfigurationError, match="process=True needs lease mode"):
        tasks.add(handler, process=True, mode="lock")
    with pytest.raises(ConfigurationError, match="process=True needs lease mode"):
        Registry(EmailJob, default_mode="lock").add(handler, process=True)
    with pytest.raises(ConfigurationError, match="process must be True or False"):
        tasks.add(handler, process=1)  # type: ignore[arg-type]

    async def coroutine(ctx: JobContext) -> None:
        """A coroutine function."""

    with pytest.raises(ConfigurationError, match="needs a plain function"):
        tasks.add(coroutine, process=True)

    def nested(ctx: JobContext) -> None:
        """Not found by its module and name."""

    with pytest.raises(ConfigurationError, match="defined at the top level of a module"):
        tasks.add(nested, process=True)
    with pytest.raises(ConfigurationError, match="defined at the top level of a module"):
        tasks.add(lambda ctx: None, name="anonymous", process=True)
    assert len(tasks) == 0


def test_a_function_the_child_cannot_find_is_refused_by_the_worker(engine: sa.Engine) -> None:
    tasks = Registry(EmailJob)
    tasks.add(handler, process=True)  # found: this module's handler
    Worker(tasks, engine)
    renamed = Registry(EmailJob)

    def elsewhere(ctx: JobContext) -> None:
        """Given the qualified name of another function of this module."""

    elsewhere.__qualname__ = "test_bad_process_options_are_refused_at_registration"
    renamed.add(elsewhere, process=True)
    with pytest.raises(ConfigurationError, match="is not its function"):
        Worker(renamed, engine)
    elsewhere.__qualname__ = "no_such_function"
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        Worker(renamed, engine)


@pytest.mark.parametrize(
    ("processes", "message"),
    [(0, "processes must be an integer in"), (5, r"\[1, concurrency=4\]"), (1.5, "not 1.5")],
)
def test_a_bad_processes_setting_is_refused(
    engine: sa.Engine, processes: object, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Worker(registry, engine, processes=processes)  # type: ignore[arg-type]
