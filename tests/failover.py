"""The failover drill: a primary killed under load, its synchronous standby promoted, every job
accounted for from SQL on the new primary.

    python tests/failover.py [--before 8] [--after 8] [--failovers 1] [--json report.json]

``nox -s failover`` runs it (two failovers: the killed node rejoins as the standby, then the
new primary is killed too); ``tests/test_failover.py`` runs a short form in the suite.

The setup (:mod:`ha_cluster`): Debian's pg_auto_failover on this machine, a monitor, a primary
and a synchronous standby (PostgreSQL 15, loopback ports). Everything connects through one
URL naming both nodes with ``target_session_attrs=read-write``, as an application would:

* producers (threads) write an order and enqueue its job in one transaction
  (:func:`enqueue_order`), committed with :func:`sqla_jobs.commit`; a commit whose outcome
  is unknown (:class:`~sqla_jobs.CommitUnknownError`), like any failed one, is retried with
  the same order id, which the unique key makes safe;
* three ``sqla-jobs worker`` processes run the jobs: ``leased`` (lease mode) and ``locked``
  (lock mode), :mod:`failover_tasks`.

After some seconds the primary is killed with SIGKILL (its keeper, its PostgreSQL, its
backends: the machine died). The standby, read at once (before its promotion: it holds
exactly what had committed, synchronous replication), says which jobs were in flight. Load
goes on through the promotion; then the producers stop, the jobs drain, and the checks read
the new primary:

``no_commit_lost``         every order whose commit returned is there, with its one job
``no_order_twice``         no order has two jobs (the retried enqueues were no-ops)
``every_job_ran``          every job succeeded: none lost, none stuck running or pending
``lock_exactly_once``      each ``locked`` job has exactly one effect
``lease_at_least_once``    each ``leased`` job has an effect; its duplicates (effects of an
                           attempt whose completion the dead primary took with it) are counted,
                           and every duplicated job was in flight at a kill
``workers_survived``       no worker process died

Measured: seconds from the kill to the new primary taking writes, and to the first job
completed there (its ``finished_at``, the database's clock, on this same machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from drills import Check, spawn_worker, wait_until
from failover_tasks import (
    QUEUES,
    TASKS,
    Base,
    DrillEffect,
    DrillJob,
    DrillOrder,
    registry,
)
from ha_cluster import Formation, Node, pg_autoctl_missing
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

import sqla_jobs
from sqla_jobs import JobStatus

#: Every status holds an order's key: a retried enqueue finds the job whatever became of it.
ALL_STATUSES = list(JobStatus)
_SHOWN = 10


@dataclass
class DrillConfig:
    """What to run: ``before`` seconds of load, a kill, ``after`` seconds of load once the new
    primary takes writes; ``failovers`` kills (each after the killed node rejoined)."""

    before: float = 8.0
    after: float = 8.0
    failovers: int = 1
    producers: int = 4
    #: Orders per second per producer, at most.
    rate: float = 60.0
    workers: int = 3
    concurrency: int = 8
    #: Each job's handler sleeps up to this long (seconds), so that some are mid-run at a kill.
    max_sleep: float = 0.05
    fast: bool = True
    drain_timeout: float = 120.0
    seed: int | None = None
    directory: Path | None = None


@dataclass
class Failover:
    killed: str
    #: Seconds from the kill to the new primary taking writes, and to its first completion.
    writable_after: float
    first_completion_after: float | None
    in_flight: int


@dataclass
class DrillReport:
    config: dict[str, Any]
    orders_committed: int = 0
    unknown_commits: int = 0
    #: Of those, the orders the retry found committed already (its enqueue a no-op).
    unknown_landed: int = 0
    failed_commits: int = 0
    jobs: int = 0
    duplicates: int = 0
    failovers: list[Failover] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    log_dir: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(check.ok for check in self.checks)

    def lines(self) -> list[str]:
        out = [
            (
                f"orders committed: {self.orders_committed}; commits with an unknown outcome: "
                f"{self.unknown_commits} ({self.unknown_landed} of them had committed, found by "
                f"the retry); other commits that failed: {self.failed_commits}; jobs: "
                f"{self.jobs}; lease-mode duplicates: {self.duplicates}"
            ),
        ]
        for i, failover in enumerate(self.failovers, 1):
            first = failover.first_completion_after
            out.append(
                f"failover {i} ({failover.killed} killed): writable after "
                f"{failover.writable_after:.1f} s, first completion after "
                f"{'-' if first is None else f'{first:.1f} s'}, {failover.in_flight} jobs in "
                "flight at the kill"
            )
        out += [check.line() for check in self.checks]
        return out


# -- producers ------------------------------------------------------------------------------


def enqueue_order(engine: sa.Engine, order_id: int, producer: int, task: str, sleep: float) -> bool:
    """One business transaction: the order and its job, retry-safe. The order is written so
    that a second write changes nothing, the job is unique by the order's key in every
    status: after a commit that landed, a retry is a no-op. Returns whether this call
    inserted the job (False: an earlier commit had)."""
    with Session(engine) as session:
        session.execute(
            insert(DrillOrder).values(id=order_id, producer=producer).on_conflict_do_nothing()
        )
        enqueued = sqla_jobs.enqueue_unique(
            session,
            registry[task].job({"sleep": sleep}, order_id=order_id),
            key=f"order:{order_id}",
            statuses=ALL_STATUSES,
        )
        sqla_jobs.commit(session)
        return enqueued.inserted


class Producer(threading.Thread):
    """Enqueues orders until stopped; every order is retried until its commit returns."""

    def __init__(self, index: int, engine: sa.Engine, config: DrillConfig, stop: threading.Event):
        super().__init__(name=f"producer-{index}", daemon=True)
        self.index = index
        self.engine = engine
        self.config = config
        self.stop_event = stop
        self.rng = random.Random((config.seed or 0) * 1000 + index)
        self.committed: list[int] = []
        self.unknown = 0
        #: Orders whose commit was unknown, then found committed by the retry.
        self.landed = 0
        self.failed = 0
        self.errors: Counter[str] = Counter()
        self.gave_up: list[int] = []

    def run(self) -> None:
        seq = 0
        interval = 1.0 / self.config.rate
        while not self.stop_event.is_set():
            seq += 1
            order_id = self.index * 10_000_000 + seq
            task = self.rng.choice(TASKS)
            sleep = round(self.rng.uniform(0, self.config.max_sleep), 3)
            started = time.monotonic()
            deadline = started + 60.0
            unknown = False
            while True:
                try:
                    inserted = enqueue_order(self.engine, order_id, self.index, task, sleep)
                except sqla_jobs.CommitUnknownError:
                    self.unknown += 1
                    unknown = True
                except sa.exc.DBAPIError as exc:
                    self.failed += 1
                    self.errors[type(exc.orig).__name__] += 1
                else:
                    self.committed.append(order_id)
                    self.landed += unknown and not inserted
                    break
                if time.monotonic() > deadline:
                    self.gave_up.append(order_id)
                    break
                time.sleep(0.1)
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


# -- workers --------------------------------------------------------------------------------


@dataclass(eq=False)
class WorkerProc:
    label: str
    popen: subprocess.Popen[bytes]
    log: Path


def start_worker(label: str, url: str, directory: Path, concurrency: int) -> WorkerProc:
    popen, log = spawn_worker(
        directory,
        label,
        url,
        "failover_tasks:registry",
        "--queues",
        ",".join(QUEUES),
        "--concurrency",
        str(concurrency),
        "--poll-interval",
        "0.5s",
        "--name",
        label,
    )
    return WorkerProc(label, popen, log)


# -- the run --------------------------------------------------------------------------------


def in_flight_at_kill(formation: Formation, standby: Node) -> set[int]:
    """The jobs held by an attempt (status running) when the primary died, read on the
    standby before its promotion: under synchronous replication it holds every commit the
    primary acknowledged, and waits here until it has replayed all it received."""
    conninfo = standby.conninfo(formation.dbname, formation.user)
    with psycopg.connect(conninfo, autocommit=True) as connection:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            row = connection.execute(
                "SELECT pg_is_in_recovery(), "
                "pg_last_wal_receive_lsn() IS NOT DISTINCT FROM pg_last_wal_replay_lsn()"
            ).fetchone()
            if row is None or not row[0] or row[1]:
                break
            time.sleep(0.02)
        rows = connection.execute("SELECT id FROM drill_jobs WHERE status = 'running'").fetchall()
    return {int(job_id) for (job_id,) in rows}


def first_completion_after(engine: sa.Engine, killed_at: datetime, timeout: float) -> float | None:
    """Seconds from ``killed_at`` to the first job completed after it (on the new primary:
    the old one is dead), once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(sa.exc.DBAPIError), engine.connect() as connection:
            first = connection.scalar(
                sa.select(sa.func.min(DrillJob.finished_at)).where(DrillJob.finished_at > killed_at)
            )
            if first is not None:
                return (first - killed_at).total_seconds()
        time.sleep(0.1)
    return None


