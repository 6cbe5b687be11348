"""The ``sqla-jobs`` argument parser: every command, its options and its handler."""

from __future__ import annotations

import argparse
from typing import NoReturn

from sqla_jobs import history
from sqla_jobs.cli.admin import cmd_cancel, cmd_prune, cmd_retry
from sqla_jobs.cli.arguments import (
    _count,
    _job_id,
    _port,
    _positive_int,
    _seconds,
    _timeout,
    parse_duration,
)
from sqla_jobs.cli.dashboard import DASHBOARD_TOKEN_VARIABLE, cmd_dashboard
from sqla_jobs.cli.database import (
    DATABASE_URL_VARIABLE,
    LISTEN_URL_VARIABLE,
    REPLICA_URL_VARIABLE,
)
from sqla_jobs.cli.history import cmd_history
from sqla_jobs.cli.loading import DEFAULT_MODEL
from sqla_jobs.cli.pausing import cmd_pause, cmd_resume
from sqla_jobs.cli.status import cmd_health, cmd_status
from sqla_jobs.cli.tools import cmd_bench, cmd_demo
from sqla_jobs.cli.worker import cmd_worker
from sqla_jobs.pooler import POOLER_MODES
from sqla_jobs.worker.settings import ClaimSettings, ObservabilitySettings, TimingSettings


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
    _add_pooler(db)
    # The commands that serve or read several databases at once (jobs spread over several
    # primaries): --database-url may be given once per database.
    dbs = _Parser(add_help=False)
    dbs.add_argument(
        "--database-url",
        metavar="URL",
        action="append",
        help=f"PostgreSQL URL (default: ${DATABASE_URL_VARIABLE}); give it once per database "
        "to serve or read several",
    )
    _add_pooler(dbs)
    replica = _Parser(add_help=False)
    replica.add_argument(
        "--replica-url",
        metavar="URL",
        help="read from this read replica (a streaming standby) instead, and show how far "
        f"behind the primary it is (default: ${REPLICA_URL_VARIABLE})",
    )
    which = _Parser(add_help=False)
    group = which.add_mutually_exclusive_group()
    group.add_argument(
        "--model", metavar="MODULE:CLASS", help=f"job model (default {DEFAULT_MODEL})"
    )
    group.add_argument("--registry", metavar="MODULE:REGISTRY", help="use this registry's model")

    worker = commands.add_parser(
        "worker",
        parents=[dbs],
        help="run jobs",
        description=(
            "Claim and run jobs until stopped. With --database-url given once per database, "
            "one process serves them all: a worker for each, with its own connections and "
            "--concurrency slots (a WorkerGroup)."
        ),
    )
    worker.add_argument("target", metavar="MODULE:REGISTRY", help="the task registry to run")
    worker.add_argument("--queues", help="comma-separated queues (default: the registry's)")
    worker.add_argument(
        "--concurrency",
        type=_positive_int,
        help=f"jobs at once (default {ClaimSettings.concurrency})",
    )
    worker.add_argument(
        "--processes",
        type=_positive_int,
        help="child processes for the process tasks, at most --concurrency (default: the "
        "CPU count, at most --concurrency)",
    )
    worker.add_argument("--batch-size", type=_positive_int, help="most jobs per claim")
    worker.add_argument(
        "--prefetch",
        type=_count,
        help="jobs claimed beyond the free slots (default: follows the handlers' rate; 0: none)",
    )
    worker.add_argument(
        "--poll-interval",
        type=_seconds,
        help=f"poll period, e.g. 1s (default {ClaimSettings.poll_interval:g}s)",
    )
    worker.add_argument(
        "--grace",
        type=_seconds,
        help=f"time for running jobs at shutdown ({TimingSettings.grace:g}s)",
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
        help=(
            "the worker's own transactions commit with synchronous_commit=off "
            "(docs/operations/deploying.md)"
        ),
    )
    worker.add_argument(
        "--lock-timeout",
        type=_seconds,
        help=f"lock_timeout of the worker's own connections ({TimingSettings.lock_timeout:g}s)",
    )
    worker.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics on this port (needs the metrics extra; 0: any free port)",
    )
    worker.add_argument(
        "--metrics-host",
        metavar="HOST",
        help=(
            f"address the metrics are served on ({ObservabilitySettings.metrics_host}; "
            "0.0.0.0 for every interface)"
        ),
    )
    worker.add_argument(
        "--history-retention",
        type=parse_duration,
        help="for a model with partitioned_history: drop history partitions older, e.g. 30d",
    )
    worker.add_argument(
        "--no-history-partitions",
        action="store_true",
        help=(
            "for a model with partitioned_history: only move finished jobs, and leave making "
            "and dropping partitions to the history table's owner (sqla-jobs history)"
        ),
    )
    worker.set_defaults(handler=cmd_worker)

    status = commands.add_parser(
        "status",
        parents=[dbs, replica, which],
        help="live job counts, vacuum and table gauges, and dead jobs",
        description=(
            "Pending, runnable, running, expired and dead jobs by queue, the oldest runnable "
            "job's age, the job table's size and dead row versions, and the oldest snapshot "
            "holding back vacuum; read from indexes and statistics only, never the history. "
            "The rate-limited queues' windows; with --registry, its fairly shared queues' "
            "tenants with pending jobs and the deepest of them. With --replica-url, all of "
            "it read from that read replica (no primary URL needed), after a line that says "
            "how far behind the primary it is, or that the URL names a primary."
        ),
    )
    status.add_argument("--dead", type=_positive_int, default=10, help="dead jobs to list")
    status.add_argument(
        "--timeout", type=_timeout, default=5.0, help="statement timeout of the reads (5s)"
    )
    status.set_defaults(handler=cmd_status)

    check = commands.add_parser(
        "health",
        parents=[dbs, which],
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
        sub.add_argument("job_id", metavar="ID", type=_job_id, help="the job's id (its row's id)")
        sub.set_defaults(handler=handler)

    pause = commands.add_parser(
        "pause",
        parents=[db, which],
        help="stop workers from starting a queue's jobs (running ones finish)",
        description=(
            "Pause a queue: from now on no claim, on any worker, starts a job of it (running "
            "jobs finish; enqueueing goes on, the jobs wait). Idempotent; a queue without "
            "jobs can be paused too. `sqla-jobs status` lists the paused queues."
        ),
    )
    pause.add_argument("queue", metavar="QUEUE", help="the queue's name")
    pause.add_argument("--reason", help="why, kept with the pause and shown by status")
    pause.set_defaults(handler=cmd_pause)
    resume = commands.add_parser(
        "resume",
        parents=[db, which],
        help="let workers start a paused queue's jobs again",
        description=(
            "Resume a paused queue: claims start its jobs again, and idle workers serving it "
            "are woken at once. Resuming a queue that is not paused changes nothing."
        ),
    )
    resume.add_argument("queue", metavar="QUEUE", help="the queue's name")
    resume.set_defaults(handler=cmd_resume)

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
        parents=[dbs, replica, which],
        help="serve the web dashboard (extra: dashboard)",
        description=(
            "Serve a web page of the job table: queues, the running jobs, the job list, each "
            "job, and retry, cancel and delete. With --registry, each running job shows the "
            "time left to its task's time limit, each fairly shared queue its tenants with "
            "pending jobs and the deepest of them, and the registry's result model its "
            "results. Binds to 127.0.0.1; anywhere else it needs an access token "
            f"(${DASHBOARD_TOKEN_VARIABLE}). With --replica-url, the pages read from that read "
            "replica and show how far behind the primary it is, and the actions write to the "
            "primary's URL; with a replica URL and no database URL, the dashboard is read-only. "
            "With --database-url given once per database, one dashboard shows them all: a "
            "page of their counts, each named host-port-database, and each one's pages under "
            "/db/NAME/ (not with --replica-url)."
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
        type=int,  # its range, [0, 366], is checked by sqla_jobs.history
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


def _add_pooler(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pooler",
        choices=POOLER_MODES,
        default="auto",
        help="a connection pooler in transaction mode (PgBouncer) between here and "
        "PostgreSQL: found out at connect (auto, the default), assumed (transaction), or "
        "assumed absent (none); behind one, no prepared statements and no session state",
    )
