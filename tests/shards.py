"""The several-databases drill: jobs spread over three PostgreSQL servers by the order's
region, one server killed under load and restarted, every job accounted for.

    python tests/shards.py [--backlog 10000] [--json report.json]

``nox -s shards`` runs it. Three embedded PostgreSQL servers (three clusters, each its own
postmaster and data directory) hold the same tables (:mod:`shard_models`). Each gets a
backlog of jobs (half lease mode, half lock mode), and one producer thread per region goes
on enqueueing orders with their jobs in the region's database (the engine chosen by the
region), retrying an order until its commit returns (a unique key makes the retry safe).
Two ``sqla-jobs worker`` processes serve all three databases each (``--database-url`` three times: a
:class:`~sqla_jobs.WorkerGroup`).

The drill measures the rate at which jobs complete on all three, kills one server (an
immediate shutdown, no checkpoint: a crash), measures the rate of the other two while it is
down, restarts it (crash recovery) and waits until every job ran. Checks:

``others_keep_draining``    while one server is down, the other two complete jobs at no less
                            than two-thirds of the rate of all three before
``killed_jobs_ran``         after its restart, the killed server's jobs all ran
``no_commit_lost``          every order whose commit returned has its one job
``every_job_ran``           every job in every database succeeded, none stuck
``lock_exactly_once``       each lock-mode job has exactly one effect row
``workers_survived``        both worker processes ran to the end
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
from pathlib import Path

import sqlalchemy as sa
from drills import Check, spawn_worker, wait_until
from shard_models import (
    LOCK_QUEUE,
    QUEUE,
    Base,
    RegionJob,
    RegionOrder,
    ShardEffect,
    fulfil,
    record,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

import sqla_jobs
from sqla_jobs import JobStatus
from sqla_jobs.embedded import EmbeddedPostgres

REGIONS = ("eu", "us", "ap")
KILLED = "ap"
DATABASE = "shards"
#: The rate the two databases left must keep, as a share of all three's.
KEEP = 2 / 3
ALL_STATUSES = list(JobStatus)


@dataclass
class ShardsConfig:
    backlog: int = 10_000  # jobs per database before the workers start
    workers: int = 2
    concurrency: int = 16
    rate: float = 20.0  # orders per second per region's producer
    warmup: float = 2.0
    window: float = 5.0  # seconds each rate is measured over
    drain_timeout: float = 180.0
    directory: Path | None = None


@dataclass
class ShardsReport:
    config: dict[str, str]
    rate_all: float = 0.0
    rate_others: float = 0.0
    jobs: dict[str, int] = field(default_factory=dict)
    orders_committed: int = 0
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(check.ok for check in self.checks)

    def lines(self) -> list[str]:
        ratio = self.rate_others / self.rate_all if self.rate_all else 0.0
        return [
            (
                f"all three up: {self.rate_all:,.0f} jobs/s; {KILLED} down: the other two "
                f"{self.rate_others:,.0f} jobs/s ({ratio:.2f} of it); jobs per database "
                f"{self.jobs}; orders committed by the producers: {self.orders_committed}"
            ),
            *(check.line() for check in self.checks),
        ]


class Producer(threading.Thread):
    """One region's orders, each with its job, one transaction each; an order is retried
    until its commit returns (while its database is down, this region's orders wait)."""

    def __init__(
        self, region: str, first_id: int, engines: dict[str, sa.Engine], rate: float
    ) -> None:
        super().__init__(name=f"producer-{region}", daemon=True)
        self.region = region
        self.next_id = first_id
        self.engine = engines[region]
        self.rate = rate
        self.stop = threading.Event()
        self.committed: list[int] = []
        self.errors = 0

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            order_id = self.next_id
            while not self._place(order_id):
                self.errors += 1
                if self.stop.wait(0.2):
                    return
            self.committed.append(order_id)
            self.next_id += 1
            self.stop.wait(max(0.0, 1.0 / self.rate - (time.monotonic() - started)))

    def _place(self, order_id: int) -> bool:
        """The order and its job in the region's database (the key picks the engine), in
        one transaction; retry-safe."""
        try:
            with Session(self.engine) as session:
                session.execute(
                    insert(RegionOrder)
                    .values(id=order_id, region=self.region)
                    .on_conflict_do_nothing()
                )
                sqla_jobs.enqueue_unique(
                    session,
                    fulfil.job({}, order_id=order_id),
                    key=f"order:{order_id}",
                    statuses=ALL_STATUSES,
                )
                sqla_jobs.commit(session)
        except (sqla_jobs.CommitUnknownError, sa.exc.DBAPIError):
            return False
        return True


def _counts(engine: sa.Engine) -> Counter[str]:
    with engine.connect() as connection:
        rows = connection.execute(
            sa.select(RegionJob.status, sa.func.count()).group_by(RegionJob.status)
        ).all()
    return Counter({JobStatus(status).value: int(n) for status, n in rows})


def _succeeded(engines: dict[str, sa.Engine], regions: Sequence[str]) -> int:
    return sum(_counts(engines[region])["succeeded"] for region in regions)


def _rate(engines: dict[str, sa.Engine], regions: Sequence[str], window: float) -> float:
    before, started = _succeeded(engines, regions), time.monotonic()
    time.sleep(window)
    return (_succeeded(engines, regions) - before) / (time.monotonic() - started)


def start_workers(
    urls: Sequence[str], config: ShardsConfig, directory: Path
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """``config.workers`` worker processes, each serving every database of ``urls``."""
    options = ["--queues", f"{QUEUE},{LOCK_QUEUE}", "--concurrency", str(config.concurrency)]
    databases = [arg for url in urls for arg in ("--database-url", url)]
    return [
        spawn_worker(
            directory, f"worker-{i}", urls[0], "shard_models:registry", *options, *databases
        )
        for i in range(config.workers)
    ]


def run_shards(config: ShardsConfig, progress: Callable[[str], None] = print) -> ShardsReport:
    report = ShardsReport(config={k: str(v) for k, v in asdict(config).items()})
    directory = config.directory or Path(tempfile.mkdtemp(prefix="sqla_jobs_shards_"))
    directory.mkdir(parents=True, exist_ok=True)
    servers = {region: EmbeddedPostgres() for region in REGIONS}
    engines: dict[str, sa.Engine] = {}
    workers: list[tuple[subprocess.Popen[bytes], Path]] = []
    producers: list[Producer] = []
    clock = time.monotonic()

    def say(text: str) -> None:
        progress(f"[{time.monotonic() - clock:6.1f}s] {text}")

    try:
        for region, server in servers.items():
            server.start()
            server.create_database(DATABASE)
            engines[region] = sa.create_engine(server.url(DATABASE), pool_pre_ping=True)
            Base.metadata.create_all(engines[region])
            with Session(engines[region]) as session, session.begin():
                half = config.backlog // 2
                sqla_jobs.enqueue_many(
                    session,
                    RegionJob,
                    # Interleaved, so that the mix drains at a steady rate (the claims
                    # take the oldest first): the rates measured before and during the
                    # fault are of the same work.
                    (
                        {"task": task.name, "queue": task.queue, "args": {}}
                        for _ in range(half)
                        for task in (fulfil, record)
                    ),
                )
        say(f"three servers, {config.backlog} jobs in each")
        workers = start_workers(
            [servers[region].url(DATABASE) for region in REGIONS], config, directory
        )
        wait_until(
            lambda: all(
                log.read_text(errors="replace").count('"worker_started"') >= len(REGIONS)
                for _, log in workers
            ),
            timeout=60,
            message="workers started",
        )
        producers = [
            Producer(region, (i + 1) * 10_000_000, engines, config.rate)
            for i, region in enumerate(REGIONS)
        ]
        for producer in producers:
            producer.start()
        time.sleep(config.warmup)
        report.rate_all = _rate(engines, REGIONS, config.window)
        say(f"all three: {report.rate_all:,.0f} jobs/s")
        servers[KILLED].kill()
        say(f"{KILLED} killed")
        others = [region for region in REGIONS if region != KILLED]
        time.sleep(config.warmup)
        report.rate_others = _rate(engines, others, config.window)
        say(f"the other two: {report.rate_others:,.0f} jobs/s")
        left_before_restart = config.backlog - _succeeded(engines, others) // len(others)
        servers[KILLED].start()
        say(f"{KILLED} restarted")
        time.sleep(config.warmup)
        for producer in producers:
            producer.stop.set()
        for producer in producers:
            producer.join(30)
        committed = {order for p in producers for order in p.committed}
        total = {
            region: config.backlog + sum(len(p.committed) for p in producers if p.region == region)
            for region in REGIONS
        }
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: all(_counts(engines[r])["succeeded"] >= total[r] for r in REGIONS),
                timeout=config.drain_timeout,
                message="the drain",
            )
        say("drained")
        alive = [proc.poll() is None for proc, _ in workers]
        for proc, _ in workers:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        account(report, engines, committed, total, alive, left_before_restart)
        return report
    finally:
        for producer in producers:
            producer.stop.set()
        for proc, _ in workers:
            if proc.poll() is None:
                proc.kill()
        for engine in engines.values():
            engine.dispose()
        for server in servers.values():
            server.stop()
        if config.directory is None and report.ok:
            shutil.rmtree(directory, ignore_errors=True)  # the workers' logs
        elif not report.ok:
            progress(f"the workers' logs: {directory}")


def account(
    report: ShardsReport,
    engines: dict[str, sa.Engine],
    committed: set[int],
    total: dict[str, int],
    alive: list[bool],
    left_before_restart: int,
) -> None:
    ratio = report.rate_others / report.rate_all if report.rate_all else 0.0
    report.checks.append(
        Check(
            "others_keep_draining",
            ratio >= KEEP and left_before_restart > 0,
            f"{report.rate_others:,.0f} jobs/s of {report.rate_all:,.0f} ({ratio:.2f}; at "
            f"least {KEEP:.2f}), backlog left when {KILLED} came back: {left_before_restart}",
        )
    )
    statuses: dict[str, Counter[str]] = {}
    orders: set[int] = set()
    effects: dict[str, Counter[int]] = {}
    locked: dict[str, list[int]] = {}
    for region, engine in engines.items():
        statuses[region] = _counts(engine)
        with engine.connect() as connection:
            orders |= {
                order_id
                for order_id in connection.scalars(sa.select(RegionJob.order_id))
                if order_id is not None
            }
            effects[region] = Counter(
                int(job_id) for (job_id,) in connection.execute(sa.select(ShardEffect.job_id))
            )
            locked[region] = [
                int(job_id)
                for (job_id,) in connection.execute(
                    sa.select(RegionJob.id).where(RegionJob.task == record.name)
                )
            ]
    report.jobs = {region: sum(counts.values()) for region, counts in statuses.items()}
    report.orders_committed = len(committed)
    killed = statuses[KILLED]
    report.checks.append(
        Check(
            "killed_jobs_ran",
            killed["succeeded"] == total[KILLED] == sum(killed.values()),
            f"{KILLED}: {dict(killed)} of {total[KILLED]} enqueued",
        )
    )
    missing = sorted(committed - orders)
    report.checks.append(
        Check(
            "no_commit_lost",
            not missing,
            f"{len(committed)} orders committed, {len(missing)} without a job"
            + (f": {missing[:10]}" if missing else ""),
        )
    )
    unfinished = {
        region: dict(counts) for region, counts in statuses.items() if set(counts) != {"succeeded"}
    }
    report.checks.append(
        Check(
            "every_job_ran",
            not unfinished and all(report.jobs[r] == total[r] for r in total),
            f"jobs by database {report.jobs}, expected {total}"
            + (f"; not all succeeded: {unfinished}" if unfinished else ""),
        )
    )
    wrong = {
        region: [job for job in jobs if effects[region][job] != 1][:10]
        for region, jobs in locked.items()
    }
    report.checks.append(
        Check(
            "lock_exactly_once",
            not any(wrong.values()),
            f"{sum(len(j) for j in locked.values())} lock-mode jobs; without exactly one "
            f"effect: {sum(len(w) for w in wrong.values())}",
        )
    )
    report.checks.append(
        Check(
            "workers_survived", all(alive), f"{sum(alive)} of {len(alive)} workers ran to the end"
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backlog", type=int, default=10_000, help="jobs per database")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--window", type=float, default=5.0, help="seconds per rate")
    parser.add_argument("--log-dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    config = ShardsConfig(
        backlog=args.backlog,
        workers=args.workers,
        concurrency=args.concurrency,
        window=args.window,
        directory=args.log_dir,
    )
    report = run_shards(config, progress=lambda line: print(line, flush=True))
    for line in report.lines():
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