def run_drill(config: DrillConfig, progress: Callable[[str], None] = lambda _: None) -> DrillReport:
    missing = pg_autoctl_missing()
    if missing is not None:
        raise RuntimeError(missing)
    report = DrillReport(config={k: str(v) for k, v in asdict(config).items()})
    directory = config.directory or Path(tempfile.mkdtemp(prefix="sqla_jobs_failover_"))
    directory.mkdir(parents=True, exist_ok=True)
    report.log_dir = str(directory)  # the workers' logs
    started = time.monotonic()

    def say(text: str) -> None:
        progress(f"[{time.monotonic() - started:6.1f}s] {text}")

    formation = Formation(fast=config.fast)
    workers: list[WorkerProc] = []
    producers: list[Producer] = []
    stop = threading.Event()
    engine: sa.Engine | None = None
    try:
        formation.start()
        primary = formation.writable()
        say(f"pg_auto_failover up: primary {primary.name if primary else '?'}; {formation.url()}")
        engine = sa.create_engine(formation.url(), pool_pre_ping=True, pool_size=config.producers)
        Base.metadata.create_all(engine)
        worker_dir = directory / "workers"
        worker_dir.mkdir(exist_ok=True)
        workers = [
            start_worker(f"worker-{i}", formation.url(), worker_dir, config.concurrency)
            for i in range(config.workers)
        ]
        wait_until(
            lambda: all('"worker_started"' in w.log.read_text(errors="replace") for w in workers),
            timeout=60,
            message="workers started",
        )
        producers = [Producer(i + 1, engine, config, stop) for i in range(config.producers)]
        for producer in producers:
            producer.start()
        say(f"{config.workers} workers, {config.producers} producers running")
        in_flight: set[int] = set()
        for round_ in range(config.failovers):
            time.sleep(config.before if round_ == 0 else config.after)
            victim = formation.writable()
            if victim is None:
                raise RuntimeError(f"no primary to kill: {formation.states()}")
            standby = next(node for node in formation.nodes if node is not victim)
            formation.kill(victim)
            # Taken once the old primary is gone: a job finished after this finished on the
            # new one (a commit in the last milliseconds before the kill reaches the standby
            # too, with its finished_at just before it).
            killed_at = datetime.now(timezone.utc)
            kill_clock = time.monotonic()
            say(f"killed {victim.name} (SIGKILL: keeper, PostgreSQL, backends)")
            held = in_flight_at_kill(formation, standby)
            in_flight |= held
            wait_until(
                lambda: formation.writable() is standby,  # noqa: B023 (called at once)
                timeout=120,
                message="the standby promoted",
            )
            writable = time.monotonic() - kill_clock
            say(f"{standby.name} takes writes after {writable:.1f} s")
            first = first_completion_after(engine, killed_at, 60)
            say(f"first completion on {standby.name} after {first} s")
            report.failovers.append(Failover(victim.name, writable, first, len(held)))
            formation.restart(victim)
            wait_until(
                lambda: formation.states().get(victim.name, ("", ""))[0] == "secondary",  # noqa: B023
                timeout=120,
                message=f"{victim.name} back as the standby",
            )
            say(f"{victim.name} rejoined as the standby")
        time.sleep(config.after)
        stop.set()
        for producer in producers:
            producer.join(90)
        say("producers stopped")
        total = sum(len(p.committed) for p in producers)

        def drained() -> bool:
            assert engine is not None
            with contextlib.suppress(sa.exc.DBAPIError), engine.connect() as connection:
                done = connection.scalar(
                    sa.select(sa.func.count()).where(DrillJob.status == JobStatus.SUCCEEDED)
                )
                return (done or 0) >= total
            return False

        with contextlib.suppress(AssertionError):
            wait_until(drained, timeout=config.drain_timeout, message="the drain")
        say("drained")
        alive = [w.label for w in workers if w.popen.poll() is None]
        for worker in workers:
            worker.popen.send_signal(signal.SIGTERM)
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.popen.wait(30)
        account(report, engine, producers, in_flight, alive, workers)
        return report
    finally:
        stop.set()
        for worker in workers:
            if worker.popen.poll() is None:
                worker.popen.kill()
        if engine is not None:
            engine.dispose()
        formation.stop()
        if report.ok:
            formation.remove()
            if config.directory is None:
                shutil.rmtree(directory, ignore_errors=True)
        else:
            progress(f"the formation's data and logs: {formation.directory}")


