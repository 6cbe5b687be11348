"""``sqla-jobs worker``."""

from __future__ import annotations

import argparse
import os

from sqla_jobs.cli.arguments import _queue_list
from sqla_jobs.cli.database import LISTEN_URL_VARIABLE, database_url, make_engine
from sqla_jobs.cli.loading import load_registry


def cmd_worker(args: argparse.Namespace) -> int:
    from sqla_jobs.worker import Worker

    registry = load_registry(args.target)
    url = database_url(args.database_url)
    queues = _queue_list(args.queues) if args.queues else None
    engine = make_engine(
        url,
        pool_size=args.concurrency + 4,
        application_name="sqla-jobs worker",
        pooler=args.pooler,
    )
    listen_url = args.listen_url or os.environ.get(LISTEN_URL_VARIABLE, "").strip()
    listen_engine = None
    if listen_url and not args.no_listen:
        listen_engine = make_engine(
            database_url(listen_url, LISTEN_URL_VARIABLE),
            pool_size=1,
            application_name="sqla-jobs worker",
            pooler="none",
        )
    try:
        worker = Worker(
            registry,
            engine,
            queues=queues,
            concurrency=args.concurrency,
            batch_size=args.batch_size,
            prefetch=args.prefetch,
            poll_interval=args.poll_interval,
            grace=args.grace,
            listen=not args.no_listen,
            name=args.name,
            health_file=args.health_file,
            lock_timeout=args.lock_timeout,
            synchronous_commit=not args.async_commit,
            handle_signals=True,
            listen_engine=listen_engine,
            pooler=args.pooler,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            history_retention=args.history_retention,
            history_partitions=not args.no_history_partitions,
        )
        return worker.run()
    finally:
        engine.dispose()
        if listen_engine is not None:
            listen_engine.dispose()
