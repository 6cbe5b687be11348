"""``sqla-jobs dashboard``: the web dashboard (extra: dashboard).

With ``--replica-url`` (or ``$SQLA_JOBS_REPLICA_URL``) the pages read from that read replica
and show its lag, and the actions write through the database URL; given a replica and no
database URL, the dashboard is read-only: it has nothing to write to."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Final

from sqla_jobs.cli.arguments import CommandError
from sqla_jobs.cli.database import database_url, has_database_url, make_engine, replica_url
from sqla_jobs.cli.loading import load_model, load_object, load_registry
from sqla_jobs.schema import JobResultMixin

DASHBOARD_TOKEN_VARIABLE: Final = "SQLA_JOBS_DASHBOARD_TOKEN"


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
    time_limits = None
    fair_shares = None
    if args.registry:  # its tasks' time limits, its fair shares, and its result model
        registry = load_registry(args.registry)
        time_limits = registry.time_limits
        fair_shares = registry.fair_shares
        result_model = registry.result_model  # unless one is named
    if args.result_model:
        result_model = load_object(args.result_model, "the result model")
        if not (isinstance(result_model, type) and issubclass(result_model, JobResultMixin)):
            raise CommandError(f"{args.result_model} is not a model class mixing in JobResultMixin")
    # The URLs, checked before anything connects.
    replica = replica_url(args.replica_url)
    primary = (
        database_url(args.database_url)
        if replica is None or has_database_url(args.database_url)
        else None
    )
    read_only = args.read_only or primary is None
    engine = None
    if primary is not None:
        engine = make_engine(
            primary, pool_size=4, application_name="sqla-jobs dashboard", pooler=args.pooler
        )
    replica_engine = None
    if replica is not None:
        replica_engine = make_engine(
            replica, pool_size=4, application_name="sqla-jobs dashboard", pooler=args.pooler
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
            replica=replica_engine,
            result_model=result_model,
            read_only=read_only,
            token=token,
            allowed_hosts=hosts,
            time_limits=time_limits,
            fair_shares=fair_shares,
        )
        shown = f"[{args.host}]" if ":" in args.host else args.host
        mode = ""
        if replica is not None:
            mode = f", reading from the replica {replica.render_as_string(hide_password=True)}"
        if read_only:
            mode += " (read-only)" if primary is not None else " (read-only: no database URL)"
        sys.stderr.write(f"sqla-jobs dashboard on http://{shown}:{args.port}/{mode}\n")
        sys.stderr.flush()
        # log_config=None: uvicorn's records go through the logging configured above.
        uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False)
    finally:
        for made in (engine, replica_engine):
            if made is not None:
                made.dispose()
    return 0
