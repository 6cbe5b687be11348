"""``sqla-jobs status`` and ``sqla-jobs health``: the health gauges, shown or checked.

``status --replica-url`` reads them from a read replica, with how far behind the primary it
is (:func:`sqla_jobs.health.read_replica_lag`) read in the same transaction, so the lag
printed is the lag of the figures printed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Final

from sqlalchemy.engine import URL

from sqla_jobs import health, queue
from sqla_jobs._queries.admin import STATEMENT_TIMEOUT
from sqla_jobs.cli.arguments import CommandError
from sqla_jobs.cli.database import command_session, database_urls, replica_url
from sqla_jobs.cli.display import _age, _bytes, _last_line
from sqla_jobs.cli.loading import load_model, load_registry
from sqla_jobs.health import QueueGauges
from sqla_jobs.queue.rating import tenant_text
from sqla_jobs.schema import JobMixin
from sqla_jobs.validation import FairShare

#: The deepest tenants a fairly shared queue's status line names.
STATUS_TENANTS: Final = 3


def _read_gauges(
    args: argparse.Namespace,
    url: URL,
    model: type[JobMixin],
    dead: int = 0,
    fair_shares: Mapping[str, FairShare] | None = None,
    replica: bool = False,
) -> tuple[health.Gauges, list[queue.DeadJob], health.ReplicaLag | None]:
    """The gauges and the ``dead`` most recent dead jobs of ``url``'s database, in one
    transaction; with ``replica`` (``url`` is a read replica's), its lag too."""
    with command_session(args, url) as session:
        timeout = f"{max(1, round(args.timeout * 1000))}ms"
        STATEMENT_TIMEOUT.one(session, None, {"timeout": timeout})
        gauges = health.read_gauges(session, model, fair_shares=fair_shares)
        listed = queue.dead_jobs(session, model, limit=dead) if dead and gauges.dead else []
        lag = health.read_replica_lag(session) if replica else None
    return gauges, listed, lag


def _replica_line(url: URL, lag: health.ReplicaLag) -> str:
    """The first line of ``status`` from a replica: how far behind it is, or that the URL
    names a primary."""
    shown = url.render_as_string(hide_password=True)
    if not lag.in_recovery:
        return (
            f"not a replica: {shown} is not in recovery (pg_is_in_recovery() is false), it "
            "is a primary; the figures below are read from it\n"
        )
    return f"read from the replica {shown}: {lag}\n"


def _rate(queue: QueueGauges) -> str:
    """A rate-limited queue's window now, as status tells it."""
    window = f"{queue.rate_limit} per {queue.rate_window_seconds:g} s"
    if queue.rate_started is None:  # per key
        return f"{window} per ordering key; {queue.rate_full_keys} keys full (their jobs wait)"
    held = " (full: its jobs wait)" if queue.rate_started >= (queue.rate_limit or 0) else ""
    return f"{queue.rate_started} of {window} started in the window now{held}"


def _fair(queue: QueueGauges) -> str:
    """A fairly shared queue's tenants now, as status tells it."""
    if not queue.fair_tenants:
        return f"by {queue.fair_column}, no pending jobs"
    many = "tenant" if queue.fair_tenants == 1 else "tenants"
    deepest = ", ".join(
        f"{tenant_text(tenant)} {count:,}" for tenant, count in queue.fair_deepest[:STATUS_TENANTS]
    )
    return (
        f"by {queue.fair_column}, {queue.fair_tenants:,} {many} with pending jobs; "
        f"deepest {deepest}"
    )


def _databases(args: argparse.Namespace) -> list[URL]:
    """The databases a reading command reads: ``--database-url`` once per database (or the
    environment's), checked before anything connects."""
    return database_urls(args.database_url)


def _header(url: URL, several: bool) -> str:
    """The line that names a database, when a command reads several."""
    return f"== {url.render_as_string(hide_password=True)}\n" if several else ""


def cmd_status(args: argparse.Namespace) -> int:
    # Malformed URLs fail first, before anything is imported or connected.
    replica = replica_url(args.replica_url)
    if replica is not None and args.database_url and len(args.database_url) > 1:
        raise CommandError(
            "--replica-url reads one database's replica: give one --database-url with it"
        )
    urls = [replica] if replica is not None else _databases(args)
    # With --registry, its fair shares too: the configuration says which queues are shared.
    registry = load_registry(args.registry) if getattr(args, "registry", None) else None
    model = load_model(args) if registry is None else registry.model
    fair_shares = None if registry is None else registry.fair_shares
    for index, url in enumerate(urls):
        if index:
            sys.stdout.write("\n")
        sys.stdout.write(_header(url, len(urls) > 1))
        _status(args, url, model, fair_shares, replica=replica is not None)
    return 0


def _status(
    args: argparse.Namespace,
    url: URL,
    model: type[JobMixin],
    fair_shares: Mapping[str, FairShare] | None,
    *,
    replica: bool,
) -> None:
    """One database's part of ``status``."""
    gauges, dead, lag = _read_gauges(
        args, url, model, dead=args.dead, fair_shares=fair_shares, replica=replica
    )
    # A standby keeps no statistics of the primary's (dead row versions, vacuums), and its
    # snapshots are its own backends'.
    standby = lag is not None and lag.in_recovery
    out = sys.stdout
    if lag is not None:
        out.write(_replica_line(url, lag))
    table = gauges.table
    out.write(f"{table.table}\n")
    if gauges.queues:
        header = [
            "queue",
            "pending",
            "runnable",
            "running",
            "expired",
            "dead",
            "oldest runnable",
            "paused for",
        ]
        rows = [
            [
                q.queue,
                str(q.pending),
                str(q.runnable),
                str(q.running),
                str(q.expired_leases),
                str(q.dead),
                _age(q.oldest_runnable_seconds),
                _age(q.paused_seconds) if q.paused else "",
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
                    "",
                ]
            )
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for line in [header, *rows]:
            cells = zip(line, widths, strict=True)
            out.write("  ".join(cell.ljust(w) for cell, w in cells).rstrip() + "\n")
        if gauges.paused:
            out.write(
                f"paused: {', '.join(gauges.paused)} (no job of theirs starts until "
                "sqla-jobs resume QUEUE)\n"
            )
        for q in gauges.queues:
            if q.rate_limit is not None:
                out.write(f"rate limit of {q.queue}: {_rate(q)}\n")
        for q in gauges.queues:
            if q.fair_column is not None:
                out.write(f"fair shares of {q.queue}: {_fair(q)}\n")
    else:
        out.write("no pending, running or dead jobs\n")
    estimate = (
        "-"
        if table.estimated_rows is None or table.estimated_rows < 0
        else (f"~{table.estimated_rows}")
    )
    indexes = (
        f"{_bytes(table.table_bytes)}; indexes {_bytes(table.indexes_bytes)} (pending "
        f"{_bytes(table.pending_index_bytes)}, running {_bytes(table.running_index_bytes)}, "
        f"dead {_bytes(table.dead_index_bytes)})"
    )
    holder = gauges.oldest_xmin
    if standby:
        out.write(
            f"\ntable: {estimate} rows with history (estimate), {indexes}; its dead row "
            "versions and last vacuum are the primary's statistics, which a replica does not "
            "keep\n"
        )
        out.write(
            f"oldest snapshot on the replica: {holder if holder else 'none'} (it holds back "
            "the primary's vacuum only with hot_standby_feedback)\n"
        )
    else:
        out.write(
            f"\ntable: {estimate} rows with history (estimate), {table.dead_tuples} dead row "
            f"versions, {indexes}; last vacuum {_age(table.vacuum_age_seconds)}"
            f"{'' if table.vacuum_age_seconds is None else ' ago'}\n"
        )
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
        primary = " (on the primary: --database-url)" if replica else ""
        out.write(f"retry one with: sqla-jobs retry ID{primary}\n")


#: ``sqla-jobs health`` exit statuses (the table of docs/operations/health.md).
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
    urls = _databases(args)
    model = load_model(args)
    status = HEALTHY
    for url in urls:
        # With several databases, each line names its own, and any unhealthy one fails.
        named = f"{url.render_as_string(hide_password=True)}: " if len(urls) > 1 else ""
        gauges, _, _ = _read_gauges(args, url, model)
        problems = thresholds.problems(gauges)
        if problems:
            sys.stdout.write(f"{named}unhealthy: {'; '.join(problems)}\n")
            status = UNHEALTHY
            continue
        holder = gauges.oldest_xmin
        sys.stdout.write(
            f"{named}healthy: {gauges.runnable} runnable, {gauges.running} running, "
            f"{gauges.expired_leases} expired leases, {gauges.dead} dead; oldest runnable "
            f"{_age(gauges.oldest_runnable_seconds)}; vacuum held back "
            f"{_age(holder.age_seconds if holder else None)}"
            f"{'; paused: ' + ', '.join(gauges.paused) if gauges.paused else ''}\n"
        )
    return status
