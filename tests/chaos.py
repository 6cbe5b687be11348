"""A fault harness for the worker: real worker processes, real faults, exact accounting.

Run it (the nox session ``chaos`` does this in a fresh virtualenv)::

    python tests/chaos.py                       # 120 s of faults, then the accounting
    python tests/chaos.py --duration 45 --workers 3 --concurrency 4 --jobs 400 --seed 7
    python tests/chaos.py --workflows 150       # more workflows (default 60)
    python tests/chaos.py --json report.json    # the report as JSON too ('-': on stdout)

or call :func:`run_chaos` (tests/test_chaos.py does, for a short run).

What it does
    It starts a throwaway embedded PostgreSQL (or creates a fresh database on the server
    that ``--database-url`` / ``SQLA_JOBS_TEST_DATABASE_URL`` names), creates the tables of
    ``tests/chaos_tasks.py`` and enqueues a mix of jobs whose ``run_at`` is spread over
    most of the run, so that work is under way whenever a fault lands: lease-mode jobs
    (``leased``), lease-mode coroutines (``async_leased``), lock-held jobs (``locked``),
    poison jobs (``poison``, always raise, ``max_attempts=3``), time-limited jobs (``timed``
    and the coroutine ``async_timed``, ``max_attempts=3``: a limit of 1.5 s, or 0.8 s or 4 s
    of the job's own; each attempt planned quick or slow, see :func:`timed_args`) and
    snoozing jobs (``snoozy``: one to eight snoozes, raised or returned, on
    ``max_attempts=5``, then an effect like ``leased``). Leases are 2 s.

    Producers enqueue ``--workflows`` workflows too, each in a business transaction of its
    own that writes an order (``chaos_orders``) and, with ``enqueue_workflow``, the workflow
    (``chaos_workflows``, tied to the order) and its steps, which are ``chaos_jobs`` rows
    (``ChaosJob`` mixes in ``StepMixin``): the same table, queues and workers as the jobs.
    Each one's first step runs at a time spread like the jobs' ``run_at``. The shapes, in
    turn (:func:`plan_workflow`): ``diamond`` (a -> b, c -> d), ``fan`` (a -> a group of 4
    to 8 -> a fan-in), ``chain`` (3 to 6) and ``expand`` (a split step, in lease or lock
    mode, adds 2 to 6 steps at run time with ``ctx.add_steps(..., then=["merge"])``, so
    that the merge step after it waits for them too). Each step is in lease mode
    (``step_leased``: its effect in its own transaction) or lock mode (``step_locked``: its
    effect in the claim's transaction, written last), and reads its dependencies' results.
    One workflow of each shape in three (the second, the fifth...) has a failing step
    (``step_failing`` or the lock-mode ``step_locked_failing``, ``max_attempts=2``) that
    others wait for, and a ``finally`` step after the last one whose policy is
    ``if_dependency_fails="run"`` (some others have one too, and in some the last step has
    that policy as well): a failure cancels the steps after it but those. The harness plans
    every step's outcome.

    It runs ``--workers`` processes of ``python -m sqla_jobs --log-format json worker
    chaos_tasks:registry`` (logs in files), and while they work it injects:

    * a SIGKILL of a worker every few seconds (``--kill-every``), each replaced at once by
      a new process; every other one aims at a worker running a poison job's (or a failing
      step's) last attempt (when one shows up within 1.5 s), which leaves that job to be
      made dead by a claim (and the step's dependents cancelled in the claim's transaction);
      the others at a worker running a lease-mode split step that has committed the steps it
      added (when one shows up within 1.5 s; else at random), whose next attempt is refused
      its own add and finds them there;
    * one PostgreSQL restart at 35 % of the run: an immediate shutdown (like a crash, every
      connection cut), ``--pg-down`` seconds down, then a start (crash recovery). Skipped,
      and said so, on an external server, which cannot be restarted from here;
    * one worker SIGSTOPped at 60 % of the run for ``--pause`` seconds (longer than the
      lease: its jobs are taken over), then SIGCONT; chosen like a targeted kill.

    Then it stops injecting, waits (up to ``--drain-timeout``) until no job is pending or
    running (a step that waits for a dependency is not, and a step never waits without a
    dependency that is: the transaction that ends the last one makes it pending), stops the
    workers with SIGTERM and counts.

The checks (each must hold; the exit status is 1 when one does not, and the report names it)
    ``faults_injected``                 the kills, the restart and the pause did happen
    ``no_job_lost``                     every enqueued job exists and is finished
    ``no_job_stuck``                    no job is pending or running
    ``non_poison_succeeded``            every job but the poison and time-limited ones
                                        succeeded (snoozing ones included)
    ``lock_effect_exactly_once``        every lock-held job has exactly one committed effect,
                                        written by the attempt that succeeded
    ``lease_final_attempt_recorded``    every lease-mode job (time-limited and snoozing ones
                                        included) that succeeded has the effect of the
                                        attempt that succeeded, and the stored result is
                                        that attempt's (a result returned past the time
                                        limit was refused)
    ``lease_duplicates_bounded``        lease-mode duplicate effects <= the bound below
    ``lease_duplicates_explained``      each duplicate traced to a fault: its attempt started
                                        at most 10 s before a SIGKILL or SIGSTOP of the worker
                                        that wrote it, or before the restart
    ``poison_dead_at_max_attempts``     every poison job is dead with attempts == max_attempts
                                        == 3, plus one per attempt a worker gave back unstarted
                                        (logged ``jobs_released``: ``release`` adds one)
    ``timed_finished``                  every time-limited job succeeded or is dead: none
                                        pending, running (stuck) or cancelled
    ``timed_limits_enforced``           every slow attempt (planned to sleep twice its limit)
                                        that started was logged ``job_timed_out``, wrote no
                                        effect and did not succeed; no quick attempt (a
                                        quarter of its limit at most, or 2 s under a 4 s limit
                                        of the job's own: past the task's 1.5 s) was logged
                                        timed out. An attempt a fault hit is excused (see
                                        *Faults hit attempts* below), and counted apart
    ``timed_dead_explained``            every dead time-limited job is dead at its last
                                        attempt (attempts == max_attempts == 3, +1 per attempt
                                        given back unstarted) for one of these reasons only:
                                        the last attempt ran past its time limit (last_error
                                        ``attempt N ran past its time limit`` or ``attempt N
                                        returned after its time limit``, N the last attempt)
                                        and was a slow one, or a quick one a fault hit; or it
                                        failed otherwise (its lease lost, a database error)
                                        and a fault hit it; or it never wrote its start row
                                        and lost its lease (last_error ``attempt N lost its
                                        lease: ...``: its worker died or stopped before the
                                        handler's first statement)
    ``snoozed_succeeded``               every snoozing job succeeded with snoozes == its planned
                                        snoozes (>= 1; it snoozes while its row holds fewer),
                                        max_attempts == 5 + snoozes (+1 per attempt given back
                                        unstarted) and attempts > snoozes: no snooze spent an
                                        attempt (some snooze as often as 5 attempts allow runs)
    ``deaths_logged``                   every dead job's id is in exactly one worker log line
                                        with action ``job_dead`` or ``attempts_exhausted``,
                                        and no job that is not dead is logged so; a death
                                        the harness cut off (it SIGKILLed the worker that
                                        ran the last attempt, after that attempt started:
                                        the kill may land between the death's commit and
                                        its log line), or the restart cut off (the death
                                        committed as the server went down; the retry after
                                        it found the job dead and logged lease_lost), is
                                        counted apart (a death at the time limit is a
                                        death like any other: ``job_dead``)
    ``workers_survived``                no worker exited but those the harness killed, and none
                                        logged ``thread_crashed``
    ``workers_stopped_cleanly``         every worker exited 0 after the final SIGTERM
    ``steps_after_dependencies``        no attempt of a step started (its start row's
                                        ``clock_timestamp()``, written at the handler's start
                                        in its own transaction) before each of its
                                        dependencies (those added at run time included) had
                                        succeeded: before the later of the dependency's
                                        ``finished_at`` and the effect of its succeeding
                                        attempt (a lock-mode step's ``finished_at`` is its
                                        claim's transaction time; its effect is written just
                                        before it commits). A step whose policy is ``run``
                                        needs them ended, whatever their outcome. So a step
                                        whose dependency failed, policy cancel, never started
    ``workflows_finished``              every workflow enqueued exists, tied to its order, and
                                        is final (not running) with steps_left == 0 and a
                                        finished_at; no step is left waiting, pending or
                                        running
    ``step_lock_effect_exactly_once``   every lock-mode step that succeeded has exactly one
                                        effect, by the attempt that succeeded; every other one
                                        (dead, cancelled) none: a failing lock-mode step's
                                        effect rolls back with each attempt
    ``workflow_counts_agree``           each workflow's steps_total is the number of its steps
                                        (as planned, those added at run time included),
                                        steps_failed the number of dead and cancelled ones,
                                        steps_left of those not ended; its status is failed if
                                        one failed, else succeeded
    ``workflow_outcomes_as_planned``    every step ended as planned: a failing one dead at
                                        attempts == max_attempts == 2 (+1 per attempt given
                                        back unstarted), the steps after a failed one
                                        cancelled (``blocked_by`` a failed step of the
                                        workflow) but those whose policy is ``run``, the rest
                                        succeeded, each with the results of exactly its
                                        dependencies that succeeded (``saw``); each depends
                                        on the steps planned (those added at run time exactly
                                        once: a lease-mode split attempt after one that added
                                        them is refused), no step beyond the plan, and every
                                        workflow's status is as planned

    Lease-mode steps count as lease-mode jobs in ``lease_final_attempt_recorded`` and the
    duplicate checks; dead steps must be logged like dead jobs (``deaths_logged``).

The bound on lease-mode duplicate effects
    A duplicate is an effect row of a lease-mode job beyond the first: an attempt wrote its
    effect but its completion never committed, and another attempt ran the job again. Only
    a fault makes an attempt lose its job that way, and only the attempts *at risk* in one
    worker at the moment of the fault: those whose handler is running (at most
    ``concurrency``: the worker claims only for free slots), and those whose handler has
    returned but whose completion is not committed yet. A slot is free again as soon as
    its handler returns, so while the outcome writer commits one batch, the slots it freed
    may be running new jobs: at most one uncommitted outcome and one running handler per
    slot, so at most ``2 * concurrency`` attempts at risk per worker. Hence::

        duplicates <= 2 * concurrency * (kills + pauses + workers running at the restart)

    (every worker's leases lapse while the server is down). The final SIGTERM adds
    nothing: it comes only once no job is pending or running. ``lease_duplicates_explained``
    is the sharper check: it attributes each duplicate to the fault that caused it, by the
    writing process and the time its attempt was claimed (a lease that ran out with no
    fault, say a heartbeat starved for 1.3 s, would show up there).

    Time-limited and snoozing jobs count here as lease-mode jobs: a timed-out attempt writes
    no effect (its handler looks at ``ctx.cancelled`` first, or its coroutine is cancelled),
    a snoozing attempt writes none, and a handler running past its limit keeps its slot, so
    the bound stands as it is.

Faults hit attempts
    An attempt was *hit by a fault* when it was claimed (database clock, from its start row's
    ``claimed_at``) in a window of one: from 10 s before a SIGKILL (or SIGSTOP) of the
    process that ran it to the kill (or the SIGCONT), or from 10 s before the server went
    down to 2 s after it came back (any process).
    Without a start row, the claim is taken as the limit before the worker's
    ``job_timed_out`` line. Duplicates are attributed so, and so are the exceptions the
    time-limit checks allow: a stopped worker's monotonic clock runs on, so its quick
    attempts are past their limits when it resumes, and a handler may end before the
    worker's time-limit thread looks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from chaos_tasks import (
    EFFECT_LEASE_TASKS,
    LEASE_SECONDS,
    LEASE_TASKS,
    LOCK_TASKS,
    POISON_MAX_ATTEMPTS,
    POISON_TASKS,
    QUEUES,
    SNOOZY_MAX_ATTEMPTS,
    SNOOZY_TASKS,
    STEP_FAIL_MAX_ATTEMPTS,
    STEP_FAILING_TASKS,
    STEP_LEASE_TASKS,
    STEP_LOCK_TASKS,
    STEP_SPLIT_TASKS,
    TIMED_LIMIT,
    TIMED_MAX_ATTEMPTS,
    TIMED_TASKS,
    Base,
    ChaosEffect,
    ChaosJob,
    ChaosJobResult,
    ChaosOrder,
    ChaosWorkflow,
    planned_sleep,
    registry,
)
from drills import spawn_worker
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from sqla_jobs import Workflow, enqueue_workflow
from sqla_jobs.embedded import EmbeddedPostgres

SERVER_URL_VARIABLE = "SQLA_JOBS_TEST_DATABASE_URL"
DEATH_ACTIONS = frozenset({"job_dead", "attempts_exhausted"})
FINISHED = frozenset({"succeeded", "dead", "cancelled"})
#: The job mix: task -> (share of the jobs, shortest and longest sleep in seconds). A timed
#: job's sleeps are planned per attempt instead (:func:`timed_args`).
MIX: dict[str, tuple[float, float, float]] = {
    "leased": (0.30, 0.02, 0.4),
    "async_leased": (0.16, 0.02, 0.4),
    "locked": (0.26, 0.01, 0.2),
    "poison": (0.12, 0.0, 0.3),
    "timed": (0.06, 0.0, 0.0),
    "async_timed": (0.04, 0.0, 0.0),
    "snoozy": (0.06, 0.02, 0.2),
}
#: Lease-mode jobs also work a little after their effect (``after``, up to this many seconds).
AFTER_EFFECT = 0.15
#: A timed job's own time limit, when it has one (else its task's ``TIMED_LIMIT``): tighter
#: than the task's, or looser (then its attempts sleep past the task's limit, within its own).
TIGHT_LIMIT = 0.8
LOOSE_LIMIT = 4.0
#: What a dead timed job's ``last_error`` says when its last attempt ran past its limit
#: (the worker's words at the limit, the handler's ``raise_if_cancelled``, or a result
#: refused after the limit).
TIMED_OUT = re.compile(r"\battempt (\d+) (?:ran past|returned after) its time limit")
CHECKS = (
    "faults_injected",
    "no_job_lost",
    "no_job_stuck",
    "non_poison_succeeded",
    "lock_effect_exactly_once",
    "lease_final_attempt_recorded",
    "lease_duplicates_bounded",
    "lease_duplicates_explained",
    "poison_dead_at_max_attempts",
    "timed_finished",
    "timed_limits_enforced",
    "timed_dead_explained",
    "snoozed_succeeded",
    "deaths_logged",
    "workers_survived",
    "workers_stopped_cleanly",
    "steps_after_dependencies",
    "workflows_finished",
    "step_lock_effect_exactly_once",
    "workflow_counts_agree",
    "workflow_outcomes_as_planned",
)
_SHOWN = 10  # jobs described in detail per failed check
_RESTART_AT = 0.35
_PAUSE_AT = 0.6
_RUN_AT_SPREAD = 0.8
_QUIET_END = 3.0  # no SIGKILL in the last seconds of the fault window


@dataclass
class ChaosConfig:
    """What to run. ``database_url`` names a server (a fresh database is created on it);
    ``None`` starts an embedded one. ``log_dir`` keeps the worker logs there (default: a
    temporary directory, deleted after a run whose checks all pass)."""

    duration: float = 120.0
    workers: int = 3
    concurrency: int = 4
    jobs: int = 1000
    workflows: int = 60
    seed: int | None = None
    database_url: str | None = None
    kill_every: tuple[float, float] = (3.0, 6.0)
    pg_down: float = 3.0
    pause: float = 3 * LEASE_SECONDS
    drain_timeout: float = 120.0
    poll_interval: float = 0.2
    grace: float = 10.0
    log_dir: Path | None = None


@dataclass
class Check:
    name: str
    ok: bool
    summary: str
    details: list[str] = field(default_factory=list)


@dataclass
class ChaosReport:
    seed: int
    config: dict[str, Any]
    server: str
    log_dir: str
    elapsed: float
    drain_seconds: float | None
    jobs_by_task: dict[str, dict[str, int]]
    workflows: dict[str, Any]
    faults: dict[str, Any]
    duplicates: dict[str, Any]
    log_actions: dict[str, int]
    checks: list[Check]
    events: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failed(self) -> list[str]:
        return [check.name for check in self.checks if not check.ok]

    def check(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["failed"] = self.failed
        return data

    def render(self) -> str:
        cfg = self.config
        head = (
            f"sqla_jobs chaos run: seed {self.seed}, {cfg['duration']:g} s of faults, "
            f"{cfg['workers']} workers x concurrency {cfg['concurrency']}, {cfg['jobs']} jobs, "
            f"{cfg['workflows']} workflows"
        )
        lines = [head, f"server: {self.server}"]
        faults = self.faults
        restart = faults["restart"]
        restart_text = (
            f"1 PostgreSQL restart (immediate shutdown, down {restart['down_seconds']:.1f} s, "
            f"{restart['workers_running']} workers running)"
            if restart.get("done")
            else f"PostgreSQL restart skipped: {restart.get('skipped', 'not reached')}"
        )
        pause = faults["pause"]
        pause_text = (
            f"1 SIGSTOP of pid {pause['pid']} for {pause['seconds']:.1f} s"
            if pause.get("done")
            else "no SIGSTOP (not reached)"
        )
        lines.append(
            f"faults: {faults['kills']} SIGKILLs (each replaced), {restart_text}, {pause_text}"
        )
        drain = "not reached" if self.drain_seconds is None else f"{self.drain_seconds:.1f} s"
        lines.append(f"drain after the faults: {drain}; whole run {self.elapsed:.1f} s")
        lines.append("jobs:")
        for task, statuses in self.jobs_by_task.items():
            counts = ", ".join(f"{status} {count}" for status, count in sorted(statuses.items()))
            lines.append(f"  {task:<13} {sum(statuses.values()):>5}  ({counts})")
        flows = self.workflows
        lines.append(
            f"workflows: {flows['total']} ({flows['steps']} steps, {flows['added']} of them added "
            f"at run time; {flows['found']} split attempts found their steps added by an "
            "earlier one)"
        )
        for shape, statuses in flows["by_shape"].items():
            counts = ", ".join(f"{status} {count}" for status, count in sorted(statuses.items()))
            lines.append(f"  {shape:<19} {sum(statuses.values()):>5}  ({counts})")
        lines.append("steps:")
        for task, statuses in flows["steps_by_task"].items():
            counts = ", ".join(f"{status} {count}" for status, count in sorted(statuses.items()))
            lines.append(f"  {task:<19} {sum(statuses.values()):>5}  ({counts})")
        dup = self.duplicates
        by_cause = ", ".join(f"{cause} {count}" for cause, count in dup["by_cause"].items())
        lines.append(
            f"lease-mode duplicate effects: {dup['total']} of {dup['lease_jobs']} lease-mode "
            f"jobs (bound {dup['bound']} = {dup['bound_formula']}); by cause: {by_cause}"
        )
        actions = ", ".join(f"{a} {n}" for a, n in sorted(self.log_actions.items()))
        lines.append(f"worker log actions (INFO and up): {actions or 'none'}")
        lines.append("checks:")
        for check in self.checks:
            lines.append(f"  {'PASS' if check.ok else 'FAIL'}  {check.name:<30} {check.summary}")
            lines.extend(f"        {detail}" for detail in check.details)
        verdict = "PASS" if self.ok else f"FAIL ({', '.join(self.failed)})"
        lines.append(f"result: {verdict}")
        lines.append(f"worker logs: {self.log_dir}")
        return "\n".join(lines)


# -- worker processes -----------------------------------------------------------------------


@dataclass(eq=False)
class WorkerProc:
    label: str
    popen: subprocess.Popen[bytes]
    log: Path
    fate: str = "running"  # running, killed, exited, stopped
    paused: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, signum: int) -> None:
        if self.alive():
            os.kill(self.pid, signum)

    def ready(self) -> bool:
        """Whether it logged ``worker_started`` (its signal handlers are in place)."""
        try:
            return '"worker_started"' in self.log.read_text(errors="replace")
        except OSError:
            return False

    def log_tail(self, lines: int = 5) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]


class Pool:
    """The worker processes of a run, started, killed and replaced by the harness."""

    def __init__(self, url: str, directory: Path, config: ChaosConfig) -> None:
        self.url = url
        self.directory = directory
        self.config = config
        self.procs: list[WorkerProc] = []

    def start(self) -> WorkerProc:
        label = f"worker-{len(self.procs):02d}"
        popen, log = spawn_worker(
            self.directory,
            label,
            self.url,
            "chaos_tasks:registry",
            "--queues",
            ",".join(QUEUES),
            "--concurrency",
            str(self.config.concurrency),
            "--poll-interval",
            f"{self.config.poll_interval:g}s",
            "--grace",
            f"{self.config.grace:g}s",
            "--name",  # recorded as leased_by on the jobs it claims
            label,
            log_level="INFO",
        )
        proc = WorkerProc(label, popen, log)
        self.procs.append(proc)
        return proc

    def running(self) -> list[WorkerProc]:
        return [p for p in self.procs if p.fate == "running"]

    def close(self) -> None:
        """Whatever is left (after an error): continued and killed."""
        for proc in self.procs:
            if proc.alive():
                proc.send(signal.SIGCONT)
                proc.send(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)


# -- the database ---------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRow:
    id: int
    task: str
    status: str
    attempts: int
    max_attempts: int
    last_error: str | None
    args: dict[str, Any]
    time_limit: timedelta | None
    snoozes: int


@dataclass(frozen=True)
class EffectRow:
    job_id: int
    attempt: int
    kind: str
    pid: int
    at: datetime
    claimed_at: datetime


def server_url_from_environment() -> str | None:
    raw = os.environ.get(SERVER_URL_VARIABLE, "").strip()
    return raw or None


def _psycopg(url: str) -> URL:
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"not a PostgreSQL URL: {url!r}")
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def timed_args(rng: random.Random) -> tuple[dict[str, Any], float | None]:
    """A timed job's args and its own time limit (None: its task's).

    Its limit: the task's (60 %), a tighter one of its own (20 %) or a looser one (20 %).
    Under the looser one every attempt sleeps about 2 s: past the task's limit, well
    within its own. Under the others, a quick attempt sleeps at most a quarter of the limit,
    a slow one twice it; the job's first attempt is slow (40 %), every one (20 %) or none.
    """
    own = rng.choices([None, TIGHT_LIMIT, LOOSE_LIMIT], [0.6, 0.2, 0.2])[0]
    watch = rng.random() < 0.5
    if own == LOOSE_LIMIT:
        return {"sleeps": [round(rng.uniform(1.8, 2.2), 3)], "watch": watch}, own
    limit = own or TIMED_LIMIT
    quick = round(rng.uniform(0.02, limit / 4), 3)
    slow = round(2 * limit, 3)
    sleeps = rng.choices([[quick], [slow, quick], [slow]], [0.4, 0.4, 0.2])[0]
    return {"sleeps": sleeps, "watch": watch}, own


def snoozy_args(rng: random.Random) -> dict[str, Any]:
    """A snoozing job's args: one to eight snoozes of 0.1 to 0.5 s, raised or returned."""
    return {
        "snoozes": rng.randint(1, 8),
        "delay": round(rng.uniform(0.1, 0.5), 3),
        "how": rng.choice(["raise", "return"]),
    }


