"""Real worker processes for the tests, and a view of the worker tests' database.

Workers run as ``python -m sqla_jobs worker worker_tasks:registry`` with this folder on
``PYTHONPATH`` and a temporary directory as their working directory, so they import the
installed sqla_jobs (never the source tree) and the test tasks by their bare name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from drills import wait_until as wait_until  # the tests import it from here
from drills import worker_env
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool
from worker_tasks import Base, Effect, WorkerJob, WorkerJobResult, registry

from sqla_jobs.worker import Worker


def subprocess_env(url: str, **extra: str) -> dict[str, str]:
    return worker_env(url) | extra


class WorkerProcess:
    """One ``sqla-jobs worker`` process; its log goes to a file."""

    def __init__(self, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def send(self, signum: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signum)

    def stop(self, timeout: float) -> int:
        """SIGTERM (a graceful stop), then the exit status within ``timeout`` seconds."""
        self.send(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.pid} did not exit within {timeout}s; log:\n{self.log_text()[-3000:]}"
            ) from None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_log(self, needle: str, timeout: float = 30.0) -> None:
        # A deadline, not a timing: a worker process starting on a busy machine (the
        # suite's processes and their servers on two cores) took over 10 s on CI.
        try:
            wait_until(
                lambda: needle in self.log_text(),
                timeout=timeout,
                message=f"worker {self.pid} logs {needle!r}",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log:\n{self.log_text()[-3000:]}") from None


class Workers:
    """Starts worker processes and kills whatever is left at the end of a test."""

    def __init__(self, url: str, directory: Path) -> None:
        self.url = url
        self.directory = directory
        self.started: list[WorkerProcess] = []

    def start(
        self,
        *options: str,
        queues: str = "work",
        concurrency: int = 4,
        poll_interval: str = "0.2s",
        grace: str = "5s",
        target: str = "worker_tasks:registry",
    ) -> WorkerProcess:
        log = self.directory / f"worker-{len(self.started)}.log"
        command = [
            sys.executable,
            "-m",
            "sqla_jobs",
            "--log-level",
            "DEBUG",
            "worker",
            target,
            "--queues",
            queues,
            "--concurrency",
            str(concurrency),
            "--poll-interval",
            poll_interval,
            "--grace",
            grace,
            *options,
        ]
        with log.open("wb") as handle:
            popen = subprocess.Popen(
                command,
                cwd=self.directory,
                env=subprocess_env(self.url),
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        process = WorkerProcess(popen, log)
        self.started.append(process)
        return process

    def close(self) -> None:
        for process in self.started:
            if process.alive():
                process.send(signal.SIGCONT)
                process.send(signal.SIGKILL)
            process.popen.wait(10)


class JobDatabase:
    """The worker tests' own database: enqueue, and read back what happened."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = sa.create_engine(url, poolclass=NullPool)
        Base.metadata.create_all(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()

    def enqueue(self, task: str, args: Mapping[str, Any] | None = None, **options: Any) -> int:
        return self.enqueue_many([(task, args)], **options)[0]

    def enqueue_many(
        self, jobs: Sequence[tuple[str, Mapping[str, Any] | None]], **options: Any
    ) -> list[int]:
        with Session(self.engine) as session, session.begin():
            rows = [registry[task].job(args, **options) for task, args in jobs]
            session.add_all(rows)
            session.flush()
            return [row.id for row in rows]

    def job(self, job_id: int) -> WorkerJob:
        with Session(self.engine, expire_on_commit=False) as session:
            job = session.get(WorkerJob, job_id)
            assert job is not None
            return job

    def jobs(self) -> list[WorkerJob]:
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(sa.select(WorkerJob).order_by(WorkerJob.id)))

    def effects(self, job_id: int | None = None, kind: str | None = None) -> list[Effect]:
        query = sa.select(Effect).order_by(Effect.id)
        if job_id is not None:
            query = query.where(Effect.job_id == job_id)
        if kind is not None:
            query = query.where(Effect.kind == kind)
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(query))

    def result(self, job_id: int) -> Any:
        with Session(self.engine) as session:
            row = session.get(WorkerJobResult, job_id)
            return None if row is None else row.value

    def started(self, job_id: int, attempt: int = 1) -> bool:
        return any(e.attempt == attempt for e in self.effects(job_id, "start"))

    def status(self, job_id: int) -> str:
        return self.job(job_id).status

    def count_by_status(self) -> dict[str, int]:
        with self.engine.connect() as connection:
            rows = connection.execute(
                sa.select(WorkerJob.status, sa.func.count()).group_by(WorkerJob.status)
            ).all()
        return {status: int(count) for status, count in rows}

    def all_succeeded(self, total: int) -> bool:
        return self.count_by_status().get("succeeded", 0) == total


Span = tuple[datetime, datetime, int]


def intervals(
    db: JobDatabase, group: Callable[[WorkerJob], str] = lambda job: job.ordering_key or ""
) -> dict[str, list[Span]]:
    """Per group of jobs (by default their ordering key): ``(start, end, job id)`` of every
    attempt whose handler recorded both a ``start`` and an ``end`` effect, by start."""
    groups = {job.id: group(job) for job in db.jobs()}
    starts: dict[tuple[int, int], datetime] = {}
    found: dict[str, list[Span]] = defaultdict(list)
    for effect in db.effects():
        if effect.kind == "start":
            starts[(effect.job_id, effect.attempt)] = effect.at
        elif effect.kind == "end":
            start = starts[(effect.job_id, effect.attempt)]
            found[groups[effect.job_id]].append((start, effect.at, effect.job_id))
    return {name: sorted(spans) for name, spans in found.items()}


def most_at_once(spans: list[Span]) -> int:
    """The most spans open at one instant (one ending as another starts: not together)."""
    events = sorted([(s, 1) for s, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    running = peak = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start (+1)
        running += step
        peak = max(peak, running)
    return peak


@contextmanager
def running(
    db: JobDatabase, *, engine_options: Mapping[str, Any] | None = None, **options: Any
) -> Iterator[Worker]:
    """A :class:`Worker` of ``worker_tasks.registry`` running in a thread of this process,
    healthy; stopped (and its exit status checked) at the end."""
    engine = sa.create_engine(db.url, pool_size=10, pool_pre_ping=True, **(engine_options or {}))
    options = {"concurrency": 4, "poll_interval": 0.2, "grace": 2.0, **options}
    worker = Worker(registry, engine, handle_signals=False, **options)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(worker.run()))
    thread.start()
    try:
        wait_until(worker.is_healthy, timeout=10, message="the worker is healthy")
        yield worker
    finally:
        worker.stop()
        thread.join(20)
        engine.dispose()
    assert status == [0]
