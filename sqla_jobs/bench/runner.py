"""The command line: parse the options, start the server, run the sections, print the report.

What it measures and against what: :mod:`sqla_jobs.bench`. One module per section
(:mod:`~sqla_jobs.bench.drain` with :mod:`~sqla_jobs.bench.ceiling`,
:mod:`~sqla_jobs.bench.enqueue`, :mod:`~sqla_jobs.bench.latency`,
:mod:`~sqla_jobs.bench.history`, :mod:`~sqla_jobs.bench.memory`,
:mod:`~sqla_jobs.bench.bouncer`, :mod:`~sqla_jobs.bench.asynchronous`,
:mod:`~sqla_jobs.bench.keys`, :mod:`~sqla_jobs.bench.fair`,
:mod:`~sqla_jobs.bench.workflows`), the report in :mod:`~sqla_jobs.bench.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from typing import Any, Final

from sqla_jobs.bench import partitioned, report, scratch, workers
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.asynchronous import run_async
from sqla_jobs.bench.baseline import check_baseline, run_baseline
from sqla_jobs.bench.bouncer import run_pgbouncer
from sqla_jobs.bench.drain import run_drain
from sqla_jobs.bench.enqueue import run_enqueue
from sqla_jobs.bench.fair import run_fair
from sqla_jobs.bench.history import run_history
from sqla_jobs.bench.keys import run_keys
from sqla_jobs.bench.latency import run_latency
from sqla_jobs.bench.memory import run_memory
from sqla_jobs.bench.processes import run_processes
from sqla_jobs.bench.results import SECTIONS, Config, Results
from sqla_jobs.bench.shape import run_shape
from sqla_jobs.bench.tasks import Q_LEASE
from sqla_jobs.bench.workflows import run_workflows
from sqla_jobs.embedded import EmbeddedPostgres
from sqla_jobs.models import metadata
from sqla_jobs.urls import psycopg_url

__all__ = ["SECTIONS", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sqla-jobs bench",
        description=(
            "Measure sqla_jobs against the simplest correct queue SQL in a plain loop "
            "(see the docs)."
        ),
    )
    parser.add_argument("--database-url", help="a PostgreSQL server (default: embedded)")
    parser.add_argument("--json", metavar="PATH", help="write every raw number here")
    parser.add_argument("--repeat", type=int, help="runs per figure, medians (3)")
    parser.add_argument("--jobs", type=int, help="jobs per batched run (20000)")
    parser.add_argument("--single-jobs", type=int, help="jobs per one-per-claim run (jobs/10)")
    parser.add_argument("--history-rows", type=int, help="finished rows, big case (1000000)")
    parser.add_argument("--memory-jobs", type=int, help="jobs of the long drain (1000000)")
    parser.add_argument(
        "--memory-base-jobs", type=int, help="jobs of the drain it is compared with (50000)"
    )
    parser.add_argument(
        "--concurrency", type=int, help="the batched drains' Worker(concurrency=...) (200)"
    )
    parser.add_argument("--batch", type=int, help="the history and async claim batch (50)")
    parser.add_argument(
        "--sweep", help="the ceiling's batch sizes, comma-separated (1,10,50,100,200,500)"
    )
    parser.add_argument("--chunk", type=int, help="bulk enqueue chunk size (1000)")
    parser.add_argument("--latency-samples", type=int, help="wake-ups measured (200)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run (for tests)")
    parser.add_argument("--only", help=f"comma-separated sections of: {','.join(SECTIONS)}")
    parser.add_argument(
        "--baseline",
        metavar="PATH",
        help="a checkout of another commit (the directory holding its sqla_jobs package): "
        "the baseline section measures this version against it",
    )
    return parser


_QUICK: Final[dict[str, Any]] = {
    "jobs": 300,
    "single_jobs": 30,
    "history_rows": 20_000,
    "memory_jobs": 3_000,
    "memory_base_jobs": 1_000,
    "repeat": 1,
    "concurrency": 20,
    "batch": 10,
    "sweep": (1, 10),
    # Grows past it once or twice (what the test checks), not to the --jobs limit: each
    # point is a loop in spawned processes.
    "sweep_max": 40,
    "chunk": 500,
    "latency_samples": 10,
}
_SIZES: Final = (
    "repeat",
    "jobs",
    "single_jobs",
    "history_rows",
    "memory_jobs",
    "memory_base_jobs",
    "concurrency",
    "batch",
    "chunk",
    "latency_samples",
)


def _config(args: argparse.Namespace, url: str) -> Config:
    cfg = Config(url=url, **(_QUICK if args.quick else {}))
    if not args.quick:
        cfg.single_jobs = max((args.jobs or cfg.jobs) // 10, 1)
    for name in _SIZES:
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                raise _usage(f"--{name.replace('_', '-')} must be positive")
            setattr(cfg, name, value)
    if args.sweep:
        try:
            sweep = tuple(int(size) for size in args.sweep.split(",") if size.strip())
        except ValueError:
            raise _usage("--sweep takes batch sizes, such as 1,10,50") from None
        if not sweep or min(sweep) < 1 or 1 not in sweep or len(sweep) < 2:
            raise _usage("--sweep needs 1 (one per claim) and at least one larger batch size")
        cfg.sweep = tuple(sorted(set(sweep)))
    if args.only:
        chosen = tuple(s.strip() for s in args.only.split(",") if s.strip())
        unknown = set(chosen) - set(SECTIONS)
        if unknown:
            raise _usage(f"unknown sections {sorted(unknown)}; of {SECTIONS}")
        cfg.sections = chosen
    if args.baseline is not None:
        try:
            cfg.baseline = check_baseline(args.baseline)
        except ValueError as exc:
            raise _usage(str(exc)) from None
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table of medians, return 0.

    ``argv`` as for ``sqla-jobs bench`` (default: ``sys.argv[1:]``); bad arguments exit
    with status 2 (argparse's ``SystemExit``)."""
    args = _parser().parse_args(argv)
    _config(args, "postgresql://")  # bad arguments fail before a server starts
    with contextlib.ExitStack() as stack:
        if threading.current_thread() is threading.main_thread():
            # SIGTERM unwinds like Ctrl-C, so the scratch database and server go with us.
            previous = signal.signal(signal.SIGTERM, _terminate)
            stack.callback(signal.signal, signal.SIGTERM, previous)
        if args.database_url:
            # As every sqla-jobs command takes it: postgresql:// means psycopg 3.
            server_url = psycopg_url(args.database_url).render_as_string(hide_password=False)
            server = "url"
        else:
            embedded = EmbeddedPostgres()
            embedded.start()
            stack.callback(embedded.stop)
            server_url, server = embedded.url("postgres"), "embedded"
        url = scratch.scratch_database(server_url, stack)
        cfg = _config(args, url)
        engine = scratch.engine(url, pool_size=10)
        stack.callback(engine.dispose)
        metadata.create_all(engine)
        partitioned.metadata.create_all(engine)
        bench_sql.seed_metadata.create_all(engine)  # the ceiling's own table
        results = Results()
        machine = report.machine(engine, cfg, server)
        scratch.progress(
            f"bench on {machine['version'].split(',')[0]}, sections {','.join(cfg.sections)}"
        )
        for turn in range(cfg.repeat):
            if {"ceiling", "drain"} & set(cfg.sections):
                run_drain(cfg, engine, results)
            if "drain" in cfg.sections:
                # The partitioned history: moves in the completion statement, or by a mover.
                partitioned.run_drains(cfg, engine, results, _history_workers(cfg))
                scratch.progress("history drains")
            if {"ceiling", "enqueue"} & set(cfg.sections):
                run_enqueue(cfg, engine, results)
            if "latency" in cfg.sections:
                run_latency(cfg, engine, results)
            if "pgbouncer" in cfg.sections:
                run_pgbouncer(cfg, engine, results)
            if "async" in cfg.sections:
                run_async(cfg, engine, results)
            if "keys" in cfg.sections:
                run_keys(cfg, engine, results)
            if "fair" in cfg.sections:
                run_fair(cfg, engine, results)
            if "workflows" in cfg.sections:
                run_workflows(cfg, engine, results)
            if "baseline" in cfg.sections:
                run_baseline(cfg, results)
            if "processes" in cfg.sections:
                run_processes(cfg, engine, results)
            if "shape" in cfg.sections:
                run_shape(cfg, engine, results, turn)
        if "history" in cfg.sections:
            run_history(cfg, engine, results)
            partitioned.run_partitioned_history(cfg, engine, results, scratch.progress)
        if "hot" in cfg.sections:
            partitioned.run_hot(
                cfg,
                engine,
                results,
                _history_workers(cfg),
                (scratch.TABLE, "lease", Q_LEASE),
                scratch.progress,
            )
        if "memory" in cfg.sections:
            run_memory(cfg, engine, results)
        print(report.render(results, machine))
        if args.json:
            report.write_json(args.json, cfg, machine, results)
    return 0


def _history_workers(cfg: Config) -> partitioned.Workers:
    def history_workers(which: str, concurrency: int, batch: int) -> Any:
        return workers.workers(cfg, which, 1, concurrency, batch)

    return history_workers


def _usage(message: str) -> SystemExit:
    _parser().print_usage(sys.stderr)
    print(f"sqla-jobs bench: error: {message}", file=sys.stderr)
    return SystemExit(2)


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
