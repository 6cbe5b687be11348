"""Hooks around handlers (sqla_jobs.hooks), proven with real workers on real PostgreSQL:
their order, where they run (thread, event loop, the handler's task), that a hook that raises
is logged and changes no outcome, lock mode (no session, the handler's writes untouched),
snoozes and time limits; bad hooks refused before any SQL."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from in_process import PATIENCE, enqueue, running
from models import EmailJob, EmailJobResult, Order
from no_sql import no_sql
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session
from worker_harness import wait_until

from sqla_jobs import ConfigurationError, Hooks, JobContext, Registry
from sqla_jobs.context import Snooze
from sqla_jobs.errors import JobTimeoutError
from sqla_jobs.worker import Worker


def row(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as connection:
        return connection.execute(
            sa.text("SELECT status, attempts, snoozes, last_error FROM email_jobs WHERE id = :id"),
            {"id": job_id},
        ).one()


def result_of(engine: sa.Engine, job_id: int) -> Any:
    with Session(engine) as session:
        return session.scalars(
            sa.select(EmailJobResult.value).where(EmailJobResult.job_id == job_id)
        ).one_or_none()


def until(condition: Any) -> None:
    wait_until(condition, timeout=PATIENCE, message="the hooks test's condition")


def ended(engine: sa.Engine, job_id: int, status: str = "succeeded") -> None:
    until(lambda: row(engine, job_id).status == status)


def recorder(calls: list[str], name: str) -> Hooks:
    """Hooks that append ``name.before``, ``name.after``, ``name.on_error`` to ``calls``."""

    def before(ctx: JobContext) -> None:
        calls.append(f"{name}.before")

    def after(ctx: JobContext, result: Any) -> None:
        calls.append(f"{name}.after:{result!r}")

    def on_error(ctx: JobContext, error: BaseException) -> None:
        calls.append(f"{name}.on_error:{type(error).__name__}")

    return Hooks(before=before, after=after, on_error=on_error)


def test_hooks_nest_registry_wide_outside_the_tasks_own(queue_engine: sa.Engine) -> None:
    calls: list[str] = []
    registry = Registry(EmailJob, result_model=EmailJobResult, hooks=recorder(calls, "r1"))

    @registry.task(hooks=recorder(calls, "t1") + recorder(calls, "t2"), max_attempts=1)
    def greet(ctx: JobContext) -> str:
        calls.append("handler")
        if ctx.args.get("fail"):
            raise ValueError("no")
        return "hello"

    registry.add_hooks(recorder(calls, "r2"))  # after the task: it applies all the same

    (ok,) = enqueue(queue_engine, greet.job())
    with running(registry, queue_engine, concurrency=1):
        ended(queue_engine, ok)
        assert calls == [
            "r1.before",
            "r2.before",
            "t1.before",
            "t2.before",
            "handler",
            "t2.after:'hello'",
            "t1.after:'hello'",
            "r2.after:'hello'",
            "r1.after:'hello'",
        ]
        calls.clear()
        (bad,) = enqueue(queue_engine, greet.job({"fail": True}))
        ended(queue_engine, bad, "dead")
    assert calls == [
        "r1.before",
        "r2.before",
        "t1.before",
        "t2.before",
        "handler",
        "t2.on_error:ValueError",
        "t1.on_error:ValueError",
        "r2.on_error:ValueError",
        "r1.on_error:ValueError",
    ]
    assert result_of(queue_engine, ok) == "hello"
    assert "ValueError: no" in row(queue_engine, bad).last_error


def test_a_hook_that_raises_is_logged_and_changes_no_outcome(
    queue_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry(EmailJob, result_model=EmailJobResult)
    seen: list[str] = []

    @registry.before
    def broken_before(ctx: JobContext) -> None:
        raise RuntimeError("before broke")

    @registry.after
    async def broken_after(ctx: JobContext, result: Any) -> None:
        raise RuntimeError("after broke")

    @registry.on_error
    def broken_on_error(ctx: JobContext, error: BaseException) -> None:
        raise RuntimeError("on_error broke")

    @registry.on_error
    def still_called(ctx: JobContext, error: BaseException) -> None:
        seen.append(f"{ctx.id}:{error}")

    @registry.task(max_attempts=1)
    def works(ctx: JobContext) -> str:
        return "done"

    @registry.task(max_attempts=1)
    def fails(ctx: JobContext) -> None:
        raise ValueError("the handler's own error")

    caplog.set_level(logging.ERROR, logger="sqla_jobs.worker")
    ok, bad = enqueue(queue_engine, works.job(), fails.job())
    with running(registry, queue_engine):
        ended(queue_engine, ok)
        ended(queue_engine, bad, "dead")
    # The outcomes are the handlers', from SQL.
    assert result_of(queue_engine, ok) == "done"
    assert "ValueError: the handler's own error" in row(queue_engine, bad).last_error
    assert "broke" not in row(queue_engine, bad).last_error
    assert seen == [f"{bad}:the handler's own error"]  # the next hooks ran
    failed = {
        (r.job_id, r.hook, str(r.exc_info[1]) if r.exc_info else "")  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "action", None) == "hook_failed"
    }
    assert failed == {
        (ok, "before", "before broke"),
        (ok, "after", "after broke"),
        (bad, "before", "before broke"),
        (bad, "on_error", "on_error broke"),
    }


def test_a_coroutine_handlers_hooks_run_in_its_own_task(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob, result_model=EmailJobResult)
    tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")
    tasks: dict[str, asyncio.Task[Any] | None] = {}

    @registry.before
    async def bind(ctx: JobContext) -> None:
        tasks["before"] = asyncio.current_task()
        tenant.set(ctx.args["tenant"])

    @registry.before
    def plain(ctx: JobContext) -> None:  # a plain hook: called in the task too
        tasks["plain"] = asyncio.current_task()

    @registry.after
    async def unbind(ctx: JobContext, result: Any) -> None:
        tasks["after"] = asyncio.current_task()
        assert tenant.get() == ctx.args["tenant"]

    @registry.task
    async def tenant_of(ctx: JobContext) -> str:
        tasks["handler"] = asyncio.current_task()
        await asyncio.sleep(0)
        return tenant.get()

    (job_id,) = enqueue(queue_engine, tenant_of.job({"tenant": "acme"}))
    with running(registry, queue_engine):
        ended(queue_engine, job_id)
    assert result_of(queue_engine, job_id) == "acme"  # what the before hook set
    assert tasks["handler"] is not None
    assert tasks == dict.fromkeys(["before", "plain", "after", "handler"], tasks["handler"])


def test_a_coroutine_hook_around_a_thread_handler_runs_on_the_event_loop(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob, result_model=EmailJobResult)
    where: dict[str, str] = {}

    @registry.before
    async def on_loop(ctx: JobContext) -> None:
        await asyncio.sleep(0)
        where["hook"] = threading.current_thread().name

    @registry.task
    def plain(ctx: JobContext) -> str:
        where["handler"] = threading.current_thread().name
        return "ok"

    (job_id,) = enqueue(queue_engine, plain.job())
    with running(registry, queue_engine):
        ended(queue_engine, job_id)
    assert "-event-loop" in where["hook"]
    assert "-handler-" in where["handler"]


def test_lock_mode_hooks_have_no_session_and_keep_the_handlers_writes(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob, default_mode="lock")
    refused: list[str] = []

    @registry.before
    def tries_the_session(ctx: JobContext) -> None:
        try:
            ctx.session  # noqa: B018
        except ConfigurationError as exc:
            refused.append(str(exc))
        raise RuntimeError("a broken hook")

    @registry.after
    def broken(ctx: JobContext, result: Any) -> None:
        raise RuntimeError("a broken hook")

    @registry.task(max_attempts=1)
    def writes(ctx: JobContext) -> None:
        ctx.session.add(Order(id=ctx.args["order"], customer="ada"))
        if ctx.args.get("fail"):
            ctx.session.flush()
            raise ValueError("rolled back")

    kept, failed = enqueue(
        queue_engine, writes.job({"order": 1}), writes.job({"order": 2, "fail": 1})
    )
    with running(registry, queue_engine):
        ended(queue_engine, kept)
        ended(queue_engine, failed, "dead")
    with Session(queue_engine) as session:
        assert session.scalars(sa.select(Order.id)).all() == [1]
    assert len(refused) == 2
    assert "a hook has no session" in refused[0]


def test_a_snooze_goes_to_after_and_a_time_limit_to_on_error(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)
    seen: dict[str, BaseException | Any] = {}

    @registry.after
    def after(ctx: JobContext, result: Any) -> None:
        seen[f"after:{ctx.task}"] = result

    @registry.on_error
    def on_error(ctx: JobContext, error: BaseException) -> None:
        seen[f"on_error:{ctx.task}"] = error

    @registry.task
    def sleepy(ctx: JobContext) -> Snooze:
        return Snooze(3600)

    @registry.task(time_limit=0.2, max_attempts=1)
    async def slow(ctx: JobContext) -> None:
        await asyncio.sleep(PATIENCE)

    snoozed, timed_out = enqueue(queue_engine, sleepy.job(), slow.job())
    with running(registry, queue_engine):
        until(lambda: row(queue_engine, snoozed).snoozes == 1)
        ended(queue_engine, timed_out, "dead")
        until(lambda: "on_error:slow" in seen)
    assert isinstance(seen["after:sleepy"], Snooze)
    error = seen["on_error:slow"]
    assert isinstance(error, JobTimeoutError)
    assert isinstance(error.__cause__, asyncio.CancelledError)
    assert set(seen) == {"after:sleepy", "on_error:slow"}


def test_bad_hooks_are_refused_before_any_sql(queue_engine: sa.Engine) -> None:
    registry = Registry(EmailJob)

    def fine(ctx: JobContext) -> None:
        pass

    with no_sql(queue_engine):
        with pytest.raises(ConfigurationError, match="before hook must be callable"):
            Hooks(before=[fine, 3])  # type: ignore[list-item]
        with pytest.raises(ConfigurationError, match="after must be a function"):
            Hooks(after="fine")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="on_error must be a function"):
            Hooks(on_error=42)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match=r"hooks must be a sqla_jobs\.Hooks"):
            registry.task(hooks=fine)(fine)  # type: ignore[call-overload]
        with pytest.raises(ConfigurationError, match=r"hooks must be a sqla_jobs\.Hooks"):
            Registry(EmailJob, hooks=[fine])  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match=r"hooks must be a sqla_jobs\.Hooks"):
            registry.add_hooks(fine)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="a before hook must be callable"):
            registry.before(None)  # type: ignore[type-var]
    assert len(registry) == 0
    assert not registry.hooks
    both = Hooks(before=fine) + Hooks(before=[fine, fine])
    assert both.before == (fine, fine, fine)
    assert both == Hooks(before=(fine, fine, fine))
    with pytest.raises(AttributeError):
        both.before = ()


def test_a_lock_mode_coroutine_in_a_sync_group_has_its_hooks_in_its_task(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob, default_mode="lock")
    tasks: list[asyncio.Task[Any] | None] = []

    @registry.before
    async def before(ctx: JobContext) -> None:
        tasks.append(asyncio.current_task())

    @registry.after
    def after(ctx: JobContext, result: Any) -> None:
        tasks.append(asyncio.current_task())
        raise RuntimeError("a broken hook")

    @registry.task
    async def writes(ctx: JobContext) -> None:
        tasks.append(asyncio.current_task())
        ctx.session.add(Order(id=ctx.args["order"], customer="ada"))  # flushed by the worker

    (job_id,) = enqueue(queue_engine, writes.job({"order": 3}))
    with running(registry, queue_engine):
        ended(queue_engine, job_id)
    with Session(queue_engine) as session:
        assert session.scalars(sa.select(Order.id)).all() == [3]
    assert len(tasks) == 3
    assert tasks[0] is not None
    assert tasks == [tasks[0]] * 3


async def test_lock_mode_with_an_async_session_runs_hooks_outside_its_transaction(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(EmailJob, default_mode="lock")
    calls: list[str] = []

    @registry.before
    async def before(ctx: JobContext) -> None:
        try:
            ctx.async_session  # noqa: B018
        except ConfigurationError:
            calls.append(f"before {ctx.args['order']}: no session")

    @registry.on_error
    async def on_error(ctx: JobContext, error: BaseException) -> None:
        calls.append(f"on_error {ctx.args['order']}: {error}")
        raise RuntimeError("a broken hook")

    @registry.after
    def after(ctx: JobContext, result: Any) -> None:
        calls.append(f"after {ctx.args['order']}")

    @registry.task(max_attempts=1)
    async def charge(ctx: JobContext) -> None:
        ctx.async_session.add(Order(id=ctx.args["order"], customer="ada"))
        await ctx.async_session.flush()
        if ctx.args["order"] == 2:
            raise ValueError("declined")

    async_engine = create_async_engine(queue_engine.url)
    sessions: async_sessionmaker[AsyncSession] = async_sessionmaker(async_engine)
    try:
        async with Worker(
            registry, queue_engine, poll_interval=0.1, grace=5, async_session_factory=sessions
        ):
            kept, failed = await asyncio.to_thread(
                enqueue, queue_engine, charge.job({"order": 1}), charge.job({"order": 2})
            )
            await asyncio.to_thread(ended, queue_engine, kept)
            await asyncio.to_thread(ended, queue_engine, failed, "dead")
    finally:
        await async_engine.dispose()
    with Session(queue_engine) as session:
        assert session.scalars(sa.select(Order.id)).all() == [1]  # 2's write rolled back
    assert sorted(calls) == [
        "after 1",
        "before 1: no session",
        "before 2: no session",
        "on_error 2: declined",
    ]