def enqueue(engine: sa.Engine, count: int, rng: random.Random, spread: float) -> dict[int, str]:
    """``count`` jobs of the mix, runnable from now to ``spread`` seconds from now."""
    tasks = list(MIX)
    weights = [MIX[task][0] for task in tasks]
    now = datetime.now(timezone.utc)
    rows = []
    for _ in range(count):
        task = rng.choices(tasks, weights)[0]
        _, shortest, longest = MIX[task]
        args: dict[str, Any] = {"sleep": round(rng.uniform(shortest, longest), 3)}
        columns: dict[str, Any] = {}
        if task in TIMED_TASKS:
            args, own = timed_args(rng)
            if own is not None:
                columns["time_limit"] = timedelta(seconds=own)
        if task in SNOOZY_TASKS:
            args.update(snoozy_args(rng))
        if task in LEASE_TASKS or task in SNOOZY_TASKS:
            args["after"] = round(rng.uniform(0.0, AFTER_EFFECT), 3)
        run_at = now + timedelta(seconds=rng.uniform(0.0, spread))
        rows.append(registry[task].job(args, run_at=run_at, **columns))
    with Session(engine) as session, session.begin():
        session.add_all(rows)
        session.flush()
        return {row.id: row.task for row in rows}


# -- workflows ------------------------------------------------------------------------------

