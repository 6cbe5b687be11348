"""The ``sqla-jobs`` command (also ``python -m sqla_jobs``).

::

    sqla-jobs demo                                   # the whole thing on a throwaway server
    sqla-jobs worker myapp.tasks:registry --queues email,billing --concurrency 8
    sqla-jobs status
    sqla-jobs health --max-oldest-runnable 60s --max-dead 100 --max-xmin-age 10m
    sqla-jobs retry 42
    sqla-jobs cancel 43
    sqla-jobs prune --older-than 7d --batch-size 10000
    sqla-jobs dashboard --port 8400                  # the web dashboard (extra: dashboard)
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
import ipaddress
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

from sqla_jobs import health, history, queue, statements
from sqla_jobs.errors import SqlaJobsError
from sqla_jobs.events import describe
from sqla_jobs.pooler import POOLER_MODES, unprepared_behind_pooler
from sqla_jobs.registry import Registry
from sqla_jobs.schema import JobMixin, JobResultMixin, JobStatus
from sqla_jobs.urls import psycopg_url

__all__ = ["DATABASE_URL_VARIABLE", "LISTEN_URL_VARIABLE", "main", "make_engine", "parse_duration"]

DATABASE_URL_VARIABLE: Final = "SQLA_JOBS_DATABASE_URL"
LISTEN_URL_VARIABLE: Final = "SQLA_JOBS_LISTEN_URL"
DEFAULT_MODEL: Final = "sqla_jobs.models:Job"
DASHBOARD_TOKEN_VARIABLE: Final = "SQLA_JOBS_DASHBOARD_TOKEN"

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


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_count = _int_at_least(0)


def _seconds(text: str) -> float:
    return parse_duration(text).total_seconds()


def _timeout(text: str) -> float:
    seconds = _seconds(text)
    if not 0 < seconds <= 300:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 300s, got {text!r}")
    return seconds


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


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
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
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


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def _read_gauges(
    args: argparse.Namespace, model: type[JobMixin], dead: int = 0
) -> tuple[health.Gauges, list[queue.DeadJob]]:
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    try:
        with Session(engine) as session, session.begin():
            timeout = f"{max(1, round(args.timeout * 1000))}ms"
            session.execute(statements.statement_timeout(), {"timeout": timeout})
            gauges = health.read_gauges(session, model)
            listed = queue.dead_jobs(session, model, limit=dead) if dead and gauges.dead else []
    finally:
        engine.dispose()
    return gauges, listed


def cmd_status(args: argparse.Namespace) -> int:
    model = load_model(args)
    gauges, dead = _read_gauges(args, model, dead=args.dead)
    out = sys.stdout
    table = gauges.table
    out.write(f"{table.table}\n")
    if gauges.queues:
        header = ["queue", "pending", "runnable", "running", "expired", "dead", "oldest runnable"]
        rows = [
            [
                q.queue,
                str(q.pending),
                str(q.runnable),
                str(q.running),
                str(q.expired_leases),
                str(q.dead),
                _age(q.oldest_runnable_seconds),
            ]
            for q in gauges.queues
        ]
        if len(rows) > 1:
            rows.append(
                [
                    "(all)",
                    str(gauges.pending),
                    str(gauges.runnable),
                    str(gauges.running),
                    str(gauges.expired_leases),
                    str(gauges.dead),
                    _age(gauges.oldest_runnable_seconds),
                ]
            )
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for line in [header, *rows]:
            cells = zip(line, widths, strict=True)
            out.write("  ".join(cell.ljust(w) for cell, w in cells).rstrip() + "\n")
    else:
        out.write("no pending, running or dead jobs\n")
    estimate = (
        "-"
        if table.estimated_rows is None or table.estimated_rows < 0
        else (f"~{table.estimated_rows}")
    )
    out.write(
        f"\ntable: {estimate} rows with history (estimate), {table.dead_tuples} dead row "
        f"versions, {_bytes(table.table_bytes)}; indexes {_bytes(table.indexes_bytes)} (pending "
        f"{_bytes(table.pending_index_bytes)}, running {_bytes(table.running_index_bytes)}, "
        f"dead {_bytes(table.dead_index_bytes)}); last vacuum "
        f"{_age(table.vacuum_age_seconds)}{'' if table.vacuum_age_seconds is None else ' ago'}\n"
    )
    holder = gauges.oldest_xmin
    out.write(f"oldest snapshot holding back vacuum: {holder if holder else 'none'}\n")
    if gauges.dead:
        shown = f"the {len(dead)} most recent" if gauges.dead > len(dead) else "all"
        out.write(f"\ndead jobs ({gauges.dead}; {shown}):\n")
        for row in dead:
            finished = row.finished_at.isoformat(timespec="seconds") if row.finished_at else "-"
            out.write(
                f"  {row.id}  {row.queue}/{row.task}  attempts={row.attempts}  "
                f"finished={finished}  {_last_line(row.last_error)[:160]}\n"
            )
        out.write("retry one with: sqla-jobs retry ID\n")
    return 0


#: ``sqla-jobs health`` exit statuses (the README's table).
HEALTHY: Final = 0
UNHEALTHY: Final = 3


def cmd_health(args: argparse.Namespace) -> int:
    thresholds = health.Thresholds(
        max_oldest_runnable=args.max_oldest_runnable,
        max_runnable=args.max_runnable,
        max_expired_leases=args.max_expired_leases,
        max_dead=args.max_dead,
        max_xmin_age=args.max_xmin_age,
        max_dead_tuples=args.max_dead_tuples,
    )
    model = load_model(args)
    gauges, _ = _read_gauges(args, model)
    problems = thresholds.problems(gauges)
    if problems:
        sys.stdout.write(f"unhealthy: {'; '.join(problems)}\n")
        return UNHEALTHY
    holder = gauges.oldest_xmin
    sys.stdout.write(
        f"healthy: {gauges.runnable} runnable, {gauges.running} running, "
        f"{gauges.expired_leases} expired leases, {gauges.dead} dead; oldest runnable "
        f"{_age(gauges.oldest_runnable_seconds)}; vacuum held back "
        f"{_age(holder.age_seconds if holder else None)}\n"
    )
    return HEALTHY


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
    model = load_model(args)
    engine = make_engine(database_url(args.database_url), pool_size=1, pooler=args.pooler)
    try:
        with Session(engine) as session, session.begin():
            status = queue.cancel(session, model, args.job_id)
    finally:
        engine.dispose()
    if status is JobStatus.RUNNING:
        sys.stdout.write(f"job {args.job_id} is running: its worker was asked to cancel it\n")
    else:
        sys.stdout.write(f"job {args.job_id} is cancelled\n")
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cmd_dashboard(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get(DASHBOARD_TOKEN_VARIABLE, "").strip() or None
    loopback = _is_loopback(args.host)
    if not loopback and token is None:
        raise CommandError(
            f"refusing to serve the dashboard on {args.host} without an access token: set "
            f"{DASHBOARD_TOKEN_VARIABLE} (or pass --token), or bind to 127.0.0.1"
        )
    try:
        import uvicorn

        from sqla_jobs.dashboard import create_app
        from sqla_jobs.dashboard.app import MIN_TOKEN_LENGTH
    except ImportError as exc:
        raise CommandError(
            f"the dashboard needs the 'dashboard' extra ({exc.name} is missing): "
            "pip install 'sqla-jobs[dashboard]'"
        ) from None
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise CommandError(f"the access token must have at least {MIN_TOKEN_LENGTH} characters")
    model = load_model(args)
    result_model = None
    if args.result_model:
        result_model = load_object(args.result_model, "the result model")
        if not (isinstance(result_model, type) and issubclass(result_model, JobResultMixin)):
            raise CommandError(f"{args.result_model} is not a model class mixing in JobResultMixin")
    engine = make_engine(
        database_url(args.database_url),
        pool_size=4,
        application_name="sqla-jobs dashboard",
        pooler=args.pooler,
    )
    hosts = None
    if loopback and token is None:
        # Only the names of this machine: a page of another site that rebinds its own name
        # to 127.0.0.1 (DNS rebinding) gets no answer.
        hosts = ["127.0.0.1", "localhost", "[::1]", "::1"]
    try:
        app = create_app(
            engine,
            model,
            result_model=result_model,
            read_only=args.read_only,
            token=token,
            allowed_hosts=hosts,
        )
        shown = f"[{args.host}]" if ":" in args.host else args.host
        mode = " (read-only)" if args.read_only else ""
        sys.stderr.write(f"sqla-jobs dashboard on http://{shown}:{args.port}/{mode}\n")
        sys.stderr.flush()
        # log_config=None: uvicorn's records go through the logging configured above.
        uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False)
    finally:
        engine.dispose()
    return 0


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
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics on this port (needs the metrics extra; 0: any free port)",
    )
    worker.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics are served on (127.0.0.1; 0.0.0.0 for every interface)",
    )
    worker.add_argument(
        "--history-retention",
        type=parse_duration,
        help="for a model with partitioned_history: drop history partitions older, e.g. 30d",
    )
    worker.set_defaults(handler=cmd_worker)

    status = commands.add_parser(
        "status",
        parents=[db, which],
        help="live job counts, vacuum and table gauges, and dead jobs",
        description=(
            "Pending, runnable, running, expired and dead jobs by queue, the oldest runnable "
            "job's age, the job table's size and dead row versions, and the oldest snapshot "
            "holding back vacuum; read from indexes and statistics only, never the history."
        ),
    )
    status.add_argument("--dead", type=_positive_int, default=10, help="dead jobs to list")
    status.add_argument(
        "--timeout", type=_timeout, default=5.0, help="statement timeout of the reads (5s)"
    )
    status.set_defaults(handler=cmd_status)

    check = commands.add_parser(
        "health",
        parents=[db, which],
        help="exit 3 with a one-line reason when a threshold is crossed",
        description=(
            "Read the health gauges (as `status` does) and compare them with the given "
            "limits; a value above its limit is a problem. Exit status: 0 healthy, 1 the "
            "check could not be made (database unreachable, timeout, bad model), 2 bad "
            "command line, 3 a threshold crossed. One line on stdout says why."
        ),
    )
    check.add_argument(
        "--max-oldest-runnable",
        type=parse_duration,
        metavar="DURATION",
        help="longest a runnable job may wait past its run_at, e.g. 60s",
    )
    check.add_argument(
        "--max-runnable", type=_count, metavar="N", help="most runnable jobs in any one queue"
    )
    check.add_argument(
        "--max-expired-leases",
        type=_count,
        metavar="N",
        help="most running jobs whose lease ran out",
    )
    check.add_argument("--max-dead", type=_count, metavar="N", help="most dead jobs")
    check.add_argument(
        "--max-xmin-age",
        type=parse_duration,
        metavar="DURATION",
        help="longest any snapshot on the server may hold back vacuum, e.g. 10m",
    )
    check.add_argument(
        "--max-dead-tuples",
        type=_count,
        metavar="N",
        help="most dead row versions in the job table",
    )
    check.add_argument(
        "--timeout", type=_timeout, default=5.0, help="statement timeout of the reads (5s)"
    )
    check.set_defaults(handler=cmd_health)

    for name, handler, text in (
        ("retry", cmd_retry, "make a dead or cancelled job pending again"),
        ("cancel", cmd_cancel, "cancel a pending job, or ask a running one's worker to stop it"),
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

    dashboard = commands.add_parser(
        "dashboard",
        parents=[db, which],
        help="serve the web dashboard (extra: dashboard)",
        description=(
            "Serve a web page of the job table: queues, the job list, each job, and retry, "
            "cancel and delete. Binds to 127.0.0.1; anywhere else it needs an access token "
            f"(${DASHBOARD_TOKEN_VARIABLE})."
        ),
    )
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    dashboard.add_argument("--port", type=_port, default=8400, help="port (8400)")
    dashboard.add_argument(
        "--token",
        help=f"access token, 16+ characters (default: ${DASHBOARD_TOKEN_VARIABLE}; the "
        "variable keeps it out of the process list)",
    )
    dashboard.add_argument("--read-only", action="store_true", help="no retry, cancel or delete")
    dashboard.add_argument(
        "--result-model", metavar="MODULE:CLASS", help="show results stored in this model"
    )
    dashboard.set_defaults(handler=cmd_dashboard)
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
