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
the server, or polls. ``status`` and ``dashboard`` read from a read replica (a streaming
standby) given by ``--replica-url`` (``SQLA_JOBS_REPLICA_URL``) and show how far behind it
is; the dashboard's actions still write to the database URL. Admin commands work on the
default model
(:class:`sqla_jobs.models.Job`) unless ``--model module:Class`` or
``--registry module:registry`` names another.

This is the only place in sqla_jobs that configures logging. Mistakes (a bad URL, a module
that does not import, an unknown job id) end with a one-line message and status 1 (2 for a
bad command line); ``--traceback`` shows the traceback instead.

One module per command group, each importing only downward: the shared pieces
(:mod:`~sqla_jobs.cli.arguments`, :mod:`~sqla_jobs.cli.display`, :mod:`~sqla_jobs.cli.logs`,
:mod:`~sqla_jobs.cli.database`, :mod:`~sqla_jobs.cli.loading`), then the commands
(:mod:`~sqla_jobs.cli.worker`, :mod:`~sqla_jobs.cli.status`, :mod:`~sqla_jobs.cli.history`,
:mod:`~sqla_jobs.cli.admin`, :mod:`~sqla_jobs.cli.dashboard`, :mod:`~sqla_jobs.cli.tools`),
then :mod:`~sqla_jobs.cli.parser`, then :func:`main` here.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from sqla_jobs.cli.admin import cmd_cancel as cmd_cancel
from sqla_jobs.cli.admin import cmd_prune as cmd_prune
from sqla_jobs.cli.admin import cmd_retry as cmd_retry
from sqla_jobs.cli.arguments import CommandError as CommandError
from sqla_jobs.cli.arguments import parse_duration as parse_duration
from sqla_jobs.cli.dashboard import DASHBOARD_TOKEN_VARIABLE as DASHBOARD_TOKEN_VARIABLE
from sqla_jobs.cli.dashboard import cmd_dashboard as cmd_dashboard
from sqla_jobs.cli.database import DATABASE_URL_VARIABLE as DATABASE_URL_VARIABLE
from sqla_jobs.cli.database import LISTEN_URL_VARIABLE as LISTEN_URL_VARIABLE
from sqla_jobs.cli.database import REPLICA_URL_VARIABLE as REPLICA_URL_VARIABLE
from sqla_jobs.cli.database import database_url as database_url
from sqla_jobs.cli.database import make_engine as make_engine
from sqla_jobs.cli.history import cmd_history as cmd_history
from sqla_jobs.cli.loading import DEFAULT_MODEL as DEFAULT_MODEL
from sqla_jobs.cli.loading import load_model as load_model
from sqla_jobs.cli.loading import load_object as load_object
from sqla_jobs.cli.loading import load_registry as load_registry
from sqla_jobs.cli.logs import JsonFormatter as JsonFormatter
from sqla_jobs.cli.logs import TextFormatter as TextFormatter
from sqla_jobs.cli.logs import configure_logging as configure_logging
from sqla_jobs.cli.parser import build_parser as build_parser
from sqla_jobs.cli.status import HEALTHY as HEALTHY
from sqla_jobs.cli.status import UNHEALTHY as UNHEALTHY
from sqla_jobs.cli.status import cmd_health as cmd_health
from sqla_jobs.cli.status import cmd_status as cmd_status
from sqla_jobs.cli.tools import cmd_bench as cmd_bench
from sqla_jobs.cli.tools import cmd_demo as cmd_demo
from sqla_jobs.cli.worker import cmd_worker as cmd_worker
from sqla_jobs.errors import SqlaJobsError
from sqla_jobs.events import describe

__all__ = [
    "DATABASE_URL_VARIABLE",
    "LISTEN_URL_VARIABLE",
    "REPLICA_URL_VARIABLE",
    "main",
    "make_engine",
    "parse_duration",
]

logger = logging.getLogger(__name__)


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
    if isinstance(exc, SqlaJobsError):
        # Ours, written to be read whole (a schema refusal names every helper to run): one
        # line, never cut short as another library's message is.
        return " ".join(str(exc).split())
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        reason = describe(exc.orig)
        if exc.connection_invalidated or "connect" in reason.lower():
            return f"cannot reach the database: {reason}"
        return f"database error: {reason}"
    if isinstance(exc, SQLAlchemyError):
        return re.sub(r"\s*\(Background on this error at: \S+\)", "", describe(exc))
    return describe(exc)
