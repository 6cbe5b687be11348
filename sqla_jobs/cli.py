"""The ``sqla-jobs`` command (also ``python -m sqla_jobs``).

::

    sqla-jobs demo                                   # the whole thing on a throwaway server
    sqla-jobs worker myapp.tasks:registry --queues email,billing --concurrency 8
    sqla-jobs status
    sqla-jobs retry 42
    sqla-jobs cancel 43
    sqla-jobs prune --older-than 7d --batch-size 10000
    sqla-jobs history --retention 30d --model myapp.models:EmailJob   # partitioned history

The database URL comes from ``--database-url`` or the ``SQLA_JOBS_DATABASE_URL``
environment variable. Through PgBouncer in transaction mode it needs nothing more: the
commands find out at connect (``--pooler auto``) and turn psycopg's prepared statements off
there; the worker LISTENs on ``--listen-url`` (``SQLA_JOBS_LISTEN_URL``), a direct URL of
the server, or polls. Admin commands work on the default model
(:class:`sqla_jobs.models.Job`) unless ``--model module:Class`` or
``--registry module:registry`` names another.

This is the only place in sqla_jobs that configures logging. Mistakes (a bad URL, a module
that does not import, an unknown job id) end with a one-line message and status 1 (2 for a
bad command line); ``--traceback`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, Final, NoReturn, TextIO

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session

from sqla_jobs import history, queue
from sqla_jobs.errors import SqlaJobsError
from sqla_jobs.events import describe
from sqla_jobs.pooler import POOLER_MODES, unprepared_behind_pooler
from sqla_jobs.registry import Registry
from sqla_jobs.schema import JobMixin, JobStatus
from sqla_jobs.urls import psycopg_url

__all__ = ["DATABASE_URL_VARIABLE", "LISTEN_URL_VARIABLE", "main", "make_engine", "parse_duration"]

DATABASE_URL_VARIABLE: Final = "SQLA_JOBS_DATABASE_URL"
LISTEN_URL_VARIABLE: Final = "SQLA_JOBS_LISTEN_URL"
DEFAULT_MODEL: Final = "sqla_jobs.models:Job"

logger = logging.getLogger(__name__)


class CommandError(Exception):
    """A mistake on the command line or in what it names: reported as one line."""


# -- helpers shared by the commands ---------------------------------------------------------

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*")
_UNITS: Final = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``90``, ``90s``, ``15m``, ``2h``, ``7d``, ``1w`` (seconds when no unit is given)."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30s, 15m, 2h or 7d")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    return timedelta(seconds=seconds)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    return parse_duration(text).total_seconds()


def database_url(value: str | None, variable: str = DATABASE_URL_VARIABLE) -> URL:
    """The URL from ``--database-url`` or the environment, with the psycopg 3 driver."""
    raw = value or os.environ.get(variable, "").strip()
    if not raw:
        raise CommandError(
            f"no database URL: pass --database-url or set {variable} "
            "(e.g. postgresql://user@localhost/app)"
        )
    try:
        url = psycopg_url(raw)
    except ArgumentError:
        raise CommandError(f"{raw!r} is not a database URL") from None
    if url.get_backend_name() != "postgresql":
        raise CommandError(f"sqla_jobs needs PostgreSQL, not {url.get_backend_name()!r}")
    if url.get_driver_name() != "psycopg":
        raise CommandError(f"use the psycopg (3) driver: postgresql+psycopg://, not {raw!r}")
    return url


def make_engine(
    url: URL,
    *,
    pool_size: int = 5,
    application_name: str = "sqla-jobs",
    pooler: str = "auto",
) -> Engine:
    """An engine for the command line's work: pre-ping (survives server restarts), TCP
    keepalives (notices a vanished server), a connect timeout. Behind a connection pooler
    (``pooler="transaction"``, or found at connect with ``"auto"``:
    :func:`sqla_jobs.pooler.unprepared_behind_pooler`), psycopg prepares no statements."""
    connect_args: dict[str, Any] = {
        "connect_timeout": 10,
        "application_name": application_name,
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    if pooler == "transaction":
        connect_args["prepare_threshold"] = None
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args=connect_args,
    )
    if pooler == "auto":
        unprepared_behind_pooler(engine)
    return engine


def load_object(target: str, what: str) -> Any:
    """Import ``module:attribute`` (the attribute may be dotted), with the current
    directory importable as ``python -m`` would have it (``sqla-jobs worker app:registry``
    run next to ``app.py``)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise CommandError(f"{what} must look like module:name, not {target!r}")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise CommandError(
                f"cannot import {module_name!r}: no module named {exc.name!r} "
                "(is it in the current directory or on PYTHONPATH?)"
            ) from exc
        raise CommandError(f"importing {module_name!r} failed: {describe(exc)}") from exc
    except Exception as exc:
        raise CommandError(
            f"importing {module_name!r} failed: {type(exc).__name__}: {describe(exc)}"
        ) from exc
    missing = object()
    for part in attribute.split("."):
        obj = getattr(obj, part, missing)
        if obj is missing:
            raise CommandError(f"module {module_name!r} has no {attribute!r}")
    return obj