#: The shapes of the workflows, enqueued in turn: ``diamond`` (a -> b, c -> d), ``fan`` (a ->
#: a group of 4 to 8 -> a fan-in), ``chain`` (3 to 6 in a row), ``expand`` (a split step adds
#: 2 to 6 steps at run time, which the merge step after it waits for too: ``then=``).
SHAPES = ("diamond", "fan", "chain", "expand")
#: One workflow of each shape in this many has a failing step: the second of each shape, the
#: fifth, the eighth...
FAILING_EVERY = 3
#: A workflow without a failing step gets a ``finally`` step (policy ``run``) this often;
#: every one with a failing step gets one.
FINALLY_SHARE = 0.25


@dataclass(frozen=True)
class StepPlan:
    """A planned step: its task and args, the steps it is written after, its policy; and
    for a step that a split step adds at run time, that step (``added_by``) and the steps
    that wait for it too (``then``)."""

    name: str
    task: str
    args: dict[str, Any]
    after: tuple[str, ...] = ()
    policy: str = "cancel"
    added_by: str | None = None
    then: tuple[str, ...] = ()


@dataclass
class WorkflowPlan:
    """A workflow as planned (its steps in an order where each comes after those it waits
    for), and as written: its id, its order's id, the ids of the steps written with it."""

    index: int
    shape: str
    failing: bool
    steps: dict[str, StepPlan]
    id: int = 0
    order_id: int = 0
    step_ids: dict[str, int] = field(default_factory=dict)

    def dependencies(self, name: str) -> tuple[str, ...]:
        """What step ``name`` waits for: the steps it was written after, and the steps added
        at run time that name it in ``then``."""
        step = self.steps[name]
        added = tuple(p.name for p in self.steps.values() if name in p.then)
        return (step.added_by,) if step.added_by else step.after + added

    def outcomes(self) -> dict[str, str]:
        """Each step's final status as the rules say: a failing step ends dead; a step one
        of whose dependencies ended dead or cancelled ends cancelled, unless its policy is
        ``run``; every other step succeeds."""
        ends: dict[str, str] = {}
        for name, step in self.steps.items():
            failed = any(ends[d] != "succeeded" for d in self.dependencies(name))
            if failed and step.policy == "cancel":
                ends[name] = "cancelled"
            elif step.task in STEP_FAILING_TASKS:
                ends[name] = "dead"
            else:
                ends[name] = "succeeded"
        return ends

    def status(self) -> str:
        ok = all(end == "succeeded" for end in self.outcomes().values())
        return "succeeded" if ok else "failed"


def _step(
    rng: random.Random,
    name: str,
    task: str | None = None,
    *,
    after: str | Sequence[str] = (),
    policy: str = "cancel",
    added_by: str | None = None,
    then: tuple[str, ...] = (),
) -> StepPlan:
    """A step of a lease-mode or lock-mode task (``task``: this one) with a random sleep."""
    task = task or rng.choice(("step_leased", "step_locked"))
    # A lease-mode split step works on a while after adding its steps: a window for a fault
    # (a targeted kill) that leaves them to its next attempt.
    low, high = (0.5, 1.5) if task == "step_split" else (0.02, 0.3)
    args: dict[str, Any] = {"sleep": round(rng.uniform(low, high), 3)}
    if task in STEP_LEASE_TASKS:
        args["after"] = round(rng.uniform(0.0, AFTER_EFFECT), 3)
    names = (after,) if isinstance(after, str) else tuple(after)
    return StepPlan(name, task, args, names, policy, added_by, then)


def plan_workflow(rng: random.Random, index: int) -> WorkflowPlan:
    """Workflow ``index``: its shape in turn (:data:`SHAPES`); a failing step (a third of
    them: a step that others wait for, lease or lock mode, ``max_attempts=2``), whose
    dependents end cancelled; a ``finally`` step (policy ``run``) after the last step (in
    every workflow with a failing step, in some others); and, in some failing ones, a last
    step whose policy is ``run`` too."""
    shape = SHAPES[index % len(SHAPES)]
    failing = (index // len(SHAPES)) % FAILING_EVERY == 1
    steps: list[StepPlan] = []
    if shape == "diamond":
        steps += [_step(rng, "a"), _step(rng, "b", after="a"), _step(rng, "c", after="a")]
        steps.append(_step(rng, "d", after=["b", "c"]))
    elif shape == "fan":
        steps.append(_step(rng, "a"))
        group = [f"g-{i}" for i in range(rng.randint(4, 8))]
        steps += [_step(rng, name, after="a") for name in group]
        steps.append(_step(rng, "join", after=group))
    elif shape == "chain":
        steps.append(_step(rng, "c-0"))
        for i in range(1, rng.randint(3, 6)):
            steps.append(_step(rng, f"c-{i}", after=f"c-{i - 1}"))
    else:
        split = _step(rng, "split", rng.choice(STEP_SPLIT_TASKS))
        parts = [
            _step(rng, f"part-{i}", added_by="split", then=("merge",))
            for i in range(rng.randint(2, 6))
        ]
        plan = [[p.name, p.task, p.args] for p in parts]
        split = StepPlan(split.name, split.task, {**split.args, "parts": plan, "then": "merge"})
        steps += [split, *parts, _step(rng, "merge", after="split")]
    if failing:
        # One that others wait for (a part, in an expand: a split must add its parts).
        waited = {d for step in steps for d in step.after}
        candidates = [
            i
            for i, step in enumerate(steps)
            if (step.name in waited or step.then) and step.task not in STEP_SPLIT_TASKS
        ]
        victim = rng.choice(candidates)
        old = steps[victim]
        task = rng.choice(STEP_FAILING_TASKS)
        after, by, then = old.after, old.added_by, old.then
        steps[victim] = _step(rng, old.name, task, after=after, added_by=by, then=then)
        if by is not None:
            split = steps[0]
            plan = [[p.name, p.task, p.args] for p in steps if p.added_by]
            steps[0] = StepPlan(split.name, split.task, {**split.args, "parts": plan})
        if rng.random() < 0.3:  # the last step runs anyway
            last = steps[-1]
            steps[-1] = StepPlan(last.name, last.task, last.args, last.after, "run")
    if failing or rng.random() < FINALLY_SHARE:
        steps.append(_step(rng, "finally", after=steps[-1].name, policy="run"))
    return WorkflowPlan(index, shape, failing, {step.name: step for step in steps})


def enqueue_workflows(
    engine: sa.Engine, count: int, rng: random.Random, spread: float
) -> list[WorkflowPlan]:
    """``count`` workflows (:func:`plan_workflow`), each written with its order in a
    business transaction of its own; each one's first step runnable from now to ``spread``
    seconds from now (the steps after it as soon as their dependencies end)."""
    now = datetime.now(timezone.utc)
    plans = []
    for index in range(count):
        plan = plan_workflow(rng, index)
        run_at = now + timedelta(seconds=rng.uniform(0.0, spread))
        flow = Workflow(f"{plan.shape} {index}")
        for step in plan.steps.values():
            if step.added_by is None:
                job = registry[step.task].job(step.args, run_at=None if step.after else run_at)
                flow.add(step.name, job, after=step.after, if_dependency_fails=step.policy)
        with Session(engine) as session, session.begin():
            order = ChaosOrder(shape=plan.shape)
            session.add(order)
            session.flush()
            written = enqueue_workflow(session, flow, workflow=ChaosWorkflow(order_id=order.id))
            plan.id, plan.order_id, plan.step_ids = written.id, order.id, written.steps
        plans.append(plan)
    return plans


@dataclass(frozen=True)
class StepRow:
    id: int
    workflow_id: int
    step: str
    task: str
    status: str
    attempts: int
    max_attempts: int
    depends_on: tuple[int, ...]
    policy: str
    blocked_by: int | None
    finished_at: datetime | None


@dataclass(frozen=True)
class WorkflowRow:
    id: int
    order_id: int | None
    status: str
    steps_total: int
    steps_left: int
    steps_failed: int
    finished_at: datetime | None


def read_workflows(
    engine: sa.Engine,
) -> tuple[dict[int, StepRow], dict[int, WorkflowRow], dict[int, str]]:
    """The steps, the workflows, and the orders (id -> shape), as the run left them."""
    with engine.connect() as connection:
        steps = {
            row.id: StepRow(
                row.id,
                row.workflow_id,
                row.step,
                row.task,
                row.status,
                row.attempts,
                row.max_attempts,
                tuple(row.depends_on or ()),
                row.if_dependency_fails or "cancel",
                row.blocked_by,
                row.finished_at,
            )
            for row in connection.execute(
                sa.select(
                    ChaosJob.id,
                    ChaosJob.workflow_id,
                    ChaosJob.step,
                    ChaosJob.task,
                    ChaosJob.status,
                    ChaosJob.attempts,
                    ChaosJob.max_attempts,
                    ChaosJob.depends_on,
                    ChaosJob.if_dependency_fails,
                    ChaosJob.blocked_by,
                    ChaosJob.finished_at,
                ).where(ChaosJob.workflow_id.is_not(None))
            )
        }
        workflows = {
            row.id: WorkflowRow(
                row.id,
                row.order_id,
                row.status,
                row.steps_total,
                row.steps_left,
                row.steps_failed,
                row.finished_at,
            )
            for row in connection.execute(
                sa.select(
                    ChaosWorkflow.id,
                    ChaosWorkflow.order_id,
                    ChaosWorkflow.status,
                    ChaosWorkflow.steps_total,
                    ChaosWorkflow.steps_left,
                    ChaosWorkflow.steps_failed,
                    ChaosWorkflow.finished_at,
                )
            )
        }
        orders = {
            row.id: row.shape
            for row in connection.execute(sa.select(ChaosOrder.id, ChaosOrder.shape))
        }
    return steps, workflows, orders


def status_counts(engine: sa.Engine) -> dict[str, int] | None:
    """Jobs by status, or None while the server does not answer."""
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                sa.select(ChaosJob.status, sa.func.count()).group_by(ChaosJob.status)
            ).all()
    except sa.exc.DBAPIError:
        return None
    return {status: int(count) for status, count in rows}


