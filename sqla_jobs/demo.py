"""``sqla-jobs demo``: the whole queue on a throwaway PostgreSQL, checked from the database.

1. Starts an embedded PostgreSQL 18 (unless given a database URL) and applies the library's
   migrations (the default ``sqla_jobs`` table), plus two tables of a pretend shop.
2. Starts worker processes (``sqla-jobs worker sqla_jobs.demo:registry``).
3. Enqueues jobs from business transactions: each inserts orders and, in the same
   transaction, one ``ship_order`` job per order. Every Nth transaction is rolled back.
4. Shows progress while the workers drain the queue, then prints throughput.
5. Verifies from the database: every committed order has exactly one job, which succeeded,
   and exactly one shipment row; no rolled-back order, job or shipment exists.

``ship_order`` runs in lock mode: its shipment row commits in the same transaction as the
job's completion, which is what makes "exactly one shipment per order" checkable.
Every run uses a queue of its own (``demo-<run id>``), so runs never mix.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Final, TextIO

import sqlalchemy as sa
from sqlalchemy import BigInteger, DateTime, ForeignKey, Identity, MetaData, String, func
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import NullPool

from sqla_jobs.context import JobContext
from sqla_jobs.queue import queue_stats
from sqla_jobs.registry import Registry
from sqla_jobs.schema import JobStatus

__all__ = ["DemoOrder", "DemoShipment", "registry", "run", "ship_order"]

TRANSACTION_SIZE: Final = 50
#: How long the demo waits for its worker processes to be running before it enqueues.
READY_TIMEOUT: Final = 60.0


class DemoBase(DeclarativeBase):
    metadata = MetaData()


class DemoOrder(DemoBase):
    """An order of the pretend shop, inserted by a business transaction."""

    __tablename__ = "sqla_jobs_demo_orders"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    run: Mapped[str] = mapped_column(String(32), index=True)
    amount: Mapped[int]


class DemoShipment(DemoBase):
    """What ``ship_order`` does: one row, committed together with the job's completion."""

    __tablename__ = "sqla_jobs_demo_shipments"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    run: Mapped[str] = mapped_column(String(32), index=True)
    order_id: Mapped[int] = mapped_column(ForeignKey(DemoOrder.id))
    job_id: Mapped[int] = mapped_column(BigInteger)
    attempt: Mapped[int]
    pid: Mapped[int]
    shipped_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.clock_timestamp()
    )


registry = Registry()  # the default model, sqla_jobs.models.Job


@registry.task(queue="demo", mode="lock", lease=30)
def ship_order(ctx: JobContext) -> None:
    """Record the shipment in the claim's transaction: it commits with the completion."""
    ctx.session.add(
        DemoShipment(
            run=ctx.args["run"],
            order_id=ctx.args["order"],
            job_id=ctx.id,
            attempt=ctx.attempt,
            pid=os.getpid(),
        )
    )


@dataclass
class _Enqueued:
    committed_orders: list[int] = field(default_factory=list)
    committed_jobs: list[int] = field(default_factory=list)
    rolled_back_orders: list[int] = field(default_factory=list)
    rolled_back_transactions: int = 0


