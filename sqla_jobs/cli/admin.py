"""``sqla-jobs retry``, ``cancel`` and ``prune``: one job, or the old finished ones."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from sqla_jobs import history, queue
from sqla_jobs.cli.database import command_engine, command_session
from sqla_jobs.cli.display import _age
from sqla_jobs.cli.history import _history_report
from sqla_jobs.cli.loading import load_model
from sqla_jobs.schema import JobMixin, JobStatus


def _admin(args: argparse.Namespace, operation: Callable[..., None], done: str) -> int:
    model = load_model(args)
    with command_session(args) as session:
        operation(session, model, args.job_id)
    sys.stdout.write(f"job {args.job_id} {done}\n")
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    return _admin(args, queue.retry, "is pending again")


def cmd_cancel(args: argparse.Namespace) -> int:
    model = load_model(args)
    with command_session(args) as session:
        status = queue.cancel(session, model, args.job_id)
    if status is JobStatus.RUNNING:
        sys.stdout.write(f"job {args.job_id} is running: its worker was asked to cancel it\n")
    else:
        sys.stdout.write(f"job {args.job_id} is cancelled\n")
    return 0


def _prune_history(args: argparse.Namespace, model: type[JobMixin]) -> int:
    with command_engine(args) as engine:
        report = history.drop_partitions(
            engine, model, older_than=args.older_than, batch_size=args.batch_size
        )
    _history_report(report)
    sys.stdout.write(
        f"pruned the history of {model.__name__}: {len(report.dropped)} partitions older than "
        f"{_age(args.older_than.total_seconds())} dropped\n"
    )
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    model = load_model(args)
    if history.has_history(model):
        status = _prune_history(args, model)
        _prune_rates(args, model)
        return status
    total = 0
    started = time.monotonic()
    progress = sys.stderr
    live = progress.isatty()
    try:
        with command_engine(args) as engine:
            while True:
                with Session(engine) as session, session.begin():
                    deleted = queue.prune(
                        session, model, older_than=args.older_than, limit=args.batch_size
                    )
                total += deleted
                if deleted:
                    rate = total / max(time.monotonic() - started, 1e-6)
                    line = f"pruned {total} jobs ({rate:.0f}/s)"
                    progress.write(f"\r{line}" if live else f"{line}\n")
                    progress.flush()
                if deleted < args.batch_size:
                    break
    finally:
        if live and total:
            progress.write("\n")
    sys.stdout.write(
        f"pruned {total} finished jobs older than {_age(args.older_than.total_seconds())}\n"
    )
    _prune_rates(args, model)
    return 0


def _prune_rates(args: argparse.Namespace, model: type[JobMixin]) -> None:
    # The rows of the rate table whose windows are empty (keys that went idle), if any.
    total = 0
    with command_engine(args) as engine:
        while True:
            with Session(engine) as session, session.begin():
                deleted = queue.prune_rates(session, model, limit=args.batch_size)
            total += deleted
            if deleted < args.batch_size:
                break
    if total:
        sys.stdout.write(f"pruned {total} idle rows of the rate table\n")
