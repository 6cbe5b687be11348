"""Tables and tasks of the fault harness (tests/chaos.py); workers import ``chaos_tasks:registry``.

Every handler records what it did in ``chaos_effects``:

* a ``start`` row, committed at once on a connection of the handler's own, so the harness
  sees every attempt that began (even one whose worker died a moment later);
* an ``effect`` row, the job's real work: committed on the handler's own connection in lease
  mode (at least once: an attempt whose lease was taken over may still write it), or written
  through ``ctx.session`` in lock mode, where it commits together with the completion,
  exactly once.

The four tasks, and what the harness expects of each:

``leased``        lease mode, a plain function: start, sleep ``args["sleep"]``, effect, sleep
                  ``args["after"]`` (work after the effect: a worker killed then leaves an
                  effect whose completion never commits, a duplicate once the job runs again)
``async_leased``  the same as a coroutine (runs on the worker's event loop)
``locked``        lock mode: start, effect through the claim's session, sleep
``poison``        lease mode, ``max_attempts=3``, a fast retry policy: start, sleep, raise
``timed``         lease mode with a time limit (the task's ``TIMED_LIMIT``, or the job's own
                  ``time_limit``), ``max_attempts=3``, a fast retry policy: start, sleep
                  the attempt's planned time (:func:`planned_sleep`: ``args["sleeps"]``,
                  one per attempt, the last repeated), then the effect unless the attempt
                  ran past its limit (``ctx.cancelled``), and return. A planned sleep is
                  either well under the limit or twice it (a *slow* attempt, which must
                  time out). ``args["watch"]``: the handler watches ``ctx.cancelled`` and
                  raises ``JobTimeoutError`` at once; otherwise it sleeps on past the limit
                  (keeping its slot) and returns a result the worker must refuse
``async_timed``   the same as a coroutine: cancelled at its limit, mid-sleep
``snoozy``        lease mode, ``max_attempts=5``: start, then, while the job has snoozed
                  fewer than ``args["snoozes"]`` times (read from its row), snooze for
                  ``args["delay"]`` seconds (``raise Snooze``, or ``return Snooze`` when
                  ``args["how"] == "return"``); then sleep, effect, sleep and succeed, like
                  ``leased``. Up to eight snoozes on five attempts: a snooze that spent an
                  attempt would leave the job dead

Workflows: ``ChaosJob`` mixes in ``StepMixin`` (its workflows are ``ChaosWorkflow`` rows,
each tied to the ``ChaosOrder`` written in the same business transaction), so steps share
the table, the queues and the workers with the jobs above. The step tasks record a ``start``
row like the others; every one but the failing ones reads its dependencies' results
(``ctx.dependency_results()``) and returns ``{"attempt": n, "saw": [their step names]}``:

``step_leased``          lease mode: start, read the results, sleep, effect (its own
                         transaction), sleep ``args["after"]``
``step_locked``          lock mode: start, read the results through the claim's session,
                         sleep, then the effect through the claim's session (written last,
                         just before the completion: the harness compares its dependents'
                         starts with it)
``step_failing``         lease mode, ``max_attempts=2``: start, sleep, raise (a dead step
                         cancels the steps after it, but those whose policy is ``run``)
``step_locked_failing``  lock mode, ``max_attempts=2``: start, effect through the claim's
                         session, sleep, raise: the effect rolls back with the attempt
``step_split``           lease mode: start, add the steps ``args["parts"]`` plans to its
                         workflow (``ctx.add_steps(..., then=[args["then"]])``), sleep,
                         effect. Lease mode writes them at once: an attempt after one that
                         added them (and then lost its job to a fault) is refused, finds
                         them there, and goes on (its result says ``"found": true``)
``step_split_locked``    the same in lock mode: the steps commit with the completion

Leases are two seconds (heartbeats every 0.67 s), so a killed or paused worker's jobs come
back within a few seconds, and retries are quick, so a job that failed during a fault does
not wait long for its next attempt.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_jobs import (
    InvalidWorkflowError,
    JobMixin,
    JobResultMixin,
    RetryPolicy,
    Snooze,
    StepMixin,
    Workflow,
    WorkflowMixin,
)
from sqla_jobs.registry import JobContext, Registry

#: The variable the ``sqla-jobs`` command reads its database URL from; the handlers too.
DATABASE_URL_VARIABLE = "SQLA_JOBS_DATABASE_URL"
LEASE_SECONDS = 2.0
QUEUE = "chaos"
LOCK_QUEUE = "chaos_lock"
QUEUES = (QUEUE, LOCK_QUEUE)
POISON_MAX_ATTEMPTS = 3
#: Retries of jobs that failed during a fault (their effect could not be written while the
#: server was down, ...): quick, so that the drain after the faults is short.
RETRY = RetryPolicy(base=timedelta(milliseconds=200), cap=timedelta(seconds=2))
POISON_RETRY = RetryPolicy(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=200))

#: The time-limited tasks' limit (a job's own ``time_limit`` takes its place), attempts and
#: retries. The harness plans each attempt's sleep: a quick one at most a quarter of its
#: limit (or 2 s under a job's own 4 s limit), a slow one twice it.
TIMED_LIMIT = 1.5
TIMED_MAX_ATTEMPTS = 3
#: Snoozing jobs' attempts: fewer than the snoozes some of them take (up to eight), and
#: enough that faults alone do not use them up (three did once, on one job, at 3: a job is
#: dead at its last attempt, however its attempts were lost).
SNOOZY_MAX_ATTEMPTS = 5

LEASE_TASKS = ("leased", "async_leased")
LOCK_TASKS = ("locked",)
POISON_TASKS = ("poison",)
TIMED_TASKS = ("timed", "async_timed")
SNOOZY_TASKS = ("snoozy",)
#: Every lease-mode task whose jobs must end with an effect (at least once).
EFFECT_LEASE_TASKS = LEASE_TASKS + TIMED_TASKS + SNOOZY_TASKS

#: Workflow steps that fail on every attempt: dead at their last.
STEP_FAIL_MAX_ATTEMPTS = 2
#: The step tasks: lease-mode ones that write an effect when they succeed (at least once),
#: lock-mode ones (an effect exactly once if they succeed, none if not), the failing ones,
#: and those that add steps at run time.
STEP_LEASE_TASKS = ("step_leased", "step_split")
STEP_LOCK_TASKS = ("step_locked", "step_split_locked", "step_locked_failing")
STEP_FAILING_TASKS = ("step_failing", "step_locked_failing")
STEP_SPLIT_TASKS = ("step_split", "step_split_locked")


class Base(DeclarativeBase):
    pass


class ChaosOrder(Base):
    """The business row a producer writes in the transaction that enqueues a workflow."""

    __tablename__ = "chaos_orders"

    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    shape: Mapped[str] = mapped_column(sa.String(20))


class ChaosWorkflow(WorkflowMixin, Base):
    __tablename__ = "chaos_workflows"

    order_id: Mapped[int | None] = mapped_column(sa.ForeignKey("chaos_orders.id"))


class ChaosJobResult(JobResultMixin, Base):
    __tablename__ = "chaos_job_results"


class ChaosJob(StepMixin, JobMixin, Base):
    """The harness's jobs, and the steps of its workflows (the other jobs leave the step
    columns NULL)."""

    __tablename__ = "chaos_jobs"
    workflow_model = ChaosWorkflow
    result_model = ChaosJobResult


class ChaosEffect(Base):
    """One row per thing a handler did: ``kind`` is ``start`` or ``effect``."""

    __tablename__ = "chaos_effects"

    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    attempt: Mapped[int]
    kind: Mapped[str] = mapped_column(sa.String(10))
    pid: Mapped[int]
    at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), server_default=sa.func.clock_timestamp()
    )
    #: When the attempt was claimed, by the database clock (its first lease's end minus the
    #: lease): the harness attributes a duplicate to a fault by it, as the attempt held its
    #: job from then on, whenever its handler got to write the start row.
    claimed_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))


registry = Registry(
    ChaosJob,
    result_model=ChaosJobResult,
    default_queue=QUEUE,
    default_lease=LEASE_SECONDS,
    default_retry=RETRY,
)

_engine: sa.Engine | None = None
_engine_lock = threading.Lock()


def own_engine() -> sa.Engine:
    """The handlers' own engine (not the worker's), on the URL the worker was given.

    ``pool_pre_ping`` replaces the connections a server restart broke.
    """
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = sa.create_engine(
                os.environ[DATABASE_URL_VARIABLE],
                pool_size=2,
                max_overflow=30,
                pool_pre_ping=True,
                connect_args={"connect_timeout": 5},
            )
        return _engine


def _row(ctx: JobContext, kind: str) -> ChaosEffect:
    return ChaosEffect(
        job_id=ctx.id,
        attempt=ctx.attempt,
        kind=kind,
        pid=os.getpid(),
        claimed_at=ctx.job.lease_expires_at - timedelta(seconds=LEASE_SECONDS),
    )


def record(ctx: JobContext, kind: str) -> None:
    """Commit a row at once, on a connection of the handler's own."""
    with Session(own_engine()) as session, session.begin():
        session.add(_row(ctx, kind))