def read_back(
    engine: sa.Engine,
) -> tuple[dict[int, JobRow], list[EffectRow], dict[int, Any]]:
    with engine.connect() as connection:
        jobs = {
            row.id: JobRow(
                row.id,
                row.task,
                row.status,
                row.attempts,
                row.max_attempts,
                row.last_error,
                row.args,
                row.time_limit,
                row.snoozes,
            )
            for row in connection.execute(
                sa.select(
                    ChaosJob.id,
                    ChaosJob.task,
                    ChaosJob.status,
                    ChaosJob.attempts,
                    ChaosJob.max_attempts,
                    ChaosJob.last_error,
                    ChaosJob.args,
                    ChaosJob.time_limit,
                    ChaosJob.snoozes,
                )
            )
        }
        effects = [
            EffectRow(
                row.job_id,
                row.attempt,
                row.kind,
                row.pid,
                row.at.astimezone(timezone.utc),
                row.claimed_at.astimezone(timezone.utc),
            )
            for row in connection.execute(
                sa.select(
                    ChaosEffect.job_id,
                    ChaosEffect.attempt,
                    ChaosEffect.kind,
                    ChaosEffect.pid,
                    ChaosEffect.at,
                    ChaosEffect.claimed_at,
                ).order_by(ChaosEffect.id)
            )
        ]
        results = {
            row.job_id: row.value
            for row in connection.execute(sa.select(ChaosJobResult.job_id, ChaosJobResult.value))
        }
    return jobs, effects, results


# -- worker logs ----------------------------------------------------------------------------


@dataclass
class Logs:
    actions: Counter[str] = field(default_factory=Counter)
    deaths: Counter[int] = field(default_factory=Counter)
    # Attempts given back unstarted (action jobs_released), per job: each raised the job's
    # max_attempts by one (statements.release), so that it loses no attempt it did not run.
    released: Counter[int] = field(default_factory=Counter)
    by_job: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    crashes: list[str] = field(default_factory=list)
    not_json: list[str] = field(default_factory=list)
    # When each (job, attempt)'s own outcome came back fenced out (action lease_lost).
    fenced: dict[tuple[int, int], list[datetime]] = field(default_factory=lambda: defaultdict(list))
    # Attempts a worker logged as past their time limits (action job_timed_out): the pid of
    # that worker and when, per (job, attempt).
    timed_out: dict[tuple[int, int], tuple[int, datetime]] = field(default_factory=dict)
    snoozed: Counter[int] = field(default_factory=Counter)  # action job_snoozed, per job


def read_logs(procs: Sequence[WorkerProc]) -> Logs:
    logs = Logs()
    for proc in procs:
        try:
            text = proc.log.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                logs.not_json.append(f"{proc.label} (pid {proc.pid}): {line[:200]}")
                continue
            if not isinstance(entry, dict):
                logs.not_json.append(f"{proc.label} (pid {proc.pid}): {line[:200]}")
                continue
            action = str(entry.get("action", "-"))
            logs.actions[action] += 1
            job_id = entry.get("job_id")
            # The time first (ISO, UTC): a job's lines from several logs sort into order.
            shown = (
                f"{str(entry.get('time', ''))[11:23]} {proc.label} (pid {proc.pid}) "
                f"{entry.get('level', '')} {action}: {str(entry.get('message', ''))[:220]}"
            )
            if isinstance(job_id, int):
                logs.by_job[job_id].append(shown)
                if action in DEATH_ACTIONS:
                    logs.deaths[job_id] += 1
            for listed in entry.get("job_ids") or []:
                if isinstance(listed, int):
                    logs.by_job[listed].append(shown)
                    if action == "jobs_released":
                        logs.released[listed] += 1
            if action == "thread_crashed":
                logs.crashes.append(shown)
            attempt, at = entry.get("attempt"), entry.get("time")
            if isinstance(job_id, int) and isinstance(attempt, int) and isinstance(at, str):
                if action == "lease_lost":
                    logs.fenced[(job_id, attempt)].append(datetime.fromisoformat(at))
                elif action == "job_timed_out":
                    logs.timed_out[(job_id, attempt)] = (proc.pid, datetime.fromisoformat(at))
            if action == "job_snoozed" and isinstance(job_id, int):
                logs.snoozed[job_id] += 1
    return logs


# -- the run --------------------------------------------------------------------------------


class _Clock:
    def __init__(self, progress: Callable[[str], None] | None) -> None:
        self.started = time.monotonic()
        self.progress = progress
        self.events: list[dict[str, Any]] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(f"[{self.elapsed():6.1f}s] {text}")

    def event(self, kind: str, text: str, **data: Any) -> None:
        self.events.append(
            {
                "t": round(self.elapsed(), 3),
                "wall": datetime.now(timezone.utc).isoformat(),
                "kind": kind,
                "text": text,
                **data,
            }
        )
        self.say(text)


@contextlib.contextmanager
def _database(
    config: ChaosConfig, clock: _Clock
) -> Iterator[tuple[str, str, EmbeddedPostgres | None]]:
    """A fresh database: (its URL, a description of the server, the embedded server)."""
    server = config.database_url or server_url_from_environment()
    if server is None:
        pg = EmbeddedPostgres()
        pg.start()
        try:
            pg.create_database("sqla_jobs_chaos")
            clock.say(f"embedded PostgreSQL {pg.version} on port {pg.port}")
            yield pg.url("sqla_jobs_chaos"), f"embedded PostgreSQL {pg.version}", pg
        finally:
            pg.stop()
        return
    admin_url = _psycopg(server)
    name = f"sqla_jobs_chaos_{secrets.token_hex(6)}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as connection:
            connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
        shown = admin_url.set(database=name).render_as_string(hide_password=True)
        clock.say(f"external server: database {shown}")
        try:
            yield (
                admin_url.set(database=name).render_as_string(hide_password=False),
                f"external server, database {shown}",
                None,
            )
        finally:
            with admin.connect() as connection:
                connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def run_chaos(config: ChaosConfig, progress: Callable[[str], None] | None = None) -> ChaosReport:
    """Run the harness once; ``progress`` receives a line per event as it happens."""
    seed = config.seed if config.seed is not None else secrets.randbelow(2**31)
    rng = random.Random(seed)
    clock = _Clock(progress)
    clock.say(f"seed {seed}")
    own_dir = config.log_dir is None
    log_dir = (
        Path(tempfile.mkdtemp(prefix="sqla_jobs_chaos_"))
        if config.log_dir is None
        else config.log_dir
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    with _database(config, clock) as (url, server, pg):
        engine = sa.create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 5})
        pool = Pool(url, log_dir, config)
        try:
            Base.metadata.create_all(engine)
            enqueued = enqueue(engine, config.jobs, rng, _RUN_AT_SPREAD * config.duration)
            clock.say(f"enqueued {len(enqueued)} jobs: {dict(Counter(enqueued.values()))}")
            plans = enqueue_workflows(
                engine, config.workflows, rng, _RUN_AT_SPREAD * config.duration
            )
            steps = sum(len(plan.steps) for plan in plans)
            shapes = dict(Counter(plan.shape for plan in plans))
            clock.say(f"enqueued {len(plans)} workflows of {steps} steps (as planned): {shapes}")
            state = _inject(config, rng, clock, pool, engine, pg)
            drain_seconds = _drain(config, clock, pool, engine, state)
            stopped = _stop(config, clock, pool)
            jobs, effects, results = read_back(engine)
            flows = read_workflows(engine)
        finally:
            pool.close()
            engine.dispose()
    logs = read_logs(pool.procs)
    accounting = _Accounting(
        config,
        enqueued,
        jobs,
        effects,
        results,
        logs,
        pool,
        state,
        drain_seconds,
        stopped,
        plans,
        *flows,
    )
    report = accounting.report(seed, server, log_dir, clock)
    if own_dir and report.ok:
        shutil.rmtree(log_dir, ignore_errors=True)
        report.log_dir = f"{log_dir} (deleted: every check passed)"
    return report


#: How long before a fault an attempt may have been claimed and still be at risk from it: far
#: more than a handler runs (under 0.6 s) plus the wait for a handler thread.
_AT_RISK_BEFORE = timedelta(seconds=10)


@dataclass(frozen=True)
class _Window:
    """Attempts claimed in ``[start, end]`` (by worker ``pid``; any when None) were at risk
    from a fault of this ``cause``."""

    cause: str
    pid: int | None
    start: datetime
    end: datetime


@dataclass
class _FaultState:
    kills: list[dict[str, Any]] = field(default_factory=list)
    restart: dict[str, Any] = field(default_factory=dict)
    pause: dict[str, Any] = field(default_factory=dict)
    unexpected_exits: list[str] = field(default_factory=list)
    windows: list[_Window] = field(default_factory=list)

    def at_risk(self, cause: str, pid: int | None, start: datetime, end: datetime) -> None:
        self.windows.append(_Window(cause, pid, start - _AT_RISK_BEFORE, end))


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _server_now(engine: sa.Engine) -> datetime:
    """The server's clock, which stamps the effect rows (an external server may be another
    host); this host's clock if it does not answer."""
    try:
        with engine.connect() as connection:
            now: datetime = connection.execute(sa.select(sa.func.clock_timestamp())).scalar_one()
    except sa.exc.DBAPIError:
        return _utcnow()
    return now.astimezone(timezone.utc)


def _watch(pool: Pool, clock: _Clock, state: _FaultState) -> None:
    """Notice workers that exited on their own: a failure; replace them."""
    for proc in pool.running():
        code = proc.popen.poll()
        if code is not None:
            proc.fate = "exited"
            tail = " | ".join(proc.log_tail(3))
            state.unexpected_exits.append(
                f"{proc.label} (pid {proc.pid}) exited on its own with status {code}: {tail}"
            )
            new = pool.start()
            clock.event(
                "unexpected_exit",
                f"{proc.label} pid {proc.pid} exited with {code}; started {new.label} "
                f"pid {new.pid}",
                pid=proc.pid,
                code=code,
            )


#: What a targeted fault aims at: a worker running a poison job's (or a failing step's) last
#: attempt, or one running a lease-mode split step that has added its steps.
LAST_ATTEMPT = "last_attempt"
ADDED_STEPS = "added_steps"


def _holders(engine: sa.Engine, target: str) -> dict[str, tuple[int, str]]:
    """Worker name -> a job it runs that ``target`` aims at, and its task (empty while the
    server is down).

    ``LAST_ATTEMPT``: a poison job or a failing step on its last attempt; killing or pausing
    its worker leaves the job to be made dead by a claim (and a step's dependents cancelled
    in that claim's transaction). ``ADDED_STEPS``: a lease-mode split step whose added steps
    are committed (they are among its dependents); killing its worker leaves them to the
    step's next attempt, whose own add is refused."""
    if target == LAST_ATTEMPT:
        where = [
            ChaosJob.task.in_(POISON_TASKS + STEP_FAILING_TASKS),
            ChaosJob.attempts >= ChaosJob.max_attempts,
        ]
    else:
        lease_splits = [t for t in STEP_SPLIT_TASKS if t in STEP_LEASE_TASKS]
        where = [ChaosJob.task.in_(lease_splits), sa.func.cardinality(ChaosJob.dependents) > 1]
    query = sa.select(ChaosJob.leased_by, ChaosJob.id, ChaosJob.task).where(
        ChaosJob.status == "running", *where
    )
    try:
        with engine.connect() as connection:
            return {
                str(name): (int(job_id), str(task))
                for name, job_id, task in connection.execute(query)
            }
    except sa.exc.DBAPIError:
        return {}


def _choose(
    rng: random.Random,
    engine: sa.Engine,
    candidates: Sequence[WorkerProc],
    target: str | None,
    patience: float = 1.5,
) -> tuple[WorkerProc, str]:
    """A random candidate; with a ``target``, preferably one that runs a job it aims at
    (:func:`_holders`), waiting up to ``patience`` s for one. Also says why it was chosen."""
    deadline = time.monotonic() + patience
    while target is not None:
        holders = _holders(engine, target)
        hits = [p for p in candidates if p.label in holders]
        if hits:
            proc = rng.choice(hits)
            job_id, task = holders[proc.label]
            what = "on its last attempt" if target == LAST_ATTEMPT else "after adding its steps"
            return proc, f"it runs job {job_id} ({task}) {what}"
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return rng.choice(candidates), "at random"


