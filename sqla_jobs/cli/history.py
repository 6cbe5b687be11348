"""``sqla-jobs history``: a partitioned history's partitions, moves and retention."""

from __future__ import annotations

import argparse
import sys

from sqla_jobs import history
from sqla_jobs.cli.arguments import CommandError
from sqla_jobs.cli.database import command_engine
from sqla_jobs.cli.loading import load_model, load_registry


def _history_report(report: history.MaintenanceReport) -> None:
    for label, names in (("created", report.created), ("dropped", report.dropped)):
        if names:
            sys.stdout.write(f"{label} {len(names)} partitions: {', '.join(names)}\n")
    if report.moved:
        sys.stdout.write(f"moved {report.moved} finished jobs into the history\n")
    if report.moved_from_default:
        sys.stdout.write(
            f"moved {report.moved_from_default} rows from the default partition into "
            "their day's partition\n"
        )
    if report.default_rows_deleted:
        sys.stdout.write(
            f"deleted {report.default_rows_deleted} old rows of the default partition\n"
        )
    if report.skipped:
        sys.stdout.write(
            f"left for a later run ({len(report.skipped)}; another run held the lock or a "
            f"lock wait timed out): {', '.join(report.skipped)}\n"
        )


def cmd_history(args: argparse.Namespace) -> int:
    model = load_model(args)
    if not history.has_history(model):
        raise CommandError(
            f"{model.__name__} has no partitioned history (set partitioned_history = True)"
        )
    result_model = load_registry(args.registry).result_model if args.registry else None
    with command_engine(args) as engine:
        if args.list:
            for partition in history.list_partitions(engine, model):
                span = (
                    "DEFAULT"
                    if partition.start is None or partition.end is None
                    else f"{partition.start:%Y-%m-%d %H:%M} .. {partition.end:%Y-%m-%d %H:%M} UTC"
                )
                sys.stdout.write(f"{partition.name}  {span}\n")
            return 0
        report = history.maintain(
            engine,
            model,
            retention=args.retention,
            days_ahead=args.days_ahead,
            result_model=result_model,
            lock_timeout=args.lock_timeout,
        )
    _history_report(report)
    if not (report.created or report.dropped or report.moved or report.skipped):
        sys.stdout.write("the history is up to date\n")
    return 0
