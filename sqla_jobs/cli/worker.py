"""``sqla-jobs worker``."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from sqla_jobs.cli.arguments import CommandError, _queue_list
from sqla_jobs.cli.database import LISTEN_URL_VARIABLE, database_url, database_urls, make_engine
from sqla_jobs.cli.loading import load_registry


def cmd_worker(args: argparse.Namespace) -> int:
    from sqla_jobs.worker import Worker, WorkerGroup
    from sqla_jobs.worker.settings import (
        ClaimSettings,
        MaintenanceSettings,
        ObservabilitySettings,
        TimingSettings,
    )

    urls = database_urls(args.database_url)
    several = len(urls) > 1
    if several and (args.health_file or args.listen_url):
        raise CommandError(
            "--health-file and --listen-url serve one database: with several --database-url, "
            "run a worker process per database to use them"
        )
    registry = load_registry(args.target)
    # An option left out is left out here too: its default is the setting's own.
    timing = TimingSettings(
        **_given(grace=args.grace, lock_timeout=args.lock_timeout),
        synchronous_commit=not args.async_commit,
    )
    # With several databases the group serves every member's metrics on the one port.
    metrics = _given(metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    observability = ObservabilitySettings(
        **_given(name=args.name, health_file=args.health_file), **({} if several else metrics)
    )
    maintenance = MaintenanceSettings(
        history_retention=args.history_retention,
        history_partitions=not args.no_history_partitions,
    )
    claiming = ClaimSettings(
        queues=_queue_list(args.queues) if args.queues else None,
        **_given(
            concurrency=args.concurrency,
            processes=args.processes,
            batch_size=args.batch_size,
            prefetch=args.prefetch,
            poll_interval=args.poll_interval,
        ),
        listen=not args.no_listen,
        pooler=args.pooler,
    )
    engines = [
        make_engine(
            url,
            pool_size=claiming.concurrency + 4,
            application_name="sqla-jobs worker",
            pooler=args.pooler,
        )
        for url in urls
    ]
    listen_url = args.listen_url or os.environ.get(LISTEN_URL_VARIABLE, "").strip()
    listen_engine = None
    if listen_url and not args.no_listen and not several:
        listen_engine = make_engine(
            database_url(listen_url, LISTEN_URL_VARIABLE),
            pool_size=1,
            application_name="sqla-jobs worker",
            pooler="none",
        )
        claiming = dataclasses.replace(claiming, listen_engine=listen_engine)
    try:
        workers = [
            Worker(
                registry,
                engine,
                claiming=claiming,
                timing=timing,
                observability=observability,
                maintenance=maintenance,
                handle_signals=not several,  # a group handles them for all
            )
            for engine in engines
        ]
        # One database: the worker owns the process. Several: a group of one worker each,
        # which owns it instead (docs/how-to/several-databases.md).
        return workers[0].run() if not several else WorkerGroup(workers, **metrics).run()
    finally:
        for engine in engines:
            engine.dispose()
        if listen_engine is not None:
            listen_engine.dispose()


def _given(**options: Any) -> dict[str, Any]:
    """The options the command line was given (argparse leaves the others None)."""
    return {name: value for name, value in options.items() if value is not None}
