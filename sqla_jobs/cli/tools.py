"""``sqla-jobs bench`` and ``sqla-jobs demo``: they import what sits on top of the runtime
(the benchmark, the embedded server) only when they run."""

from __future__ import annotations

import argparse
import sys

from sqla_jobs.cli.database import database_url
from sqla_jobs.cli.logs import _quiet_alembic


def cmd_bench(args: argparse.Namespace) -> int:
    from sqla_jobs import bench

    _quiet_alembic(args)
    return bench.main(list(args.bench_args))


def cmd_demo(args: argparse.Namespace) -> int:
    from sqla_jobs import demo

    url = database_url(args.database_url) if args.database_url else None
    _quiet_alembic(args)
    return demo.run(
        url=url,
        jobs=args.jobs,
        workers=args.workers,
        concurrency=args.concurrency,
        rollback_every=args.rollback_every,
        timeout=args.timeout,
        out=sys.stdout,
    )