def _sleep(ctx: JobContext, key: str = "sleep") -> float:
    return float(ctx.args.get(key, 0.0))


@registry.task
def leased(ctx: JobContext) -> dict[str, Any]:
    """Lease mode: start row, sleep, effect row (its own transaction: at least once)."""
    record(ctx, "start")
    time.sleep(_sleep(ctx))
    record(ctx, "effect")
    time.sleep(_sleep(ctx, "after"))
    return {"attempt": ctx.attempt}


@registry.task
async def async_leased(ctx: JobContext) -> dict[str, Any]:
    """A coroutine in lease mode: the same as ``leased``."""
    await asyncio.to_thread(record, ctx, "start")
    await asyncio.sleep(_sleep(ctx))
    await asyncio.to_thread(record, ctx, "effect")
    await asyncio.sleep(_sleep(ctx, "after"))
    return {"attempt": ctx.attempt}


@registry.task(queue=LOCK_QUEUE, mode="lock")
def locked(ctx: JobContext) -> None:
    """Lock mode: the effect row commits with the completion, exactly once."""
    record(ctx, "start")
    ctx.session.add(_row(ctx, "effect"))
    ctx.session.flush()
    time.sleep(_sleep(ctx))


@registry.task(max_attempts=POISON_MAX_ATTEMPTS, retry=POISON_RETRY)
def poison(ctx: JobContext) -> None:
    """Fails on every attempt, after a short sleep (so that faults hit some attempts)."""
    record(ctx, "start")
    time.sleep(_sleep(ctx))
    raise RuntimeError(f"poisoned on attempt {ctx.attempt}")


