"""The ``processes`` section: handlers in child processes (``process=True``,
:mod:`sqla_jobs.worker.processes`) beside thread handlers.

Two measures, each a worker in this process draining jobs that were enqueued once it was
running and warmed (its children started, its connections open), timed in the database's
clock from the enqueue to the last job finished:

``processes.noop.*``
    no-op jobs through the process pool (``concurrency`` 4, ``processes`` 2) and on threads
    (``concurrency`` 4): what the pool's round trip costs per job (the ratio is the pool's
    rate over the threads').
``processes.cpu.*``
    a CPU-bound handler (a loop of pure Python, about :data:`CRUNCH_LOOPS` iterations) on 2
    threads (the GIL lets one run at a time), in 1 process and in 2 (``concurrency`` 2):
    the ratio of 2 processes over 1 is the scaling, at most the cores the machine has.

Its tasks live at the top level of this module, where the children find them.
"""

from __future__ import annotations

import itertools
from typing import Final

import sqlalchemy as sa

from sqla_jobs.bench import scratch
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import LEASE_SECONDS
from sqla_jobs.context import JobContext
from sqla_jobs.models import Job
from sqla_jobs.registry import Registry
from sqla_jobs.worker import Worker

__all__ = ["CRUNCH_LOOPS", "registry", "run_processes"]

Q_PROCESS_NOOP: Final = "bench_process_noop"
Q_THREAD_NOOP: Final = "bench_thread_noop"
Q_PROCESS_CPU: Final = "bench_process_cpu"
Q_THREAD_CPU: Final = "bench_thread_cpu"
#: The iterations of the CPU-bound handler's loop (some 20 to 50 ms of one core).
CRUNCH_LOOPS: Final = 300_000
_ROUNDS: Final = itertools.count()

registry = Registry(Job, default_lease=LEASE_SECONDS)


@registry.task(queue=Q_PROCESS_NOOP, process=True)
def bench_process_noop(ctx: JobContext) -> None:
    """A no-op job in a child process."""


@registry.task(queue=Q_THREAD_NOOP)
def bench_thread_noop(ctx: JobContext) -> None:
    """A no-op job on a handler thread."""


def crunch(loops: int) -> int:
    """A loop of pure Python: it holds the GIL all along."""
    total = 0
    for i in range(loops):
        total += i * i % 7
    return total


@registry.task(queue=Q_PROCESS_CPU, process=True)
def bench_process_cpu(ctx: JobContext) -> None:
    """The CPU-bound job in a child process."""
    crunch(CRUNCH_LOOPS)


@registry.task(queue=Q_THREAD_CPU)
def bench_thread_cpu(ctx: JobContext) -> None:
    """The CPU-bound job on a handler thread."""
    crunch(CRUNCH_LOOPS)


def run_processes(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """The ``processes`` section (see the module docstring); the order of the variants
    rotates from one repeat to the next."""
    rotation = next(_ROUNDS)
    noop = [
        ("threads", Q_THREAD_NOOP, bench_thread_noop.name, 4, None),
        ("processes", Q_PROCESS_NOOP, bench_process_noop.name, 4, 2),
    ]
    for label, queue, task, concurrency, processes in _rotated(noop, rotation):
        rate = _drain(cfg, queue, task, cfg.jobs, concurrency, processes)
        ceiling = "processes.noop.threads" if label == "processes" else None
        results.add(f"processes.noop.{label}", rate, "jobs/s", ceiling)
    cpu_jobs = max(4, cfg.single_jobs // 50)
    cpu = [
        ("threads", Q_THREAD_CPU, bench_thread_cpu.name, 2, None),
        ("1", Q_PROCESS_CPU, bench_process_cpu.name, 2, 1),
        ("2", Q_PROCESS_CPU, bench_process_cpu.name, 2, 2),
    ]
    for label, queue, task, concurrency, processes in _rotated(cpu, rotation):
        rate = _drain(cfg, queue, task, cpu_jobs, concurrency, processes)
        ceiling = {"2": "processes.cpu.1", "threads": "processes.cpu.1"}.get(label)
        results.add(f"processes.cpu.{label}", rate, "jobs/s", ceiling)
    scratch.progress("processes (no-op and CPU-bound jobs, threads and child processes)")


def _rotated(
    variants: list[tuple[str, str, str, int, int | None]], rotation: int
) -> list[tuple[str, str, str, int, int | None]]:
    shift = rotation % len(variants)
    return variants[shift:] + variants[:shift]


def _drain(
    cfg: Config, queue: str, task: str, count: int, concurrency: int, processes: int | None
) -> float:
    """Jobs per second of one worker draining ``count`` jobs of ``task`` in ``queue``."""
    engine = scratch.engine(cfg.url, pool_size=concurrency + 5)
    try:
        scratch.reset(engine)
        worker = Worker(
            registry,
            engine,
            queues=[queue],
            concurrency=concurrency,
            processes=processes,
            poll_interval=0.05,
            grace=5,
        )
        with worker:
            # Warm: the children started (each imports this module), the connections open.
            scratch.fill(engine, queue, task, 2 * concurrency)
            scratch.wait_drained(engine, queue, 120)
            started = scratch.db_now(engine)
            scratch.fill(engine, queue, task, count)
            done, last = scratch.wait_drained(engine, queue, 600)
        assert last is not None, queue
        assert done == count + 2 * concurrency, (done, count)
        return count / max((last - started).total_seconds(), 1e-6)
    finally:
        engine.dispose()
