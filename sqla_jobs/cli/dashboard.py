"""``sqla-jobs dashboard``: the web dashboard (extra: dashboard).

With ``--replica-url`` (or ``$SQLA_JOBS_REPLICA_URL``) the pages read from that read replica
and show its lag, and the actions write through the database URL; given a replica and no
database URL, the dashboard is read-only: it has nothing to write to.

With ``--database-url`` given once per database (jobs spread over several databases), it
serves one dashboard of them all (:func:`sqla_jobs.dashboard.create_multi_app`), each
database named by :func:`sqla_jobs.dashboard.database_name`; a replica serves one database,
so ``--replica-url`` with several is refused."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Callable
from typing import Any, Final

from sqlalchemy import Engine
from sqlalchemy.engine import URL

from sqla_jobs.cli.arguments import CommandError
from sqla_jobs.cli.database import (
    database_url,
    database_urls,
    has_database_url,
    make_engine,
    replica_url,
)
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

        from sqla_jobs.dashboard import create_app, create_multi_app, database_name
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
    given: list[str] = args.database_url or []
    replica = replica_url(args.replica_url)
    if replica is not None and len(given) > 1:
        raise CommandError(
            "--replica-url reads one database's replica: give one --database-url with it "
            "(a dashboard of several databases reads their primaries)"
        )
    first = given[0] if given else None
    if replica is None and len(given) > 1:
        primaries = database_urls(given)
        names = _names(primaries, database_name)
        primary = None
    else:
        primaries = []
        names = []
        primary = database_url(first) if replica is None or has_database_url(first) else None
    read_only = args.read_only or (primary is None and not primaries)
    engines: list[Engine] = []

    def engine_of(url: URL) -> Engine:
        made = make_engine(
            url, pool_size=4, application_name="sqla-jobs dashboard", pooler=args.pooler
        )
        engines.append(made)
        return made

    hosts = None
    if loopback and token is None:
        # Only the names of this machine: a page of another site that rebinds its own name
        # to 127.0.0.1 (DNS rebinding) gets no answer.
        hosts = ["127.0.0.1", "localhost", "[::1]", "::1"]
    try:
        shown = f"[{args.host}]" if ":" in args.host else args.host
        mode = ""
        # The options both forms take, the same for one database as for several.
        options: dict[str, Any] = {
            "result_model": result_model,
            "read_only": read_only,
            "token": token,
            "allowed_hosts": hosts,
            "time_limits": time_limits,
            "fair_shares": fair_shares,
        }
        if primaries:
            app = create_multi_app(
                {name: engine_of(url) for name, url in zip(names, primaries, strict=True)},
                model,
                **options,
            )
            mode = f", {len(names)} databases: {', '.join(names)}"
            if read_only:
                mode += " (read-only)"
        else:
            app = create_app(
                None if primary is None else engine_of(primary),
                model,
                replica=None if replica is None else engine_of(replica),
                **options,
            )
            if replica is not None:
                mode = f", reading from the replica {replica.render_as_string(hide_password=True)}"
            if read_only:
                mode += " (read-only)" if primary is not None else " (read-only: no database URL)"
        sys.stderr.write(f"sqla-jobs dashboard on http://{shown}:{args.port}/{mode}\n")
        sys.stderr.flush()
        # log_config=None: uvicorn's records go through the logging configured above.
        uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False)
    finally:
        for made in engines:
            made.dispose()
    return 0


def _names(urls: list[URL], name_of: Callable[[URL], str]) -> list[str]:
    """The name of each database of a dashboard of several (``name_of``: the dashboard's
    :func:`~sqla_jobs.dashboard.database_name`), or a CommandError when two URLs name the
    same database (the same host, port and database, as different users, say)."""
    names = [name_of(url) for url in urls]
    seen: dict[str, URL] = {}
    for name, url in zip(names, urls, strict=True):
        other = seen.setdefault(name.casefold(), url)
        if other is not url:
            raise CommandError(
                f"--database-url names the database {name} twice "
                f"({other.render_as_string(hide_password=True)} and "
                f"{url.render_as_string(hide_password=True)}): give each database once"
            )
    return names