def planned_sleep(args: dict[str, Any], attempt: int) -> float:
    """How long attempt ``attempt`` of a timed job sleeps: ``args["sleeps"]`` holds one
    time per attempt, the last one for every later attempt."""
    sleeps = [float(s) for s in args["sleeps"]]
    return sleeps[min(attempt, len(sleeps)) - 1]


@registry.task(time_limit=TIMED_LIMIT, max_attempts=TIMED_MAX_ATTEMPTS, retry=POISON_RETRY)
def timed(ctx: JobContext) -> dict[str, Any]:
    """Time-limited: start, sleep the attempt's planned time, effect unless past the limit."""
    record(ctx, "start")
    sleep = planned_sleep(ctx.args, ctx.attempt)
    if ctx.args.get("watch"):
        until = time.monotonic() + sleep
        while (left := until - time.monotonic()) > 0:
            ctx.raise_if_cancelled()  # JobTimeoutError once past the limit
            time.sleep(min(0.05, left))
    else:
        time.sleep(sleep)  # on past the limit: the worker keeps this slot until it returns
    if not ctx.cancelled:  # past the limit the attempt has failed already: no effect
        record(ctx, "effect")
    # Returned past the limit too: the worker must refuse it (the job does not succeed).
    return {"attempt": ctx.attempt}


@registry.task(time_limit=TIMED_LIMIT, max_attempts=TIMED_MAX_ATTEMPTS, retry=POISON_RETRY)
async def async_timed(ctx: JobContext) -> dict[str, Any]:
    """``timed`` as a coroutine: the worker cancels it at its limit, mid-sleep."""
    await asyncio.to_thread(record, ctx, "start")
    await asyncio.sleep(planned_sleep(ctx.args, ctx.attempt))
    if not ctx.cancelled:
        await asyncio.to_thread(record, ctx, "effect")
    return {"attempt": ctx.attempt}


def snoozed_so_far(job_id: int) -> int:
    """The job's ``snoozes`` as its row holds them (committed snoozes only)."""
    with own_engine().connect() as connection:
        count: int = connection.execute(
            sa.select(ChaosJob.snoozes).where(ChaosJob.id == job_id)
        ).scalar_one()
    return count


@registry.task(max_attempts=SNOOZY_MAX_ATTEMPTS, retry=POISON_RETRY)
def snoozy(ctx: JobContext) -> dict[str, Any] | Snooze:
    """Snoozes until its job snoozed ``args["snoozes"]`` times, then works like ``leased``."""
    record(ctx, "start")
    if snoozed_so_far(ctx.id) < int(ctx.args["snoozes"]):
        snooze = Snooze(float(ctx.args["delay"]))
        if ctx.args.get("how") == "return":
            return snooze
        raise snooze
    time.sleep(_sleep(ctx))
    record(ctx, "effect")
    time.sleep(_sleep(ctx, "after"))
    return {"attempt": ctx.attempt}