def account(
    report: DrillReport,
    engine: sa.Engine,
    producers: Sequence[Producer],
    in_flight: set[int],
    alive: list[str],
    workers: Sequence[WorkerProc],
) -> None:
    committed = {order for p in producers for order in p.committed}
    report.orders_committed = len(committed)
    report.unknown_commits = sum(p.unknown for p in producers)
    report.unknown_landed = sum(p.landed for p in producers)
    report.failed_commits = sum(p.failed for p in producers)
    gave_up = [order for p in producers for order in p.gave_up]
    with engine.connect() as connection:
        jobs = connection.execute(
            sa.select(DrillJob.id, DrillJob.order_id, DrillJob.task, DrillJob.status)
        ).all()
        effects = Counter(job_id for (job_id,) in connection.execute(sa.select(DrillEffect.job_id)))
    report.jobs = len(jobs)
    by_order = Counter(job.order_id for job in jobs)
    missing = sorted(committed - set(by_order))
    report.checks.append(
        Check(
            "no_commit_lost",
            not missing and not gave_up,
            f"{len(committed)} orders committed, {len(missing)} without their job"
            + (f": {missing[:_SHOWN]}" if missing else "")
            + (f"; {len(gave_up)} orders never committed: {gave_up[:_SHOWN]}" if gave_up else ""),
        )
    )
    twice = sorted(order for order, n in by_order.items() if n > 1)
    report.checks.append(
        Check(
            "no_order_twice",
            not twice,
            f"{len(by_order)} orders with jobs, {len(twice)} with more than one"
            + (f": {twice[:_SHOWN]}" if twice else ""),
        )
    )
    statuses = Counter(JobStatus(job.status).value for job in jobs)
    unfinished = sorted(job.id for job in jobs if job.status != JobStatus.SUCCEEDED)
    report.checks.append(
        Check(
            "every_job_ran",
            not unfinished,
            f"jobs by status {dict(statuses)}"
            + (f"; not succeeded: {unfinished[:_SHOWN]}" if unfinished else ""),
        )
    )
    locked = [job.id for job in jobs if job.task == "locked"]
    wrong = sorted(job_id for job_id in locked if effects[job_id] != 1)
    report.checks.append(
        Check(
            "lock_exactly_once",
            not wrong,
            f"{len(locked)} lock-mode jobs, {len(wrong)} without exactly one effect"
            + (f": {[(j, effects[j]) for j in wrong[:_SHOWN]]}" if wrong else ""),
        )
    )
    leased = [job.id for job in jobs if job.task == "leased"]
    none = sorted(job_id for job_id in leased if effects[job_id] == 0)
    duplicated = sorted(job_id for job_id in leased if effects[job_id] > 1)
    report.duplicates = sum(effects[job_id] - 1 for job_id in duplicated)
    unexplained = [job_id for job_id in duplicated if job_id not in in_flight]
    report.checks.append(
        Check(
            "lease_at_least_once",
            not none and not unexplained,
            f"{len(leased)} lease-mode jobs, {len(none)} without an effect, "
            f"{len(duplicated)} run twice ({report.duplicates} extra effects), of "
            f"{len(in_flight)} jobs in flight at the kills"
            + (f"; run twice but not in flight: {unexplained[:_SHOWN]}" if unexplained else ""),
        )
    )
    dead = [w.label for w in workers if w.label not in alive]
    report.checks.append(
        Check(
            "workers_survived",
            not dead,
            f"{len(alive)} of {len(workers)} workers running at the end"
            + (f"; exited: {dead}" if dead else ""),
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=float, default=8.0, help="seconds of load before a kill")
    parser.add_argument("--after", type=float, default=8.0, help="seconds of load after one")
    parser.add_argument("--failovers", type=int, default=1, help="kills, one after another")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=60.0, help="orders/s per producer")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="pg_auto_failover's own timeouts (a failover takes about a minute)",
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument("--log-dir", type=Path, help="keep the logs and data here")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    config = DrillConfig(
        before=args.before,
        after=args.after,
        failovers=args.failovers,
        producers=args.producers,
        rate=args.rate,
        workers=args.workers,
        concurrency=args.concurrency,
        fast=not args.defaults,
        seed=args.seed,
        directory=args.log_dir,
    )
    report = run_drill(config, progress=lambda line: print(line, flush=True))
    for line in report.lines():
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    if not report.ok:
        print(f"logs: {report.log_dir}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