def _progress_line(engine: sa.Engine) -> str:
    counts = status_counts(engine)
    if counts is None:
        return "jobs: (server not answering)"
    return "jobs: " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items()))


def _inject(
    config: ChaosConfig,
    rng: random.Random,
    clock: _Clock,
    pool: Pool,
    engine: sa.Engine,
    pg: EmbeddedPostgres | None,
) -> _FaultState:
    state = _FaultState()
    for _ in range(config.workers):
        proc = pool.start()
        clock.event("start", f"started {proc.label} pid {proc.pid}", pid=proc.pid)
    start = time.monotonic()
    end = start + config.duration
    next_kill = start + rng.uniform(*config.kill_every)
    restart_at: float | None = start + _RESTART_AT * config.duration
    if pg is None:
        restart_at = None
        state.restart = {
            "done": False,
            "skipped": f"the server named by {SERVER_URL_VARIABLE} / --database-url is "
            "external and cannot be restarted from here",
        }
        clock.event("restart_skipped", f"PostgreSQL restart skipped: {state.restart['skipped']}")
    pause_at: float | None = start + _PAUSE_AT * config.duration
    pause_until = 0.0
    paused_at = _utcnow()
    paused: WorkerProc | None = None
    next_report = start + 5.0
    while True:
        now = time.monotonic()
        if now >= end and paused is None:
            break
        _watch(pool, clock, state)
        if restart_at is not None and now >= restart_at and pg is not None:
            restart_at = None
            workers = len([p for p in pool.running() if not p.paused])
            clock.event("pg_down", f"PostgreSQL: immediate shutdown ({workers} workers running)")
            down_wall = _utcnow()  # the embedded server runs on this host, on its clock
            down = time.monotonic()
            pg.kill()
            time.sleep(config.pg_down)
            pg.start()
            up_wall = _utcnow()
            state.restart = {
                "done": True,
                "down_seconds": time.monotonic() - down,
                "down_at": down_wall.isoformat(),
                "up_at": up_wall.isoformat(),
                "workers_running": workers,
            }
            # Every worker's leases lapsed while the server was down; an attempt that started
            # just after it came back was claimed before (a little slack for that).
            state.at_risk("restart", None, down_wall, up_wall + timedelta(seconds=2))
            clock.event("pg_up", "PostgreSQL: started again (crash recovery)")
            next_kill = max(next_kill, time.monotonic() + rng.uniform(*config.kill_every) / 2)
            continue
        if pause_at is not None and now >= pause_at:
            candidates = [p for p in pool.running() if p.alive() and p.ready()]
            if candidates:
                pause_at = None
                paused, why = _choose(rng, engine, candidates, LAST_ATTEMPT)
                paused.send(signal.SIGSTOP)
                paused.paused = True
                paused_at = _server_now(engine)
                pause_until = time.monotonic() + config.pause
                state.pause = {
                    "done": True,
                    "pid": paused.pid,
                    "label": paused.label,
                    "seconds": config.pause,
                }
                clock.event(
                    "sigstop",
                    f"SIGSTOP {paused.label} pid {paused.pid} for {config.pause:g} s ({why})",
                    pid=paused.pid,
                )
        if paused is not None and now >= pause_until:
            paused.send(signal.SIGCONT)
            paused.paused = False
            state.at_risk("pause", paused.pid, paused_at, _server_now(engine))
            clock.event("sigcont", f"SIGCONT {paused.label} pid {paused.pid}", pid=paused.pid)
            paused = None
        if now >= next_kill and now < end - _QUIET_END:
            # Not the paused worker (it is to come back and find its jobs taken over), nor
            # workers still starting (they would die before doing anything).
            candidates = [
                p for p in pool.running() if p.pid != state.pause.get("pid") and p.ready()
            ]
            if candidates:
                # Every other kill aims at a poison job's (or failing step's) last attempt;
                # the others at a lease-mode split step that added its steps, if one shows up.
                target = ADDED_STEPS if len(state.kills) % 2 else LAST_ATTEMPT
                victim, why = _choose(rng, engine, candidates, target)
                victim.send(signal.SIGKILL)
                killed_at = _server_now(engine)
                state.at_risk("kill", victim.pid, killed_at, killed_at)
                code = victim.popen.wait(10)
                victim.fate = "killed"
                new = pool.start()
                state.kills.append(
                    {"pid": victim.pid, "label": victim.label, "code": code, "why": why}
                )
                clock.event(
                    "sigkill",
                    f"SIGKILL {victim.label} pid {victim.pid} ({why}); started {new.label} "
                    f"pid {new.pid}",
                    pid=victim.pid,
                )
            next_kill = time.monotonic() + rng.uniform(*config.kill_every)
        if now >= next_report:
            next_report = now + 5.0
            clock.say(_progress_line(engine))
        time.sleep(0.05)
    clock.event("faults_over", "no more faults")
    return state


def _drain(
    config: ChaosConfig, clock: _Clock, pool: Pool, engine: sa.Engine, state: _FaultState
) -> float | None:
    """Wait until no job is pending or running; the time it took, or None at the deadline."""
    started = time.monotonic()
    deadline = started + config.drain_timeout
    next_report = started + 5.0
    while True:
        _watch(pool, clock, state)
        counts = status_counts(engine)
        if counts is not None and not counts.get("pending") and not counts.get("running"):
            took = time.monotonic() - started
            clock.say(f"drained in {took:.1f} s: {_progress_line(engine)}")
            return took
        now = time.monotonic()
        if now > deadline:
            clock.event("drain_timeout", f"not drained after {config.drain_timeout:g} s")
            return None
        if now >= next_report:
            next_report = now + 5.0
            clock.say(_progress_line(engine))
        time.sleep(0.2)