# -- workflow steps -------------------------------------------------------------------------


def _saw(ctx: JobContext) -> list[str]:
    """The step names of the dependency results this step reads (those that succeeded)."""
    return sorted(ctx.dependency_results())


def _effect_in_claim(ctx: JobContext) -> None:
    """The effect through the claim's session: it commits with the completion, or not at
    all; stamped (``clock_timestamp()``) as it is flushed."""
    ctx.session.add(_row(ctx, "effect"))
    ctx.session.flush()


@registry.task
def step_leased(ctx: JobContext) -> dict[str, Any]:
    """A lease-mode step: start, its dependencies' results, sleep, effect, sleep."""
    record(ctx, "start")
    saw = _saw(ctx)
    time.sleep(_sleep(ctx))
    record(ctx, "effect")
    time.sleep(_sleep(ctx, "after"))
    return {"attempt": ctx.attempt, "saw": saw}


@registry.task(queue=LOCK_QUEUE, mode="lock")
def step_locked(ctx: JobContext) -> dict[str, Any]:
    """A lock-mode step: its effect, written last, commits with its completion."""
    record(ctx, "start")
    saw = _saw(ctx)
    time.sleep(_sleep(ctx))
    _effect_in_claim(ctx)
    return {"attempt": ctx.attempt, "saw": saw}


@registry.task(max_attempts=STEP_FAIL_MAX_ATTEMPTS, retry=POISON_RETRY)
def step_failing(ctx: JobContext) -> None:
    """A lease-mode step that fails on every attempt."""
    record(ctx, "start")
    time.sleep(_sleep(ctx))
    raise RuntimeError(f"poisoned on attempt {ctx.attempt}")


@registry.task(
    queue=LOCK_QUEUE, mode="lock", max_attempts=STEP_FAIL_MAX_ATTEMPTS, retry=POISON_RETRY
)
def step_locked_failing(ctx: JobContext) -> None:
    """A lock-mode step that fails on every attempt: its effect rolls back each time."""
    record(ctx, "start")
    _effect_in_claim(ctx)
    time.sleep(_sleep(ctx))
    raise RuntimeError(f"poisoned on attempt {ctx.attempt}")


def planned_parts(ctx: JobContext) -> Workflow:
    """The steps a split step adds: ``args["parts"]``, ``[name, task, args]`` each."""
    flow = Workflow()
    for name, task, args in ctx.args["parts"]:
        flow.add(name, registry[task].job(args))
    return flow


def steps_named(ctx: JobContext, names: list[str]) -> list[str]:
    """Which of ``names`` are steps of this step's workflow (committed)."""
    this = sa.select(ChaosJob.workflow_id).where(ChaosJob.id == ctx.id).scalar_subquery()
    with own_engine().connect() as connection:
        found = connection.execute(
            sa.select(ChaosJob.step).where(ChaosJob.workflow_id == this, ChaosJob.step.in_(names))
        ).scalars()
        return sorted(str(name) for name in found)


@registry.task
def step_split(ctx: JobContext) -> dict[str, Any]:
    """Lease mode: adds its planned steps (which ``args["then"]`` waits for too), at once."""
    record(ctx, "start")
    flow = planned_parts(ctx)
    found = False
    try:
        ctx.add_steps(flow, then=[ctx.args["then"]])
    except InvalidWorkflowError:
        # Refused when an earlier attempt added them (committed at once, in lease mode) and
        # then lost the job: they are there, and this attempt goes on. Anything else raises.
        names = [step.name for step in flow.steps]
        if steps_named(ctx, names) != sorted(names):
            raise
        found = True
    time.sleep(_sleep(ctx))
    record(ctx, "effect")
    return {"attempt": ctx.attempt, "saw": _saw(ctx), "found": found}


@registry.task(queue=LOCK_QUEUE, mode="lock")
def step_split_locked(ctx: JobContext) -> dict[str, Any]:
    """Lock mode: adds its planned steps through the claim's session (they commit with it)."""
    record(ctx, "start")
    ctx.add_steps(planned_parts(ctx), then=[ctx.args["then"]])
    time.sleep(_sleep(ctx))
    _effect_in_claim(ctx)
    return {"attempt": ctx.attempt, "saw": _saw(ctx)}