def load_registry(target: str) -> Registry:
    registry = load_object(target, "the registry")
    if not isinstance(registry, Registry):
        raise CommandError(f"{target} is a {type(registry).__name__}, not a sqla_jobs Registry")
    return registry


def load_model(args: argparse.Namespace) -> type[JobMixin]:
    if getattr(args, "registry", None):
        return load_registry(args.registry).model
    target = getattr(args, "model", None) or DEFAULT_MODEL
    model = load_object(target, "the model")
    if not (isinstance(model, type) and issubclass(model, JobMixin)):
        raise CommandError(f"{target} is not a model class that mixes in JobMixin")
    return model


# -- logging ----------------------------------------------------------------------------------

_RECORD_FIELDS: Final = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_FIELDS}


class TextFormatter(logging.Formatter):
    """``time level logger: message  key=value ...`` with the record's structured extras."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = _extras(record)
        if extras:
            text += "  " + " ".join(f"{k}={_plain(v)}" for k, v in extras.items())
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every extra."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _plain(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    text = str(value)
    return json.dumps(text) if " " in text or not text else text


def configure_logging(level: str, style: str, stream: TextIO | None = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if style == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# -- commands ----------------------------------------------------------------------------------


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
            history_retention=args.history_retention,
        )
        return worker.run()
    finally:
        engine.dispose()
        if listen_engine is not None:
            listen_engine.dispose()


def _queue_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CommandError("--queues needs at least one queue name")
    return names


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def cmd_status(args: argparse.Namespace) -> int:
    model = load_model(args)
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    try:
        with Session(engine) as session, session.begin():
            stats = queue.queue_stats(session, model)
            dead = queue.dead_jobs(session, model, limit=args.dead)
    finally:
        engine.dispose()
    out = sys.stdout
    statuses = list(JobStatus)
    by_queue: dict[str, dict[JobStatus, int]] = {}
    oldest: dict[str, float | None] = {}
    for stat in stats:
        by_queue.setdefault(stat.queue, {})[stat.status] = stat.count
        if stat.oldest_pending_seconds is not None:
            oldest[stat.queue] = max(oldest.get(stat.queue) or 0.0, stat.oldest_pending_seconds)
    name = model.__tablename__  # type: ignore[attr-defined]
    if not by_queue:
        out.write(f"{name}: no jobs\n")
        return 0
    header = ["queue", *(s.value for s in statuses), "oldest pending"]
    rows = [
        [q, *(str(counts.get(s, 0)) for s in statuses), _age(oldest.get(q))]
        for q, counts in sorted(by_queue.items())
    ]
    if len(rows) > 1:
        totals = [sum(by_queue[q].get(s, 0) for q in by_queue) for s in statuses]
        every = [v for v in oldest.values() if v is not None]
        rows.append(["(all)", *(str(t) for t in totals), _age(max(every) if every else None)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out.write(f"{name}\n")
    for line in [header, *rows]:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        out.write("\n")
    total_dead = sum(counts.get(JobStatus.DEAD, 0) for counts in by_queue.values())
    if total_dead:
        shown = f"the {len(dead)} most recent" if total_dead > len(dead) else "all"
        out.write(f"\ndead jobs ({total_dead}; {shown}):\n")
        for row in dead:
            finished = row.finished_at.isoformat(timespec="seconds") if row.finished_at else "-"
            out.write(
                f"  {row.id}  {row.queue}/{row.task}  attempts={row.attempts}  "
                f"finished={finished}  {_last_line(row.last_error)[:160]}\n"
            )
        out.write("retry one with: sqla-jobs retry ID\n")
    return 0


def _admin(args: argparse.Namespace, operation: Callable[..., None], done: str) -> int:
    model = load_model(args)
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    try:
        with Session(engine) as session, session.begin():
            operation(session, model, args.job_id)
    finally:
        engine.dispose()
    sys.stdout.write(f"job {args.job_id} {done}\n")
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    return _admin(args, queue.retry, "is pending again")


def cmd_cancel(args: argparse.Namespace) -> int:
    return _admin(args, queue.cancel, "is cancelled")


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
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    try:
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
    finally:
        engine.dispose()
    _history_report(report)
    if not (report.created or report.dropped or report.moved or report.skipped):
        sys.stdout.write("the history is up to date\n")
    return 0


def _prune_history(args: argparse.Namespace, model: type[JobMixin]) -> int:
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    try:
        report = history.drop_partitions(
            engine, model, older_than=args.older_than, batch_size=args.batch_size
        )
    finally:
        engine.dispose()
    _history_report(report)
    sys.stdout.write(
        f"pruned the history of {model.__name__}: {len(report.dropped)} partitions older than "
        f"{_age(args.older_than.total_seconds())} dropped\n"
    )
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    model = load_model(args)
    if history.has_history(model):
        return _prune_history(args, model)
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    total = 0
    started = time.monotonic()
    progress = sys.stderr
    live = progress.isatty()
    try:
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
        engine.dispose()
        if live and total:
            progress.write("\n")
    sys.stdout.write(
        f"pruned {total} finished jobs older than {_age(args.older_than.total_seconds())}\n"
    )
    return 0


def _quiet_alembic(args: argparse.Namespace) -> None:
    if args.log_level == "INFO":  # Alembic narrates every migration at INFO
        logging.getLogger("alembic").setLevel(logging.WARNING)


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


# -- parser --------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sqla-jobs",
        description="A PostgreSQL job queue on SQLAlchemy: workers and administration.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level (default INFO)",
    )
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="log line format"
    )
    parser.add_argument(
        "--traceback", action="store_true", help="show tracebacks instead of one-line errors"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    db = _Parser(add_help=False)
    db.add_argument(
        "--database-url",
        metavar="URL",
        help=f"PostgreSQL URL (default: ${DATABASE_URL_VARIABLE})",
    )
    db.add_argument(
        "--pooler",
        choices=POOLER_MODES,
        default="auto",
        help="a connection pooler in transaction mode (PgBouncer) between here and "
        "PostgreSQL: found out at connect (auto, the default), assumed (transaction), or "
        "assumed absent (none); behind one, no prepared statements and no session state",
    )
    which = _Parser(add_help=False)
    group = which.add_mutually_exclusive_group()
    group.add_argument(
        "--model", metavar="MODULE:CLASS", help=f"job model (default {DEFAULT_MODEL})"
    )
    group.add_argument("--registry", metavar="MODULE:REGISTRY", help="use this registry's model")

    worker = commands.add_parser(
        "worker", parents=[db], help="run jobs", description="Claim and run jobs until stopped."
    )
    worker.add_argument("target", metavar="MODULE:REGISTRY", help="the task registry to run")
    worker.add_argument("--queues", help="comma-separated queues (default: the registry's)")
    worker.add_argument("--concurrency", type=_positive_int, default=4, help="jobs at once")
    worker.add_argument("--batch-size", type=_positive_int, help="most jobs per claim")
    worker.add_argument(
        "--poll-interval", type=_seconds, default=1.0, help="poll period, e.g. 1s (default 1s)"
    )
    worker.add_argument(
        "--grace", type=_seconds, default=30.0, help="time for running jobs at shutdown (30s)"
    )
    wakeups = worker.add_mutually_exclusive_group()
    wakeups.add_argument("--no-listen", action="store_true", help="poll only, no LISTEN/NOTIFY")
    wakeups.add_argument(
        "--listen-url",
        metavar="URL",
        help="a direct URL of the server to LISTEN on, when the database URL goes through "
        f"a pooler such as PgBouncer (default: ${LISTEN_URL_VARIABLE}; without one, "
        "a worker behind a pooler polls)",
    )
    worker.add_argument("--name", help="worker name recorded on its jobs (default host:pid)")
    worker.add_argument("--health-file", metavar="PATH", help="touched every second if healthy")
    worker.add_argument(
        "--async-commit",
        action="store_true",
        help="the worker's own transactions commit with synchronous_commit=off (see README)",
    )
    worker.add_argument(
        "--lock-timeout",
        type=_seconds,
        default=5.0,
        help="lock_timeout of the worker's own connections (5s)",
    )
    worker.add_argument(
        "--history-retention",
        type=parse_duration,
        help="for a model with partitioned_history: drop history partitions older, e.g. 30d",
    )
    worker.set_defaults(handler=cmd_worker)

    status = commands.add_parser("status", parents=[db, which], help="job counts and dead jobs")
    status.add_argument("--dead", type=_positive_int, default=10, help="dead jobs to list")
    status.set_defaults(handler=cmd_status)

    for name, handler, text in (
        ("retry", cmd_retry, "make a dead or cancelled job pending again"),
        ("cancel", cmd_cancel, "cancel a pending job"),
    ):
        sub = commands.add_parser(name, parents=[db, which], help=text, description=text)
        sub.add_argument("job_id", metavar="ID", type=_positive_int)
        sub.set_defaults(handler=handler)

    prune = commands.add_parser(
        "prune",
        parents=[db, which],
        help="delete old finished jobs, in batches",
        description=(
            "Delete the succeeded, dead and cancelled jobs that finished more than "
            "--older-than ago: one batch per transaction, repeated until a batch comes "
            "back short."
        ),
    )
    prune.add_argument("--older-than", type=parse_duration, required=True, help="e.g. 7d, 12h, 30m")
    prune.add_argument(
        "--batch-size",
        type=_positive_int,
        default=10_000,
        help="jobs deleted per transaction; batches repeat until none is left (10000)",
    )
    prune.set_defaults(handler=cmd_prune)

    keep = commands.add_parser(
        "history",
        parents=[db, which],
        help="keep a partitioned history: partitions ahead, moves, retention",
        description=(
            "For a model with partitioned_history: create the day partitions from today to "
            "--days-ahead days ahead, move finished jobs still in the job table into the "
            "history (with their results, given --registry with a result model), and with "
            "--retention drop the partitions older than it. Safe to run beside workers and "
            "other runs (they skip each other); what could not get its lock is left for the "
            "next run. --list shows the partitions instead."
        ),
    )
    keep.add_argument("--retention", type=parse_duration, help="drop partitions older, e.g. 30d")
    keep.add_argument(
        "--days-ahead",
        type=int,
        metavar="N",
        default=history.DEFAULT_DAYS_AHEAD,
        help=f"day partitions made ahead of today ({history.DEFAULT_DAYS_AHEAD})",
    )
    keep.add_argument(
        "--lock-timeout",
        type=_seconds,
        default=history.DEFAULT_LOCK_TIMEOUT,
        help="how long partition DDL waits for its lock before leaving it for the next run "
        f"({history.DEFAULT_LOCK_TIMEOUT:g}s)",
    )
    keep.add_argument("--list", action="store_true", help="list the partitions and stop")
    keep.set_defaults(handler=cmd_history)

    demo = commands.add_parser(
        "demo",
        help="enqueue and drain jobs on a throwaway PostgreSQL, and verify the result",
        description=(
            "Start an embedded PostgreSQL (or use --database-url), apply the migrations, "
            "enqueue jobs from business transactions (some rolled back), drain them with "
            "several worker processes and verify that every committed job ran exactly once."
        ),
    )
    demo.add_argument("--database-url", metavar="URL", help="use this server instead")
    demo.add_argument("--jobs", type=_positive_int, default=2000, help="jobs to enqueue (2000)")
    demo.add_argument("--workers", type=_positive_int, default=2, help="worker processes")
    demo.add_argument("--concurrency", type=_positive_int, default=4, help="per worker")
    demo.add_argument(
        "--rollback-every",
        type=_positive_int,
        default=5,
        help="roll back every Nth business transaction (default 5)",
    )
    demo.add_argument("--timeout", type=_seconds, default=300.0, help="give up after (300s)")
    demo.set_defaults(handler=cmd_demo)

    bench = commands.add_parser(
        "bench",
        add_help=False,
        help="measure enqueue, drain, wake-up, history and memory against the bare-SQL ceiling",
        description="Run `sqla-jobs bench --help` for the benchmark's own options.",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sqla-jobs``; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":
        # The benchmark parses its own options (sqla_jobs.bench.main).
        args.bench_args = [*unknown, *args.bench_args]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(args.log_level, args.log_format)
    try:
        status: int = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except (CommandError, SqlaJobsError, SQLAlchemyError, OSError) as exc:
        if args.traceback:
            raise
        sys.stderr.write(f"sqla-jobs: error: {_error_line(exc)}\n")
        return 1
    return status


def _error_line(exc: BaseException) -> str:
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        reason = describe(exc.orig)
        if exc.connection_invalidated or "connect" in reason.lower():
            return f"cannot reach the database: {reason}"
        return f"database error: {reason}"
    if isinstance(exc, SQLAlchemyError):
        return re.sub(r"\s*\(Background on this error at: \S+\)", "", describe(exc))
    return describe(exc)