def _stop(config: ChaosConfig, clock: _Clock, pool: Pool) -> dict[str, int | None]:
    """SIGTERM every running worker; their exit statuses (None: did not exit in time).

    A worker that was started a moment ago is first given time to start (a SIGTERM before
    its handlers are in place would end it like any process, status -15).
    """
    running = pool.running()
    deadline = time.monotonic() + 30.0
    while not all(p.ready() or not p.alive() for p in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in running:
        proc.send(signal.SIGCONT)
        proc.send(signal.SIGTERM)
    codes: dict[str, int | None] = {}
    deadline = time.monotonic() + config.grace + 20.0
    for proc in running:
        try:
            codes[proc.label] = proc.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[proc.label] = None
        proc.fate = "stopped"
    clock.event("stopped", f"SIGTERM to {len(running)} workers: exit statuses {codes}")
    return codes


# -- the accounting -------------------------------------------------------------------------


@dataclass
class _Duplicates:
    """Lease-mode effect rows beyond the one of the attempt that succeeded."""

    rows: list[EffectRow]
    by_cause: dict[str, int]
    unexplained: list[EffectRow]
    bound: int
    formula: str


@dataclass
class _Accounting:
    """What a run left behind, and the checks on it (one method per check, same name)."""

    config: ChaosConfig
    enqueued: dict[int, str]
    jobs: dict[int, JobRow]
    effects: list[EffectRow]
    results: dict[int, Any]
    logs: Logs
    pool: Pool
    state: _FaultState
    drain_seconds: float | None
    stopped: dict[str, int | None]
    plans: list[WorkflowPlan]
    steps: dict[int, StepRow]
    workflows: dict[int, WorkflowRow]
    orders: dict[int, str]
    effect_rows: dict[int, list[EffectRow]] = field(init=False)
    starts: dict[tuple[int, int], EffectRow] = field(init=False)
    step_starts: dict[int, list[EffectRow]] = field(init=False)
    named: dict[tuple[int, str], StepRow] = field(init=False)

    def __post_init__(self) -> None:
        self.effect_rows = defaultdict(list)
        self.starts = {}
        self.step_starts = defaultdict(list)
        for row in self.effects:
            if row.kind == "effect":
                self.effect_rows[row.job_id].append(row)
            else:
                self.starts.setdefault((row.job_id, row.attempt), row)
                if row.job_id in self.steps:
                    self.step_starts[row.job_id].append(row)
        self.named = {(s.workflow_id, s.step): s for s in self.steps.values()}

    def checks(self) -> list[Check]:
        checks: list[Check] = [getattr(self, name)() for name in CHECKS]
        return checks

    def ids(self, tasks: Sequence[str]) -> list[int]:
        return sorted(i for i, task in self.enqueued.items() if task in tasks)

    def step_ids(self, tasks: Sequence[str]) -> list[int]:
        return sorted(i for i, step in self.steps.items() if step.task in tasks)

    def lease_effect_ids(self) -> list[int]:
        """The jobs and steps in lease mode that write an effect when they succeed."""
        return self.ids(EFFECT_LEASE_TASKS) + self.step_ids(STEP_LEASE_TASKS)

    def succeeded(self, job_id: int) -> JobRow | None:
        job = self.jobs.get(job_id)
        return job if job is not None and job.status == "succeeded" else None

    def details(self, ids: Sequence[int]) -> list[str]:
        """What the database and the worker logs say about (the first few of) these jobs."""
        lines: list[str] = []
        for job_id in list(ids)[:_SHOWN]:
            lines += self.job_text(job_id)
        if len(ids) > _SHOWN:
            lines.append(f"... and {len(ids) - _SHOWN} more: {sorted(ids)[_SHOWN:][:50]}")
        return lines

    def job_text(self, job_id: int) -> list[str]:
        job = self.jobs.get(job_id)
        if job is None:
            head = f"job {job_id} ({self.enqueued.get(job_id)}): missing from the table"
        else:
            error = (job.last_error or "").strip().splitlines()
            head = (
                f"job {job.id} ({job.task}): {job.status}, attempts {job.attempts}/"
                f"{job.max_attempts}, last_error {(error[-1] if error else '-')[:160]!r}"
            )
        lines = [head]
        step = self.steps.get(job_id)
        if step is not None:
            finished = "-" if step.finished_at is None else f"{step.finished_at:%H:%M:%S.%f}"[:-3]
            lines.append(
                f"  step {step.step!r} of workflow {step.workflow_id}, depends on "
                f"{list(step.depends_on)}, policy {step.policy}, blocked_by {step.blocked_by}, "
                f"finished_at {finished}, result {self.results.get(job_id)}"
            )
        rows = [row for row in self.effects if row.job_id == job_id]
        if rows:
            shown = (f"{r.kind}#{r.attempt} pid {r.pid} {r.at:%H:%M:%S.%f}"[:-3] for r in rows)
            lines.append("  rows: " + ", ".join(shown))
        logged = sorted(self.logs.by_job.get(job_id, []))
        lines.extend(f"  log: {line}" for line in logged[:8])
        return lines

    # -- the checks, in the order of CHECKS

    def faults_injected(self) -> Check:
        state = self.state
        missing = []
        if not state.kills:
            missing.append("no SIGKILL")
        if not state.pause.get("done"):
            missing.append("no SIGSTOP")
        if not state.restart.get("done") and "skipped" not in state.restart:
            missing.append("no PostgreSQL restart")
        restart = "1 restart" if state.restart.get("done") else "restart skipped"
        pause = "1 pause" if state.pause.get("done") else "no pause"
        summary = f"{len(state.kills)} kills, {restart}, {pause}"
        if missing:
            summary += f": {', '.join(missing)} (run longer)"
        return Check("faults_injected", not missing, summary)

    def no_job_lost(self) -> Check:
        missing = sorted(i for i in self.enqueued if i not in self.jobs)
        unfinished = sorted(
            i for i in self.enqueued if i in self.jobs and self.jobs[i].status not in FINISHED
        )
        lost = missing + unfinished
        return Check(
            "no_job_lost",
            not lost,
            f"{len(self.enqueued) - len(lost)} of {len(self.enqueued)} jobs exist and finished; "
            f"{len(missing)} missing, {len(unfinished)} unfinished",
            self.details(lost),
        )

    def no_job_stuck(self) -> Check:
        stuck = sorted(i for i, j in self.jobs.items() if j.status in ("pending", "running"))
        summary = f"{len(stuck)} jobs pending or running"
        if self.drain_seconds is None:
            summary += f" (not drained within {self.config.drain_timeout:g} s)"
        return Check("no_job_stuck", not stuck, summary, self.details(stuck))

    def non_poison_succeeded(self) -> Check:
        # Timed jobs may die at their limits: timed_finished and timed_dead_explained.
        ids = [i for i, task in self.enqueued.items() if task not in POISON_TASKS + TIMED_TASKS]
        failed = sorted(i for i in ids if self.succeeded(i) is None)
        return Check(
            "non_poison_succeeded",
            not failed,
            f"{len(ids) - len(failed)} of {len(ids)} jobs neither poison nor timed succeeded",
            self.details(failed),
        )

    def lock_effect_exactly_once(self) -> Check:
        ids = self.ids(LOCK_TASKS)
        bad = []
        duplicates = 0
        for i in ids:
            rows = self.effect_rows.get(i, [])
            duplicates += max(0, len(rows) - 1)
            job = self.succeeded(i)
            # Not succeeded (non_poison_succeeded says so): then no effect may be committed.
            expected = [] if job is None else [job.attempts]
            if [row.attempt for row in rows] != expected:
                bad.append(i)
        return Check(
            "lock_effect_exactly_once",
            not bad,
            f"{len(ids) - len(bad)} of {len(ids)} lock-held jobs have exactly one effect, by the "
            f"attempt that succeeded; {duplicates} duplicate effects",
            self.details(bad),
        )

    def lease_final_attempt_recorded(self) -> Check:
        ids = self.lease_effect_ids()
        bad = []
        for i in ids:
            job = self.succeeded(i)
            if job is None:
                continue  # non_poison_succeeded (timed: timed_dead_explained) says so
            finals = [r for r in self.effect_rows.get(i, []) if r.attempt == job.attempts]
            result = self.results.get(i)
            if i in self.steps:  # a step's result says more (workflow_outcomes_as_planned)
                recorded = isinstance(result, dict) and result.get("attempt") == job.attempts
            else:
                recorded = result == {"attempt": job.attempts}
            if len(finals) != 1 or not recorded:
                bad.append(i)
        return Check(
            "lease_final_attempt_recorded",
            not bad,
            f"{len(ids) - len(bad)} of {len(ids)} lease-mode jobs (workflow steps included) "
            "have the effect and the stored result of the attempt that succeeded",
            self.details(bad),
        )

    def duplicates(self) -> _Duplicates:
        rows: list[EffectRow] = []
        for i in self.lease_effect_ids():
            effects = self.effect_rows.get(i, [])
            job = self.succeeded(i)
            if job is None:
                rows += effects[1:]
                continue
            finals = [r for r in effects if r.attempt == job.attempts]
            rows += [r for r in effects if r.attempt != job.attempts] + finals[1:]
        state = self.state
        restart = state.restart
        kills = len(state.kills)
        pauses = 1 if state.pause.get("done") else 0
        at_restart = int(restart.get("workers_running", 0)) if restart.get("done") else 0
        c = self.config.concurrency
        # Attribute each duplicate to a fault: its attempt was claimed (database clock) shortly
        # before the fault, in the worker it hit, so it held its job when the fault came. The
        # claim, not the start row: a pause may stop a handler between the lease check that
        # admits it and its first statement, which then lands after SIGCONT.
        by_cause = dict.fromkeys(("kill", "pause", "restart", "unexplained"), 0)
        unexplained = []
        for row in rows:
            cause = self.fault_at(row.pid, row.claimed_at) or "unexplained"
            by_cause[cause] += 1
            if cause == "unexplained":
                unexplained.append(row)
        return _Duplicates(
            rows=rows,
            by_cause=by_cause,
            unexplained=unexplained,
            bound=2 * c * (kills + pauses + at_restart),
            formula=(
                f"2 x concurrency {c} x ({kills} kills + {pauses} pause + {at_restart} workers "
                "at the restart)"
            ),
        )

    def lease_duplicates_bounded(self) -> Check:
        dup = self.duplicates()
        total, bound = len(dup.rows), dup.bound
        relation = "<=" if total <= bound else ">"
        return Check(
            "lease_duplicates_bounded",
            total <= bound,
            f"{total} duplicate effects {relation} bound {bound} = {dup.formula}",
        )

    def lease_duplicates_explained(self) -> Check:
        dup = self.duplicates()
        total = len(dup.rows)
        shown = [
            f"effect of job {r.job_id} attempt {r.attempt} by pid {r.pid} at {r.at:%H:%M:%S.%f}"
            for r in dup.unexplained[:_SHOWN]
        ]
        return Check(
            "lease_duplicates_explained",
            not dup.unexplained,
            f"{total - len(dup.unexplained)} of {total} duplicates traced to a fault (by cause: "
            + ", ".join(f"{cause} {n}" for cause, n in dup.by_cause.items())
            + ")",
            shown + self.details(sorted({r.job_id for r in dup.unexplained})),
        )

    def poison_dead_at_max_attempts(self) -> Check:
        ids = self.ids(POISON_TASKS)

        def wanted(i: int) -> tuple[str, int, int]:
            # A worker that gives an attempt back unstarted (its lease ran out while it was
            # stopped, say) adds one to max_attempts: the job still runs 3 times.
            most = POISON_MAX_ATTEMPTS + self.logs.released[i]
            return ("dead", most, most)

        bad = [
            i
            for i in ids
            if i not in self.jobs
            or (self.jobs[i].status, self.jobs[i].attempts, self.jobs[i].max_attempts) != wanted(i)
        ]
        return Check(
            "poison_dead_at_max_attempts",
            not bad,
            f"{len(ids) - len(bad)} of {len(ids)} poison jobs dead with attempts == max_attempts "
            f"== {POISON_MAX_ATTEMPTS} (+1 per attempt given back unstarted: "
            f"{sum(self.logs.released[i] for i in ids)})",
            self.details(bad),
        )

    # -- time limits and snoozes

    def fault_at(self, pid: int, claimed_at: datetime) -> str | None:
        """The fault (kill, pause, restart) an attempt claimed at ``claimed_at`` (database
        clock) by worker ``pid`` was at risk from, or None."""
        return next(
            (
                w.cause
                for w in self.state.windows
                if w.pid in (None, pid) and w.start <= claimed_at <= w.end
            ),
            None,
        )

    def limit(self, job: JobRow) -> float:
        """A timed job's time limit in seconds: its own, else its task's."""
        return TIMED_LIMIT if job.time_limit is None else job.time_limit.total_seconds()

    def slow(self, job: JobRow, attempt: int) -> bool:
        """Whether this attempt of a timed job was planned to run past its limit (a slow one
        sleeps twice the limit, a quick one at most a quarter: nothing in between)."""
        return planned_sleep(job.args, attempt) > self.limit(job)

    def hit(self, job: JobRow, attempt: int) -> str | None:
        """The fault this attempt was at risk from, or None: by its start row (when and by
        whom it was claimed) or, without one, by the worker that logged it past its limit
        (claimed about the limit before that line)."""
        start = self.starts.get((job.id, attempt))
        if start is not None:
            return self.fault_at(start.pid, start.claimed_at)
        logged = self.logs.timed_out.get((job.id, attempt))
        if logged is None:
            return None
        pid, at = logged
        return self.fault_at(pid, at - timedelta(seconds=self.limit(job)))

    def timed_finished(self) -> Check:
        ids = self.ids(TIMED_TASKS)
        bad = [i for i in ids if i not in self.jobs or self.jobs[i].status not in FINISHED]
        bad += [i for i in ids if i not in bad and self.jobs[i].status == "cancelled"]
        counts = Counter(self.jobs[i].status for i in ids if i in self.jobs)
        return Check(
            "timed_finished",
            not bad,
            f"{len(ids) - len(bad)} of {len(ids)} time-limited jobs succeeded or dead "
            f"({counts['succeeded']} succeeded, {counts['dead']} dead); {len(bad)} not",
            self.details(bad),
        )

    def timed_limits_enforced(self) -> Check:
        """Slow attempts timed out (logged job_timed_out), wrote no effect and did not
        succeed; quick ones did not time out. An attempt a fault hit is excused (a paused
        worker's clock runs on: its quick attempts are past their limits when it wakes, and
        its handlers may end before its time-limit thread looks)."""
        problems: dict[int, list[str]] = defaultdict(list)
        excused: Counter[str] = Counter()

        def wrong(job: JobRow, attempt: int, what: str) -> None:
            cause = self.hit(job, attempt)
            if cause is None:
                problems[job.id].append(f"attempt {attempt} {what}")
            else:
                excused[cause] += 1

        ids = self.ids(TIMED_TASKS)
        slow_started = timed_out = 0
        for (job_id, attempt), start in self.starts.items():
            job = self.jobs.get(job_id)
            if job is not None and job.task in TIMED_TASKS and self.slow(job, attempt):
                slow_started += 1
                if (job_id, attempt) not in self.logs.timed_out:
                    wrong(job, attempt, f"(slow, pid {start.pid}) was not logged timed out")
        for i in ids:
            job = self.jobs.get(i)
            if job is None:
                continue  # no_job_lost says so
            for row in self.effect_rows.get(i, []):
                if self.slow(job, row.attempt):
                    wrong(job, row.attempt, "(slow) wrote its effect")
            if job.status == "succeeded" and self.slow(job, job.attempts):
                wrong(job, job.attempts, "(slow) succeeded")
        for job_id, attempt in self.logs.timed_out:
            job = self.jobs.get(job_id)
            if job is None or job.task not in TIMED_TASKS:
                problems[job_id].append(f"attempt {attempt} of a task without a time limit")
                continue
            timed_out += 1
            if not self.slow(job, attempt):
                wrong(job, attempt, "(quick) was logged timed out")
        summary = (
            f"{slow_started} slow attempts started, {timed_out} attempts logged timed out; "
            f"{len(problems)} of {len(ids)} time-limited jobs break the limits"
        )
        if excused:
            summary += " (excused as hit by a fault: " + ", ".join(
                f"{cause} {n}" for cause, n in sorted(excused.items())
            )
            summary += ")"
        shown = [f"job {i}: {'; '.join(p)}" for i, p in sorted(problems.items())[:_SHOWN]]
        return Check(
            "timed_limits_enforced",
            not problems,
            summary,
            shown + self.details(sorted(problems)),
        )

    def timed_dead_explained(self) -> Check:
        """Every dead timed job is dead at its last attempt (attempts == max_attempts == 3,
        plus one per attempt given back unstarted), and that attempt either ran past its
        time limit (last_error says so) being a slow one or hit by a fault, or failed
        otherwise (its lease lost, a database error) being hit by a fault, or never wrote
        its start row and lost its lease (its worker died or stopped before its handler's
        first statement)."""
        ids = self.ids(TIMED_TASKS)
        dead = [self.jobs[i] for i in ids if i in self.jobs and self.jobs[i].status == "dead"]
        bad: list[int] = []
        why: Counter[str] = Counter()
        for job in dead:
            n = job.attempts
            most = TIMED_MAX_ATTEMPTS + self.logs.released[job.id]
            error = (job.last_error or "").strip()
            timed = TIMED_OUT.search(error)
            cause = self.hit(job, n)
            if (n, job.max_attempts) != (most, most):
                bad.append(job.id)
            elif timed is not None and int(timed.group(1)) == n:
                if self.slow(job, n):
                    why["slow last attempt timed out"] += 1
                elif cause is not None:
                    why[f"quick last attempt timed out, hit by {cause}"] += 1
                else:
                    bad.append(job.id)
            elif cause is not None:
                why[f"last attempt failed, hit by {cause}"] += 1
            elif (job.id, n) not in self.starts and error == (
                f"attempt {n} lost its lease: its worker stopped or crashed mid-job"
            ):
                why["last attempt lost its lease before its first statement"] += 1
            else:
                bad.append(job.id)
        return Check(
            "timed_dead_explained",
            not bad,
            f"{len(dead) - len(bad)} of {len(dead)} dead time-limited jobs dead at "
            f"max_attempts == {TIMED_MAX_ATTEMPTS} (+1 per attempt given back unstarted) "
            "for a reason allowed: "
            + (", ".join(f"{reason} {count}" for reason, count in sorted(why.items())) or "-"),
            self.details(bad),
        )

    def snoozed_succeeded(self) -> Check:
        """Every snoozing job succeeded after exactly its planned snoozes (it snoozes while
        its row holds fewer), each of which added one to its max_attempts (as does an
        attempt given back unstarted), and ran at least once more than it snoozed."""
        ids = self.ids(SNOOZY_TASKS)
        bad = []
        for i in ids:
            job = self.jobs.get(i)
            if job is None:
                bad.append(i)
                continue
            planned = int(job.args["snoozes"])
            grown = job.max_attempts - SNOOZY_MAX_ATTEMPTS - self.logs.released[i]
            if (
                job.status != "succeeded"
                or job.snoozes != planned
                or job.snoozes < 1
                or grown != job.snoozes
                or job.attempts < job.snoozes + 1
            ):
                bad.append(i)
        snoozes = sum(self.jobs[i].snoozes for i in ids if i in self.jobs)
        beyond = sum(
            1 for i in ids if i in self.jobs and self.jobs[i].snoozes >= SNOOZY_MAX_ATTEMPTS
        )
        return Check(
            "snoozed_succeeded",
            not bad,
            f"{len(ids) - len(bad)} of {len(ids)} snoozing jobs succeeded with snoozes == "
            f"planned >= 1 and max_attempts == {SNOOZY_MAX_ATTEMPTS} + snoozes (+1 per attempt "
            f"given back unstarted); {snoozes} snoozes in all ({sum(self.logs.snoozed.values())}"
            f" logged job_snoozed), {beyond} jobs snoozed as often as max_attempts allows runs",
            self.details(bad),
        )

    def deaths_logged(self) -> Check:
        # Exactly once each way: every dead job is logged dead by one worker (the one whose
        # fenced transition, or claim, made it dead), and no job that is not dead is.
        deaths = self.logs.deaths
        dead = sorted(i for i, j in self.jobs.items() if j.status == "dead")
        # A worker killed after its death transition committed and before its log line was
        # written leaves a death nobody logged: the harness aims every other kill at a poison
        # job's last attempt, so the kill may land in exactly that gap. Such a death is
        # explained when the harness killed the process that ran the job's last attempt after
        # that attempt started; any other unlogged death is a failure.
        killed = [
            i
            for i in dead
            if i not in deaths and self.killed_while_running(i, self.jobs[i].attempts)
        ]
        # The restart can cut off a death too: the last attempt's death committed just before
        # the server went down, its acknowledgment was lost with the connection, and the
        # writer's retry after the restart found the job dead already (its own write) and
        # logged lease_lost. Explained when the attempt started before the server came back
        # and its outcome came back fenced after the server went down.
        acked = [
            i
            for i in dead
            if i not in deaths
            and i not in killed
            and self.ack_lost_in_restart(i, self.jobs[i].attempts)
        ]
        killed += acked
        unlogged = [i for i in dead if i not in deaths and i not in killed]
        twice = sorted(i for i, n in deaths.items() if n > 1)
        phantom = sorted(i for i in deaths if i not in self.jobs or self.jobs[i].status != "dead")
        problems = []
        if unlogged:
            problems.append(f"not logged: {unlogged[:50]}")
        if twice:
            problems.append(f"logged more than once: {twice[:50]}")
        if phantom:
            problems.append(f"logged dead but not dead: {phantom[:50]}")
        summary = (
            f"{len(dead) - len(unlogged) - len(killed)} of {len(dead)} dead "
            "jobs logged with action job_dead or attempts_exhausted"
        )
        if killed:
            summary += (
                f", {len(killed)} not logged because the harness killed the worker that ran "
                f"the last attempt, or restarted the server as its death committed: "
                f"{killed[:50]}"
            )
        if problems:
            summary += "; " + "; ".join(problems)
        return Check(
            "deaths_logged",
            not problems,
            summary,
            self.details(sorted({*unlogged, *twice, *phantom})),
        )

    def ack_lost_in_restart(self, job_id: int, attempt: int) -> bool:
        """Whether this attempt's own death was written (the row holds its error) and its
        outcome came back fenced out after the server went down, the attempt having started
        before it came back (see deaths_logged)."""
        restart, start = self.state.restart, self.starts.get((job_id, attempt))
        if not restart.get("done") or start is None:
            return False
        # The death is that attempt's own write: the row holds its error.
        error = (self.jobs[job_id].last_error or "").strip()
        if not error.endswith(f"poisoned on attempt {attempt}"):
            return False
        down = datetime.fromisoformat(restart["down_at"])
        up = datetime.fromisoformat(restart["up_at"])
        return start.at <= up and any(at >= down for at in self.logs.fenced[(job_id, attempt)])

    def killed_while_running(self, job_id: int, attempt: int) -> bool:
        """Whether the harness SIGKILLed the process that ran this attempt, after it started."""
        start = self.starts.get((job_id, attempt))
        if start is None:
            return False
        return any(
            w.cause == "kill" and w.pid == start.pid and w.end >= start.at
            for w in self.state.windows
        )

    def workers_survived(self) -> Check:
        state, crashes = self.state, self.logs.crashes
        problems = state.unexpected_exits + [f"thread_crashed: {line}" for line in crashes]
        return Check(
            "workers_survived",
            not problems,
            f"{len(self.pool.procs)} worker processes, {len(state.kills)} killed by the harness, "
            f"{len(state.unexpected_exits)} exited on their own, {len(crashes)} thread_crashed",
            problems[:_SHOWN],
        )

    def workers_stopped_cleanly(self) -> Check:
        unclean = {label: code for label, code in self.stopped.items() if code != 0}
        summary = f"{len(self.stopped) - len(unclean)} of {len(self.stopped)} workers exited 0 "
        summary += "after SIGTERM" + (f"; not: {unclean} (None: still running)" if unclean else "")
        return Check(
            "workers_stopped_cleanly",
            bool(self.stopped) and not unclean,
            summary,
            [
                f"{p.label} (pid {p.pid}): {' | '.join(p.log_tail(3))}"
                for p in self.pool.procs
                if p.label in unclean
            ],
        )

    # -- workflows

    def ended_at(self, step: StepRow) -> datetime | None:
        """When step ``step`` ended, as late as the database shows it: its ``finished_at``,
        or the effect its succeeding attempt wrote later (a lock-mode step's completion
        keeps the claim's transaction time; its effect is written just before it commits)."""
        if step.finished_at is None:
            return None
        times = [step.finished_at.astimezone(timezone.utc)]
        if step.status == "succeeded":
            effects = self.effect_rows.get(step.id, [])
            times += [r.at for r in effects if r.attempt == step.attempts]
        return max(times)

    def steps_after_dependencies(self) -> Check:
        """No attempt of a step started (its start row, database time) before each of its
        dependencies had ended, succeeded (for a step whose policy is ``run``: ended in any
        way); so a step whose dependency failed and whose policy is cancel never started."""
        problems: dict[int, list[str]] = defaultdict(list)
        margins: list[timedelta] = []
        starts = 0
        for step_id, rows in sorted(self.step_starts.items()):
            step = self.steps[step_id]
            for row in rows:
                starts += 1
                for dep_id in step.depends_on:
                    dep = self.steps.get(dep_id)
                    if dep is None:
                        problems[step_id].append(f"dependency {dep_id} is not a step")
                        continue
                    ok = dep.status == "succeeded" or (
                        step.policy == "run" and dep.status in FINISHED
                    )
                    ended = self.ended_at(dep)
                    if not ok or ended is None or row.at <= ended:
                        when = "never" if ended is None else f"{ended:%H:%M:%S.%f}"
                        problems[step_id].append(
                            f"attempt {row.attempt} started {row.at:%H:%M:%S.%f} (pid "
                            f"{row.pid}); dependency {dep_id} ({dep.step}) is {dep.status}, "
                            f"ended {when}"
                        )
                    else:
                        margins.append(row.at - ended)
        blocked = [
            s
            for s in self.steps.values()
            if s.policy == "cancel"
            and any(
                d in self.steps and self.steps[d].status in ("dead", "cancelled")
                for d in s.depends_on
            )
        ]
        least = f"{min(margins).total_seconds() * 1000:.1f} ms" if margins else "-"
        shown = [f"step {i}: {'; '.join(p)}" for i, p in sorted(problems.items())[:_SHOWN]]
        return Check(
            "steps_after_dependencies",
            not problems,
            f"{starts} attempt starts of {len(self.step_starts)} steps, against {len(margins)} "
            f"dependency ends: {len(problems)} steps started too early (least margin {least}); "
            f"{sum(1 for s in blocked if s.id not in self.step_starts)} of {len(blocked)} steps "
            "whose dependency failed (policy cancel) never started",
            shown + self.details(sorted(problems)),
        )

    def workflows_finished(self) -> Check:
        """Every workflow enqueued exists with its order, is final (succeeded, failed or
        cancelled) with steps_left == 0, and no step is left waiting, pending or running."""
        problems: list[str] = []
        ids = {plan.id for plan in self.plans}
        for plan in self.plans:
            flow = self.workflows.get(plan.id)
            if flow is None:
                problems.append(f"workflow {plan.id} ({plan.shape} {plan.index}) is missing")
                continue
            if flow.order_id != plan.order_id or self.orders.get(plan.order_id) != plan.shape:
                problems.append(f"workflow {plan.id}: order {flow.order_id}, not {plan.order_id}")
            if flow.status == "running" or flow.steps_left != 0 or flow.finished_at is None:
                problems.append(
                    f"workflow {plan.id} ({plan.shape} {plan.index}): {flow.status}, "
                    f"steps_left {flow.steps_left}, finished_at {flow.finished_at}"
                )
        extra = sorted(set(self.workflows) - ids)
        if extra or len(self.orders) != len(self.plans):
            problems.append(
                f"workflows not enqueued: {extra[:20]}; {len(self.orders)} orders for "
                f"{len(self.plans)} workflows"
            )
        stuck = sorted(i for i, s in self.steps.items() if s.status not in FINISHED)
        if stuck:
            problems.append(f"{len(stuck)} steps waiting, pending or running: {stuck[:50]}")
        counts = Counter(self.workflows[i].status for i in ids if i in self.workflows)
        return Check(
            "workflows_finished",
            not problems,
            f"{sum(n for status, n in counts.items() if status != 'running')} of "
            f"{len(self.plans)} workflows final ("
            + ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))
            + f") with steps_left 0; {len(stuck)} of {len(self.steps)} steps not ended",
            problems[:_SHOWN] + self.details(stuck),
        )

    def step_lock_effect_exactly_once(self) -> Check:
        """Every lock-mode step that succeeded has exactly one effect, by the attempt that
        succeeded; one that did not (dead, cancelled) has none: a failed attempt's effect
        rolled back with it."""
        ids = self.step_ids(STEP_LOCK_TASKS)
        bad = []
        rolled_back = 0
        for i in ids:
            step = self.steps[i]
            rows = self.effect_rows.get(i, [])
            expected = [step.attempts] if step.status == "succeeded" else []
            if [row.attempt for row in rows] != expected:
                bad.append(i)
            if step.task in STEP_FAILING_TASKS:
                rolled_back += len(self.step_starts.get(i, []))
        succeeded = sum(1 for i in ids if self.steps[i].status == "succeeded")
        return Check(
            "step_lock_effect_exactly_once",
            not bad,
            f"{len(ids) - len(bad)} of {len(ids)} lock-mode steps have one effect by the "
            f"attempt that succeeded ({succeeded}) or none ({len(ids) - succeeded} not "
            f"succeeded; {rolled_back} attempts of failing ones wrote an effect that rolled "
            "back)",
            self.details(bad),
        )

    def workflow_counts_agree(self) -> Check:
        """Each workflow's counts are its steps': steps_total all of them (as planned, the
        steps added at run time included), steps_failed the dead and cancelled ones,
        steps_left those not ended; and its status follows (failed if a step failed)."""
        by_flow: dict[int, list[StepRow]] = defaultdict(list)
        for step in self.steps.values():
            by_flow[step.workflow_id].append(step)
        problems = []
        for plan in self.plans:
            flow = self.workflows.get(plan.id)
            if flow is None:
                continue  # workflows_finished says so
            rows = by_flow.get(plan.id, [])
            failed = sum(1 for s in rows if s.status in ("dead", "cancelled"))
            left = sum(1 for s in rows if s.status not in FINISHED)
            status = "running" if left else ("failed" if failed else "succeeded")
            counted = (flow.steps_total, flow.steps_failed, flow.steps_left, flow.status)
            wanted = (len(rows), failed, left, status)
            if counted != wanted or len(rows) != len(plan.steps):
                problems.append(
                    f"workflow {plan.id} ({plan.shape} {plan.index}): total, failed, left, "
                    f"status {counted}; its steps say {wanted} ({len(plan.steps)} planned)"
                )
        return Check(
            "workflow_counts_agree",
            not problems,
            f"{len(self.plans) - len(problems)} of {len(self.plans)} workflows count their "
            "steps as the steps are (steps_total, steps_failed, steps_left, status)",
            problems[:_SHOWN],
        )

    def workflow_outcomes_as_planned(self) -> Check:
        """Every planned step exists (those added at run time once, by name) and ended as the
        rules say (WorkflowPlan.outcomes): a failing one dead at max_attempts == 2 (+1 per
        attempt given back unstarted), the steps after a failed one cancelled (blocked_by a
        failed step), but those whose policy is run, every other one succeeded with the
        results of exactly its succeeded dependencies (``saw``); no step beyond the plan;
        each workflow's status as planned."""
        problems: dict[int, list[str]] = defaultdict(list)
        ids: list[int] = []
        planned_steps = 0
        for plan in self.plans:
            ends = plan.outcomes()
            planned_steps += len(ends)
            for name in ends:
                step = self.named.get((plan.id, name))
                if step is None:
                    problems[plan.id].append(f"step {name!r} is missing")
                    continue
                wrong = self.outcome_wrong(plan, name, ends, step)
                if wrong:
                    problems[plan.id].append(f"step {name!r} ({step.id}, {step.task}): {wrong}")
                    ids.append(step.id)
            extra = sorted(
                s.step
                for s in self.steps.values()
                if s.workflow_id == plan.id and s.step not in plan.steps
            )
            if extra:
                problems[plan.id].append(f"steps not planned: {extra}")
            flow = self.workflows.get(plan.id)
            if flow is not None and flow.status != plan.status():
                problems[plan.id].append(f"{flow.status}, planned {plan.status()}")
        found = self.found_added()
        planned = Counter(end for plan in self.plans for end in plan.outcomes().values())
        shown = [f"workflow {i}: {'; '.join(p)}" for i, p in sorted(problems.items())[:_SHOWN]]
        return Check(
            "workflow_outcomes_as_planned",
            not problems,
            f"{len(self.plans) - len(problems)} of {len(self.plans)} workflows ended as planned: "
            f"{planned_steps} steps ("
            + ", ".join(f"{end} {n}" for end, n in sorted(planned.items()))
            + f"); {found} lease-mode split attempts found their steps added by an earlier one",
            shown + self.details(ids),
        )

    def found_added(self) -> int:
        """How many split steps succeeded on an attempt whose add was refused because an
        earlier attempt had added the steps (lease mode, that attempt then lost its job)."""
        results = [self.results.get(i) for i in self.step_ids(STEP_SPLIT_TASKS)]
        return sum(1 for result in results if isinstance(result, dict) and result.get("found"))

    def outcome_wrong(
        self, plan: WorkflowPlan, name: str, ends: dict[str, str], step: StepRow
    ) -> str:
        """What is wrong with step ``name`` of ``plan``, whose steps were to end as ``ends``
        say ('' if nothing)."""
        end = ends[name]
        if name in plan.step_ids and step.id != plan.step_ids[name]:
            return f"id {step.id}, but enqueue_workflow wrote it as {plan.step_ids[name]}"
        depends = sorted(self.steps[d].step for d in step.depends_on if d in self.steps)
        if depends != sorted(plan.dependencies(name)):
            return f"depends on {depends}, planned {sorted(plan.dependencies(name))}"
        if step.status != end:
            return f"{step.status}, planned {end}"
        if end == "dead":
            most = STEP_FAIL_MAX_ATTEMPTS + self.logs.released[step.id]
            if (step.attempts, step.max_attempts) != (most, most):
                return f"dead at attempts {step.attempts}/{step.max_attempts}, not {most}/{most}"
        elif end == "cancelled":
            blocker = self.steps.get(step.blocked_by or 0)
            if blocker is None or blocker.workflow_id != plan.id:
                return f"cancelled, blocked_by {step.blocked_by}: not a step of its workflow"
            if blocker.status not in ("dead", "cancelled"):
                return f"cancelled, blocked_by {blocker.id} ({blocker.step}): {blocker.status}"
        else:
            wanted = sorted(d for d in plan.dependencies(name) if ends[d] == "succeeded")
            result = self.results.get(step.id)
            saw = result.get("saw") if isinstance(result, dict) else None
            if saw != wanted:
                return f"read the results of {saw}, not {wanted}"
        return ""

    # -- the report

    def report(self, seed: int, server: str, log_dir: Path, clock: _Clock) -> ChaosReport:
        jobs_by_task: dict[str, dict[str, int]] = {}
        for i, task in sorted(self.enqueued.items()):
            status = self.jobs[i].status if i in self.jobs else "missing"
            counts = jobs_by_task.setdefault(task, {})
            counts[status] = counts.get(status, 0) + 1
        boring = ("worker_started", "worker_stopping", "worker_stopped")
        actions = {a: n for a, n in self.logs.actions.items() if a not in boring}
        if self.logs.not_json:
            actions["(lines that are not JSON)"] = len(self.logs.not_json)
        dup = self.duplicates()
        config = self.config
        by_shape: dict[str, dict[str, int]] = {}
        for plan in self.plans:
            flow = self.workflows.get(plan.id)
            status = "missing" if flow is None else flow.status
            counts = by_shape.setdefault(f"{plan.shape}{' (failing)' if plan.failing else ''}", {})
            counts[status] = counts.get(status, 0) + 1
        steps_by_task: dict[str, dict[str, int]] = {}
        for step in sorted(self.steps.values(), key=lambda s: s.task):
            counts = steps_by_task.setdefault(step.task, {})
            counts[step.status] = counts.get(step.status, 0) + 1
        workflows = {
            "total": len(self.plans),
            "steps": len(self.steps),
            "added": sum(1 for plan in self.plans for s in plan.steps.values() if s.added_by),
            "found": self.found_added(),
            "by_shape": dict(sorted(by_shape.items())),
            "steps_by_task": steps_by_task,
        }
        return ChaosReport(
            seed=seed,
            config={
                "duration": config.duration,
                "workers": config.workers,
                "concurrency": config.concurrency,
                "jobs": config.jobs,
                "workflows": config.workflows,
                "kill_every": list(config.kill_every),
                "pg_down": config.pg_down,
                "pause": config.pause,
                "lease": LEASE_SECONDS,
            },
            server=server,
            log_dir=str(log_dir),
            elapsed=clock.elapsed(),
            drain_seconds=self.drain_seconds,
            jobs_by_task=jobs_by_task,
            workflows=workflows,
            faults={
                "kills": len(self.state.kills),
                "killed": self.state.kills,
                "restart": self.state.restart,
                "pause": self.state.pause,
                "unexpected_exits": self.state.unexpected_exits,
            },
            duplicates={
                "total": len(dup.rows),
                "lease_jobs": len(self.lease_effect_ids()),
                "bound": dup.bound,
                "bound_formula": dup.formula,
                "by_cause": dup.by_cause,
            },
            log_actions=actions,
            checks=self.checks(),
            events=clock.events,
        )