class _Printer:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.live = out.isatty()
        self._last = 0.0
        self._pending = False

    def line(self, text: str) -> None:
        self.end()
        self.out.write(text + "\n")
        self.out.flush()

    def progress(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.live:
            self.out.write("\r" + text.ljust(78))
            self._pending = True
        elif force or now - self._last >= 1.0:
            self.out.write(text + "\n")
            self._last = now
        self.out.flush()

    def end(self) -> None:
        if self._pending:
            self.out.write("\n")
            self._pending = False


def run(
    *,
    url: URL | None,
    jobs: int,
    workers: int,
    concurrency: int,
    rollback_every: int,
    timeout: float,
    out: TextIO,
) -> int:
    """Run the demo; returns 0 when the verification passes, 1 otherwise."""
    printer = _Printer(out)
    server = None
    if url is None:
        from sqla_jobs.embedded import EmbeddedPostgres

        server = EmbeddedPostgres()
        started = time.monotonic()
        server.start()
        server.create_database("sqla_jobs_demo")
        url = sa.make_url(server.url("sqla_jobs_demo"))
        printer.line(
            f"started a throwaway PostgreSQL {server.version} on 127.0.0.1:{server.port} "
            f"in {time.monotonic() - started:.1f}s"
        )
    try:
        return _run(url, jobs, workers, concurrency, rollback_every, timeout, printer)
    finally:
        if server is not None:
            server.stop()
            printer.line("stopped and deleted the throwaway PostgreSQL")


def _run(
    url: URL,
    jobs: int,
    workers: int,
    concurrency: int,
    rollback_every: int,
    timeout: float,
    printer: _Printer,
) -> int:
    from sqla_jobs.migrations import upgrade
    from sqla_jobs.models import Job

    started = time.monotonic()
    upgrade(url)
    engine = sa.create_engine(url, poolclass=NullPool)
    DemoBase.metadata.create_all(engine)
    printer.line(f"applied the migrations in {time.monotonic() - started:.1f}s")

    run_id = secrets.token_hex(4)
    queue = f"demo-{run_id}"
    log_dir = Path(tempfile.mkdtemp(prefix="sqla_jobs_demo_"))
    processes = _start_workers(url, queue, workers, concurrency, log_dir)
    # Every worker up before the first job: one still starting when the drain is over (200
    # jobs take a second) would be stopped before it could handle the signal.
    if not _wait_until_ready(processes, log_dir, READY_TIMEOUT):
        _stop_workers(processes)
        printer.line(
            f"VERIFICATION FAILED: the workers were not all running within {READY_TIMEOUT:g}s "
            f"(worker logs kept in {log_dir})"
        )
        return 1
    printer.line(
        f"started {workers} worker processes x {concurrency} slots on queue {queue} "
        f"(logs in {log_dir})"
    )
    try:
        enqueue_started = time.monotonic()
        enqueued = _enqueue(engine, jobs, queue, run_id, rollback_every, printer)
        enqueue_seconds = time.monotonic() - enqueue_started
        printer.line(
            f"enqueued {len(enqueued.committed_jobs)} jobs in {enqueue_seconds:.2f}s from "
            f"business transactions of {TRANSACTION_SIZE} orders; rolled back "
            f"{enqueued.rolled_back_transactions} transactions "
            f"({len(enqueued.rolled_back_orders)} orders and their jobs)"
        )
        drained = _drain(engine, Job, queue, jobs, timeout, processes, printer)
    finally:
        codes = _stop_workers(processes)
    printer.line(f"workers stopped with exit codes {codes}")
    first, last = _drain_window(engine, run_id) if drained else (None, None)
    if first is not None and last is not None:
        seconds = max((last - first).total_seconds(), 1e-6)
        printer.line(
            f"throughput: {jobs / seconds:,.0f} jobs/s ({jobs} jobs in {seconds:.2f}s, "
            "first shipment to last completion, database clock; lock mode, one job per "
            "transaction)"
        )
    ok = _verify(engine, Job, queue, run_id, enqueued, printer)
    ok = ok and drained and all(code == 0 for code in codes)
    engine.dispose()
    if ok:
        shutil.rmtree(log_dir, ignore_errors=True)
        printer.line("verification passed")
        return 0
    printer.line(f"VERIFICATION FAILED (worker logs kept in {log_dir})")
    return 1


def _start_workers(
    url: URL, queue: str, workers: int, concurrency: int, log_dir: Path
) -> list[subprocess.Popen[bytes]]:
    env = dict(os.environ)
    env["SQLA_JOBS_DATABASE_URL"] = url.render_as_string(hide_password=False)
    processes = []
    for n in range(workers):
        with (log_dir / f"worker-{n}.log").open("wb") as log:
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "sqla_jobs",
                        "--log-level",
                        "WARNING",
                        "worker",
                        "sqla_jobs.demo:registry",
                        "--queues",
                        queue,
                        "--concurrency",
                        str(concurrency),
                        "--batch-size",
                        str(concurrency),
                        "--grace",
                        "10s",
                        "--health-file",
                        str(_health_file(log_dir, n)),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return processes


def _health_file(log_dir: Path, n: int) -> Path:
    return log_dir / f"worker-{n}.health"


def _wait_until_ready(
    processes: list[subprocess.Popen[bytes]], log_dir: Path, timeout: float
) -> bool:
    """Whether every worker wrote its health file (it does once it runs, healthy) within
    ``timeout`` seconds; False at once when one of them exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_health_file(log_dir, n).exists() for n in range(len(processes))):
            return True
        if any(process.poll() is not None for process in processes):
            return False
        time.sleep(0.05)
    return False


def _stop_workers(processes: list[subprocess.Popen[bytes]]) -> list[int | None]:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(p.poll() is None for p in processes):
        time.sleep(0.05)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    return [process.returncode if process.returncode >= 0 else None for process in processes]


def _enqueue(
    engine: sa.Engine, jobs: int, queue: str, run_id: str, rollback_every: int, printer: _Printer
) -> _Enqueued:
    enqueued = _Enqueued()
    transaction = 0
    while len(enqueued.committed_jobs) < jobs:
        transaction += 1
        size = min(TRANSACTION_SIZE, jobs - len(enqueued.committed_jobs))
        roll_back = transaction % rollback_every == 0
        with Session(engine) as session:
            with session.begin():
                orders = [DemoOrder(run=run_id, amount=n) for n in range(size)]
                session.add_all(orders)
                session.flush()  # the orders get their ids
                rows = [
                    ship_order.job({"order": order.id, "run": run_id}, queue=queue)
                    for order in orders
                ]
                session.add_all(rows)
                session.flush()
                order_ids = [order.id for order in orders]
                job_ids = [row.id for row in rows]
                if roll_back:
                    session.rollback()  # the business transaction fails: nothing of it stays
            if roll_back:
                enqueued.rolled_back_orders += order_ids
                enqueued.rolled_back_transactions += 1
            else:
                enqueued.committed_orders += order_ids
                enqueued.committed_jobs += job_ids
        printer.progress(f"enqueued {len(enqueued.committed_jobs)}/{jobs}")
    printer.end()
    return enqueued


def _drain(
    engine: sa.Engine,
    model: type,
    queue: str,
    jobs: int,
    timeout: float,
    processes: list[subprocess.Popen[bytes]],
    printer: _Printer,
) -> bool:
    started = time.monotonic()
    while True:
        with Session(engine) as session:
            counts = {s.status: s.count for s in queue_stats(session, model) if s.queue == queue}
        # queue_stats counts the live jobs only (never the history): what is no longer
        # pending or running has finished.
        unfinished = counts.get(JobStatus.PENDING, 0) + counts.get(JobStatus.RUNNING, 0)
        finished = jobs - unfinished
        done = finished - counts.get(JobStatus.DEAD, 0)
        elapsed = time.monotonic() - started
        printer.progress(
            f"done {done}/{jobs}  running {counts.get(JobStatus.RUNNING, 0)}  "
            f"pending {counts.get(JobStatus.PENDING, 0)}  ({done / max(elapsed, 1e-6):,.0f}/s)",
            force=finished >= jobs,
        )
        if finished >= jobs:
            printer.end()
            return True
        if elapsed > timeout:
            printer.line(f"gave up after {timeout:.0f}s with {jobs - finished} jobs unfinished")
            return False
        if not any(process.poll() is None for process in processes):
            printer.line("every worker process exited; see their logs")
            return False
        time.sleep(0.2)


def _drain_window(engine: sa.Engine, run_id: str) -> tuple[datetime | None, datetime | None]:
    from sqla_jobs.models import Job

    with engine.connect() as connection:
        first = connection.execute(
            sa.select(func.min(DemoShipment.shipped_at)).where(DemoShipment.run == run_id)
        ).scalar_one()
        last = connection.execute(
            sa.select(func.max(Job.finished_at)).where(Job.args["run"].astext == run_id)
        ).scalar_one()
    return first, last


def _verify(
    engine: sa.Engine,
    model: type,
    queue: str,
    run_id: str,
    enqueued: _Enqueued,
    printer: _Printer,
) -> bool:
    from sqla_jobs.models import Job

    committed = set(enqueued.committed_orders)
    rolled_back = set(enqueued.rolled_back_orders)
    with engine.connect() as connection:
        orders = set(
            connection.execute(sa.select(DemoOrder.id).where(DemoOrder.run == run_id)).scalars()
        )
        job_rows = connection.execute(
            sa.select(Job.id, Job.status, Job.args["order"].as_integer()).where(
                Job.args["run"].astext == run_id
            )
        ).all()
        shipments = connection.execute(
            sa.select(DemoShipment.order_id, DemoShipment.job_id).where(DemoShipment.run == run_id)
        ).all()
    jobs_by_order: dict[int, list[int]] = {}
    for job_id, _status, order_id in job_rows:
        jobs_by_order.setdefault(order_id, []).append(job_id)
    shipped: dict[int, int] = {}
    for order_id, _job_id in shipments:
        shipped[order_id] = shipped.get(order_id, 0) + 1
    not_succeeded = [job_id for job_id, status, _ in job_rows if status != "succeeded"]
    checks = [
        (
            f"every committed order is there ({len(committed)})",
            orders == committed,
        ),
        (
            f"every committed order has exactly one job ({len(committed)})",
            set(jobs_by_order) == committed and all(len(v) == 1 for v in jobs_by_order.values()),
        ),
        (
            "every job succeeded",
            not not_succeeded and len(job_rows) == len(committed),
        ),
        (
            (
                "every committed job ran exactly once (one shipment per order, committed "
                "with its completion)"
            ),
            set(shipped) == committed and all(n == 1 for n in shipped.values()),
        ),
        (
            f"no rolled-back order, job or shipment exists ({len(rolled_back)} orders rolled back)",
            not (orders & rolled_back)
            and not (set(jobs_by_order) & rolled_back)
            and not (set(shipped) & rolled_back),
        ),
    ]
    for text, passed in checks:
        printer.line(f"  [{'ok' if passed else 'FAILED'}] {text}")
    if not_succeeded:
        printer.line(f"  jobs not succeeded: {not_succeeded[:10]}")
    return all(passed for _, passed in checks)