# -- command line ---------------------------------------------------------------------------


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _positive_int(text: str) -> int:
    return int(_positive(int)(text))


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _range(text: str) -> tuple[float, float]:
    low, sep, high = text.partition(",")
    try:
        pair = (float(low), float(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX seconds") from None
    if not 0 < pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < MIN <= MAX")
    return pair


def build_parser() -> argparse.ArgumentParser:
    defaults = ChaosConfig()
    parser = argparse.ArgumentParser(
        prog="python tests/chaos.py",
        description="Run sqla_jobs workers under faults (SIGKILL, a PostgreSQL restart, a "
        "SIGSTOP) and account for every job. Exit status 1 names the failed checks.",
    )
    parser.add_argument(
        "--duration",
        type=_positive(float),
        default=defaults.duration,
        help=f"seconds of faults (default {defaults.duration:g})",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=defaults.workers,
        help=f"worker processes at a time (default {defaults.workers})",
    )
    parser.add_argument(
        "--concurrency",
        type=_positive_int,
        default=defaults.concurrency,
        help=f"jobs at once per worker (default {defaults.concurrency})",
    )
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=defaults.jobs,
        help=f"jobs to enqueue (default {defaults.jobs})",
    )
    parser.add_argument(
        "--workflows",
        type=_count,
        default=defaults.workflows,
        help=f"workflows to enqueue (default {defaults.workflows}; 0: none), of 3 to 11 steps each",
    )
    parser.add_argument("--seed", type=int, help="random seed (default: a random one, printed)")
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help=f"a PostgreSQL server to create a fresh database on (default: "
        f"${SERVER_URL_VARIABLE}, else an embedded server); no restart fault there",
    )
    parser.add_argument(
        "--kill-every",
        type=_range,
        default=defaults.kill_every,
        metavar="MIN,MAX",
        help="seconds between SIGKILLs, drawn uniformly (default 3,6)",
    )
    parser.add_argument(
        "--pg-down",
        type=_positive(float),
        default=defaults.pg_down,
        help=f"seconds the server stays down (default {defaults.pg_down:g})",
    )
    parser.add_argument(
        "--pause",
        type=_positive(float),
        default=defaults.pause,
        help=f"seconds a worker stays SIGSTOPped (default {defaults.pause:g}; the lease is "
        f"{LEASE_SECONDS:g})",
    )
    parser.add_argument(
        "--drain-timeout",
        type=_positive(float),
        default=defaults.drain_timeout,
        help=f"seconds to wait for the last jobs after the faults (default "
        f"{defaults.drain_timeout:g})",
    )
    parser.add_argument(
        "--log-dir", type=Path, help="keep the worker logs here (default: a temporary directory)"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the report as JSON to PATH ('-': stdout, the readable report then "
        "goes to stderr)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = ChaosConfig(
        duration=args.duration,
        workers=args.workers,
        concurrency=args.concurrency,
        jobs=args.jobs,
        workflows=args.workflows,
        seed=args.seed,
        database_url=args.database_url,
        kill_every=args.kill_every,
        pg_down=args.pg_down,
        pause=args.pause,
        drain_timeout=args.drain_timeout,
        log_dir=args.log_dir,
    )

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = run_chaos(config, None if args.quiet else progress)
    text = json.dumps(report.to_dict(), indent=2, default=str) + "\n"
    if args.json == "-":
        print(report.render(), file=sys.stderr)
        sys.stdout.write(text)
    else:
        print(report.render())
        if args.json:
            Path(args.json).write_text(text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
