"""The dashboard as an ASGI application (Starlette, Jinja2), for ``sqla-jobs dashboard``
or to mount in an application of your own.

Pages (every one plain HTML, no JavaScript):

``GET /``                 queues: counts by status, oldest pending job, recent throughput,
                          rate limits, fair shares' tenants, pause buttons; the running
                          jobs: progress, time left to the limit
``GET /jobs``             the job list: ``?queue=&task=&status=&before=`` (keyset cursor)
``GET /jobs/{id}``        a job: every column, the last error's traceback, its result
``GET /activity``         per queue, the last hour by minute: jobs finished and failed, depth
``GET /failures``         the dead jobs of the last day, grouped by task and error
``GET /workflows``        a model with workflow steps only: the running workflows, and those
                          that finished last
``GET /workflows/{id}``   a workflow: its counts, and its steps as a graph (each box a link
                          to its job)
``POST /jobs/{id}/retry`` ``.../cancel``, ``.../delete``: the admin actions
``POST /queues/{name}/pause`` ``.../resume``: pause or resume a queue
``GET|POST /login``       the access token form (only with a token)
``POST /logout``          ends the browser's login: its cookie is deleted (only with a token)

With several databases (:func:`create_multi_app`: the jobs spread over independent databases
with the same tables), ``GET /`` lists the databases, each with its counts or why it did not
answer, and each database's pages above are under ``/db/{name}`` (``/db/{name}/``,
``/db/{name}/jobs``, ...), where every link and form stays; the login is one for all of them.

Every POST carries a CSRF token: a form field signed by the server for the browser's
``SameSite=Strict`` nonce cookie and its login (:mod:`.access`), so a cookie and field that
someone else chose are refused (403). With ``read_only=True`` the actions are not shown and
every POST but the login is refused (403). With a ``token``, every page needs it: an
``Authorization: Bearer`` header or the signed login cookie that the login form sets, which
expires (missing or expired: 401, with the form; wrong: 403). Bad input (an unknown job id, a
filter that is not a queue name, a cursor that is not an id) gets an error page and changes
nothing.

The database work runs in Starlette's thread pool on the sync engine, each request in one
short transaction of its own. Given a ``replica`` (the engine of a read replica, a streaming
standby), every page reads from it, in one transaction that also reads how far
behind the primary it is (:func:`sqla_jobs.health.read_replica_lag`), shown on every page;
the actions still write through ``engine``, the primary's (without one, the dashboard is
read-only).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final, NamedTuple
from urllib.parse import urlencode

import anyio
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import Connection, Engine, Table
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from sqla_jobs import queue, validation
from sqla_jobs._queries import dashboard as statements
from sqla_jobs._queries.dashboard import (
    FINISHED_WORKFLOWS,
    RECENT_THROUGHPUT,
    RESULT,
    RUNNING,
    RUNNING_WORKFLOWS,
    WORKFLOW_GRAPH,
    RunningRow,
    WorkflowListRow,
    WorkflowStepRow,
    workflow_record,
)
from sqla_jobs._queries.enqueueing import CONTROL_COLUMNS
from sqla_jobs._queries.variant import tables_of
from sqla_jobs.dashboard import access, activity, graph
from sqla_jobs.dashboard.access import AUTH_COOKIE, CSRF_COOKIE, SESSION_LIFETIME, SESSION_MAX_AGE
from sqla_jobs.dashboard.databases import (
    COUNTS_TIMEOUT,
    Database,
    Summary,
    database_name,
    databases_of,
    first_line,
    summary,
)
from sqla_jobs.dashboard.sources import (
    ListQuery,
    Page,
    TableSource,
    find_job,
    read_page,
)
from sqla_jobs.errors import (
    ConfigurationError,
    InvalidJobError,
    JobNotFoundError,
    JobStateError,
    SqlaJobsError,
)
from sqla_jobs.queue.rating import TenantDepths, checked_fair_shares, tenant_depths, tenant_text
from sqla_jobs.replicas import ReplicaLag, read_replica_lag
from sqla_jobs.schema import PLAIN_STATUSES, JobMixin, JobResultMixin, JobStatus, has_steps
from sqla_jobs.schema.history import RESULT_COLUMN, history_table
from sqla_jobs.schema.workflows import WorkflowStatus, check_step_model
from sqla_jobs.urls import server_label

__all__ = [
    "AUTH_COOKIE",
    "CSRF_COOKIE",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_SCAN",
    "MIN_TOKEN_LENGTH",
    "SESSION_LIFETIME",
    "SESSION_MAX_AGE",
    "create_app",
    "create_multi_app",
    "database_name",
]

DEFAULT_PAGE_SIZE: Final = 50
#: The running jobs the overview shows at most, longest running first.
RUNNING_SHOWN: Final = 50
#: The deepest tenants the overview names for each fairly shared queue.
TENANTS_SHOWN: Final = 3
#: Primary-key entries one list page reads at most (see :mod:`.statements`).
DEFAULT_SCAN: Final = 20_000
#: The running workflows, and the finished ones, the workflow list shows at most.
WORKFLOWS_SHOWN: Final = 50
#: The steps a workflow's page reads at most (in id order); it draws fewer
#: (:data:`.graph.MAX_BOXES`).
STEPS_READ: Final = 10_000
MIN_TOKEN_LENGTH: Final = 16
_TEMPLATES: Final = Path(__file__).resolve().parent / "templates"
_DONE: Final = {
    "retried": "pending again",
    "cancelled": "cancelled",
    "cancel_requested": "running: its worker was asked to stop it",
    "deleted": "deleted",
}
_IN_HISTORY: Final = object()  # a delete refused: the job is in the partitioned history
_ACTIONS: Final = {
    "retry": (queue.retry, "retried"),
    "cancel": (queue.cancel, "cancelled"),
    "delete": (queue.delete, "deleted"),
}
_HEADERS: Final = {
    # No script at all; styles only from the page itself; forms post only back here.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class PageError(Exception):
    """An error page: ``status`` and a message for the person reading it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def _check_csrf(request: Request, csrf: str, kept: str) -> None:
    """PageError 403 unless the posted form's ``csrf`` field is ``csrf``, the request's own
    token (:func:`.access.csrf_matches`); ``kept`` tells the reader what stayed as it was."""
    form = await request.form()
    if not access.csrf_matches(request, csrf, str(form.get("csrf", ""))):
        raise PageError(
            403, f"the form's CSRF token did not match (reload the page and try again): {kept}"
        )


@dataclass(frozen=True)
class _Settings:
    """What the pages of every database share (one model, the same tables in each)."""

    table: Table
    model: type[JobMixin]
    result_table: Table | None
    read_only: bool
    token: str | None
    keys: access.Keys
    title: str
    page_size: int
    scan: int
    time_limits: Mapping[str, float] | None  # None: the tasks' limits were not given
    fair_shares: Mapping[str, validation.FairShare]  # empty: none given
    workflow_table: Table | None  # a model with steps: its workflow table


@dataclass(frozen=True)
class RunningJob:
    """A running job as the overview shows it: its row (:class:`RunningRow`), its time limit
    in seconds (its own, else its task's as given to :func:`create_app`; None for none or
    not known), the seconds left to it by the database's clock (negative once past it; None
    without a limit or a known start), and whether a None limit is known to be none (the
    tasks' limits were given)."""

    row: RunningRow
    limit: float | None
    left: float | None
    known: bool

    @classmethod
    def of(cls, row: RunningRow, time_limits: Mapping[str, float] | None) -> RunningJob:
        limit = row.time_limit
        if limit is None and time_limits is not None:
            limit = time_limits.get(row.task)
        left = None if limit is None or row.elapsed is None else limit - row.elapsed
        return cls(row, limit, left, known=limit is not None or time_limits is not None)


def _time_limits(value: object) -> dict[str, float] | None:
    """``create_app``'s ``time_limits``: task names to limits (each checked like a task's
    ``time_limit``), as seconds; None when not given."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"time_limits must be a mapping of task names to time limits, not "
            f"{type(value).__name__} (a Registry's is registry.time_limits)"
        )
    limits = {}
    for task, limit in value.items():
        if not isinstance(task, str):
            raise ConfigurationError(f"time_limits: a task name is a string, not {task!r}")
        field = f"time_limits[{task!r}]"
        limit = validation.as_configuration(validation.check_time_limit, field, limit)
        limits[task] = limit.total_seconds()
    return limits


def _fair_shares(model: type[JobMixin], value: object) -> dict[str, validation.FairShare]:
    """``create_app``'s ``fair_shares``, checked as :func:`~sqla_jobs.tenant_depths` checks
    them (a :class:`~sqla_jobs.errors.ConfigurationError` here)."""
    try:
        return checked_fair_shares(model, value)
    except InvalidJobError as exc:
        raise ConfigurationError(
            f"fair_shares: {exc.reason} (a Registry's is registry.fair_shares)"
        ) from None


class _Overview(NamedTuple):
    """What the overview reads, in one transaction."""

    stats: list[queue.QueueStat]
    recent: list[Any]
    paused: list[queue.QueuePause]
    rates: list[queue.RateUsage]
    fair: list[TenantDepths]
    busy: list[RunningRow]


def _list_params(query: ListQuery, **changes: Any) -> str:
    """The job list's query string for ``query``, with ``changes``."""
    values = {
        "queue": query.queue,
        "task": query.task,
        "status": query.status.value if query.status else None,
    } | changes
    return urlencode({k: v for k, v in values.items() if v not in (None, "")})


def parse_list_query(query: Any, statuses: Sequence[JobStatus] = tuple(JobStatus)) -> ListQuery:
    """The job list's parameters, or :class:`PageError` (400) naming the bad one; a status
    filter must be one of ``statuses`` (the model's: ``waiting`` only with steps)."""
    unknown = sorted(set(query.keys()) - {"queue", "task", "status", "before", "done"})
    if unknown:
        raise PageError(400, f"unknown parameter {unknown[0]!r}")
    names: dict[str, str | None] = {}
    for field in ("queue", "task"):
        value = query.get(field) or None
        if value is not None:
            try:
                validation.check_name(field, value)
            except InvalidJobError as exc:
                raise PageError(400, f"bad {field} filter: {exc}") from None
        names[field] = value
    raw_status = query.get("status") or None
    status = None
    if raw_status is not None:
        allowed = {s.value: s for s in statuses}
        status = allowed.get(raw_status)
        if status is None:
            raise PageError(400, f"bad status filter: must be one of {', '.join(allowed)}")
    raw_before = query.get("before") or None
    before = statements.MAX_ID
    if raw_before is not None:
        if not (raw_before.isascii() and raw_before.isdigit() and len(raw_before) <= 19):
            raise PageError(400, "bad cursor: 'before' must be a job id")
        before = int(raw_before)
        if not 1 <= before <= statements.MAX_ID:
            raise PageError(400, "bad cursor: 'before' must be a job id")
    return ListQuery(queue=names["queue"], task=names["task"], status=status, before=before)


def _job_id(raw: str, what: str = "job") -> int:
    if raw.isascii() and raw.isdigit() and len(raw) <= 19 and 1 <= int(raw) <= statements.MAX_ID:
        return int(raw)
    raise PageError(404, f"no such {what}: a {what} id is a positive integer")


def _mapped(model: object, mixin: type, what: str) -> Table:
    if not (isinstance(model, type) and issubclass(model, mixin)):
        raise ConfigurationError(
            f"{what} {model!r} is not a mapped class mixing in {mixin.__name__}"
        )
    table = getattr(model, "__table__", None)
    if not isinstance(table, Table):
        raise ConfigurationError(f"{what} {model.__name__} is not mapped to a table")
    return table


def _check_positive(field: str, value: object, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ConfigurationError(f"{field} must be an integer in [1, {maximum}], got {value!r}")
    return value


def create_app(
    engine: Engine | None,
    model: type[JobMixin],
    *,
    replica: Engine | None = None,
    result_model: type[JobResultMixin] | None = None,
    read_only: bool = False,
    token: str | None = None,
    allowed_hosts: Sequence[str] | None = None,
    title: str = "sqla_jobs",
    page_size: int = DEFAULT_PAGE_SIZE,
    scan: int = DEFAULT_SCAN,
    secret: str | bytes | None = None,
    session_lifetime: timedelta | float = SESSION_LIFETIME,
    session_max_age: timedelta | float = SESSION_MAX_AGE,
    time_limits: Mapping[str, timedelta | float] | None = None,
    fair_shares: Mapping[str, validation.FairShare] | None = None,
) -> Starlette:
    """The dashboard of ``model``'s job table as a Starlette (ASGI) application.

    ``result_model`` shows stored results on a job's page. ``read_only`` hides and refuses
    retry, cancel and delete. ``token`` (at least 16 characters) is required by every page;
    without one, anyone who reaches the app can use it, so either keep it on loopback (as
    ``sqla-jobs dashboard`` does) or mount it behind your own authentication.
    ``allowed_hosts`` restricts the ``Host`` header (against DNS rebinding on a loopback
    dashboard). ``time_limits`` (task names to limits: your registry's
    :attr:`~sqla_jobs.Registry.time_limits`) tells the overview the tasks' time limits, so
    that each running job shows the time left to its limit (a job's own limit is read
    from its row; without either, none is shown). ``fair_shares`` (queue names to
    :class:`~sqla_jobs.FairShare`: your registry's :attr:`~sqla_jobs.Registry.fair_shares`)
    shows each fairly shared queue's tenants with pending jobs and the deepest of them
    (:func:`~sqla_jobs.tenant_depths`).

    ``replica``: the engine of a read replica (a streaming standby of ``engine``'s server).
    Every page then reads from it, each in one transaction that also reads how far
    the replica is behind (:func:`~sqla_jobs.health.read_replica_lag`, by the database's
    clock), and shows it in the header: *caught up*, how many seconds (and bytes) behind,
    *not streaming*, or, for a server that is not in recovery, *not a replica*. The actions
    (retry, cancel, delete, pause, resume) still write through ``engine``; the page they
    lead back to reads the replica, which shows the change once it has replayed it. With a
    replica, ``engine`` may be None: the dashboard is then read-only (nothing to write to),
    whatever ``read_only`` says.

    The login cookie and the forms' CSRF tokens are signed with keys derived from ``secret``
    (16+ characters) and ``token``: processes given the same ones accept each other's. With
    neither, the key is random per process, so run several processes (replicas, workers)
    with a ``secret``. A login lasts ``session_lifetime`` (a ``timedelta`` or seconds; 12 hours)
    after its last use and ``session_max_age`` (7 days) at most; see
    :mod:`sqla_jobs.dashboard.access`. Mount it in an application of your own::

        app = Starlette(routes=[Mount("/jobs-admin", create_app(engine, EmailJob))])

    Raises :class:`~sqla_jobs.errors.ConfigurationError` for a bad argument.
    """
    if replica is not None and not isinstance(replica, Engine):
        raise ConfigurationError(
            f"replica must be a sqlalchemy Engine (of a read replica), not {type(replica).__name__}"
        )
    if engine is None and replica is None:
        raise ConfigurationError("engine is None: give the primary's engine, or a replica's")
    if engine is not None and not isinstance(engine, Engine):
        raise ConfigurationError(f"engine must be a sqlalchemy Engine, not {type(engine).__name__}")
    reader = replica if replica is not None else engine
    assert reader is not None
    settings = _settings(
        model,
        result_model=result_model,
        read_only=bool(read_only) or engine is None,
        token=token,
        title=title,
        page_size=page_size,
        scan=scan,
        secret=secret,
        session_lifetime=session_lifetime,
        session_max_age=session_max_age,
        time_limits=time_limits,
        fair_shares=fair_shares,
    )
    only = Database(None, engine, reader, replica is not None, server_label(reader.url))
    dashboard = _Dashboard(settings, [only], several=False)
    return dashboard.app(dashboard.database_routes(""), allowed_hosts)


def create_multi_app(
    engines: Mapping[str, Engine],
    model: type[JobMixin],
    *,
    result_model: type[JobResultMixin] | None = None,
    read_only: bool = False,
    token: str | None = None,
    allowed_hosts: Sequence[str] | None = None,
    title: str = "sqla_jobs",
    page_size: int = DEFAULT_PAGE_SIZE,
    scan: int = DEFAULT_SCAN,
    secret: str | bytes | None = None,
    session_lifetime: timedelta | float = SESSION_LIFETIME,
    session_max_age: timedelta | float = SESSION_MAX_AGE,
    time_limits: Mapping[str, timedelta | float] | None = None,
    fair_shares: Mapping[str, validation.FairShare] | None = None,
) -> Starlette:
    """One dashboard of several databases: ``engines`` maps each database's name to its
    engine, and every database holds ``model``'s tables (the jobs spread over independent
    databases, see :doc:`/how-to/several-databases`).

    ``GET /`` lists the databases in the order given: each one's name (a link to its pages),
    its server (``host:port/database`` of its engine's URL, never the user or the password)
    and its counts: pending, runnable, running and dead jobs, running jobs whose lease
    expired, the age of its oldest runnable job (by its own clock) and its paused queues,
    read from the pending, running and dead indexes (:func:`~sqla_jobs.queue_stats`) under a
    ``statement_timeout`` of 5 seconds; then the totals of those that answered. The
    databases are read at once, each in a transaction of its own. One that cannot be reached
    is shown *unreachable*, one whose reads failed (no job table, the timeout) *error*, each
    with the first line of its error, and the others as usual. The page waits for the
    slowest: a server that drops packets holds it for its engine's connect timeout (e.g.
    ``connect_args={"connect_timeout": 5}``; ``sqla-jobs dashboard``'s is 10 seconds).

    Each database's pages are those of :func:`create_app` under ``/db/{name}``: its queues
    at ``/db/{name}/``, its job list at ``/db/{name}/jobs``, a job at ``/db/{name}/jobs/{id}``
    and so on; the actions (retry, cancel, delete, pause, resume) write through that
    database's engine only. Every link and form of a database's pages stays under its
    prefix, and its header names it and links back to the list. A database that is down
    gets its own pages' 503 (``database error: ...``); the others answer as usual.
    ``/login`` and ``/logout`` are shared: one token, one login, one cookie (its ``Path`` the
    dashboard's own) for every database.

    The other arguments are :func:`create_app`'s, the same for every database (one model:
    the same tasks, time limits and fair shares); ``read_only`` hides and refuses the
    actions of all of them. A read replica (``create_app``'s ``replica=``) serves one
    database and has no counterpart here.

    A name is the path segment of its database's pages: letters, digits, ``-``, ``_``,
    ``.`` and ``~``, not starting with a dot, 255 characters at most. :func:`database_name`
    makes one from a URL (as ``sqla-jobs dashboard --database-url A --database-url B``
    does). Raises :class:`~sqla_jobs.errors.ConfigurationError`, before any SQL runs, for an
    empty ``engines``, a name that is not such a segment, two names that differ only by case,
    two engines on the same database (the same host, port and database), a value that is not
    an :class:`~sqlalchemy.Engine`, or an argument :func:`create_app` refuses::

        app = create_multi_app({"eu": eu_engine, "us": us_engine}, EmailJob, token=token)
    """
    databases = databases_of(engines)
    settings = _settings(
        model,
        result_model=result_model,
        read_only=bool(read_only),
        token=token,
        title=title,
        page_size=page_size,
        scan=scan,
        secret=secret,
        session_lifetime=session_lifetime,
        session_max_age=session_max_age,
        time_limits=time_limits,
        fair_shares=fair_shares,
    )
    dashboard = _Dashboard(settings, databases, several=True)
    overview = Route("/", dashboard.page(dashboard.database_list), name="databases")
    return dashboard.app([overview, *dashboard.database_routes("/db/{database}")], allowed_hosts)


def _settings(
    model: type[JobMixin],
    *,
    result_model: type[JobResultMixin] | None,
    read_only: bool,
    token: str | None,
    title: str,
    page_size: int,
    scan: int,
    secret: str | bytes | None,
    session_lifetime: timedelta | float,
    session_max_age: timedelta | float,
    time_limits: Mapping[str, timedelta | float] | None,
    fair_shares: Mapping[str, validation.FairShare] | None,
) -> _Settings:
    """The settings of ``create_app`` and ``create_multi_app``, checked."""
    table = _mapped(model, JobMixin, "model")
    result_table = (
        None if result_model is None else _mapped(result_model, JobResultMixin, "result_model")
    )
    given: object = token
    if given is not None and (not isinstance(given, str) or len(given) < MIN_TOKEN_LENGTH):
        raise ConfigurationError(
            f"token must be a string of at least {MIN_TOKEN_LENGTH} characters"
        )
    return _Settings(
        table=table,
        model=model,
        result_table=result_table,
        read_only=read_only,
        token=token,
        keys=access.Keys(
            secret=secret, token=token, lifetime=session_lifetime, max_age=session_max_age
        ),
        title=str(title),
        page_size=_check_positive("page_size", page_size, 1000),
        scan=_check_positive("scan", scan, 1_000_000),
        time_limits=_time_limits(time_limits),
        fair_shares=_fair_shares(model, fair_shares),
        # A model with steps gets the workflow pages; any other, nothing more (no route).
        workflow_table=check_step_model(model) if has_steps(model) else None,
    )


Handler = Callable[[Request, str], Awaitable[Response]]


class _Dashboard:
    """The pages of one database (``several=False``: :func:`create_app`), or of several,
    each under ``/db/{name}`` beside the list of them (:func:`create_multi_app`)."""

    def __init__(self, settings: _Settings, databases: list[Database], *, several: bool) -> None:
        self.s = settings
        self.several = several
        self.databases = {database.name: database for database in databases}
        # The names of the routes of a database's pages (under /db/{name} with several).
        self.scoped: frozenset[str] = frozenset()
        # The job table; for a model with partitioned_history, its history table of
        # finished jobs is a second source (the list merges both by id).
        history = tables_of(settings.model).history
        self.history = None if history is None else TableSource(history, settings.scan)
        self.sources = [TableSource(settings.table, settings.scan)]
        if self.history is not None:
            self.sources.append(self.history)
        self.env = Environment(
            loader=FileSystemLoader(_TEMPLATES),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters["when"] = _when
        self.env.filters["pretty"] = _pretty
        # The job list's status filter: ``waiting`` (a step's) only for a model with steps.
        self.list_statuses = (
            tuple(JobStatus) if settings.workflow_table is not None else PLAIN_STATUSES
        )
        self.statuses = [status.value for status in self.list_statuses]
        # What the overview counts: the statuses queue_stats reads from its partial indexes
        # (succeeded and cancelled jobs are history; the throughput columns show them).
        self.counted = [s.value for s in (JobStatus.PENDING, JobStatus.RUNNING, JobStatus.DEAD)]
        self.keys = settings.keys

    # -- the application --------------------------------------------------------------------

    def database_routes(self, prefix: str) -> list[Route]:
        """The routes of a database's pages, under ``prefix`` (``""``, or
        ``"/db/{database}"`` with several databases)."""
        routes = [
            Route(f"{prefix}/", self.page(self.overview), name="overview"),
            Route(f"{prefix}/jobs", self.page(self.job_list), name="jobs"),
            Route(f"{prefix}/activity", self.page(self.activity), name="activity"),
            Route(f"{prefix}/failures", self.page(self.failures), name="failures"),
        ]
        if self.s.workflow_table is not None:
            # A model with steps gets the workflow pages; any other, nothing more (no route).
            routes += [
                Route(f"{prefix}/workflows", self.page(self.workflow_list), name="workflows"),
                Route(
                    f"{prefix}/workflows/{{workflow_id}}",
                    self.page(self.workflow_detail),
                    name="workflow",
                ),
            ]
        routes += [
            Route(f"{prefix}/jobs/{{job_id}}", self.page(self.job_detail), name="job"),
            Route(
                f"{prefix}/jobs/{{job_id}}/{{action}}",
                self.page(self.job_action),
                methods=["POST"],
                name="action",
            ),
            Route(
                f"{prefix}/queues/{{queue}}/{{action}}",
                self.page(self.queue_action),
                methods=["POST"],
                name="queue_action",
            ),
        ]
        self.scoped = frozenset(route.name for route in routes)
        return routes

    def app(self, routes: list[Route], allowed_hosts: Sequence[str] | None) -> Starlette:
        """The application of ``routes``, the login's and the logout's."""
        middleware = []
        if allowed_hosts is not None:
            middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)))
        return Starlette(
            routes=[
                *routes,
                Route("/login", self.login, methods=["GET", "POST"], name="login"),
                Route("/logout", self.logout, methods=["POST"], name="logout"),
            ],
            middleware=middleware,
            exception_handlers={HTTPException: self.http_error},
        )

    # -- plumbing ---------------------------------------------------------------------------

    def database(self, request: Request) -> Database:
        """The database of the request's page (set by :meth:`page`)."""
        database: Database = request.state.database
        return database

    def link(self, request: Request, name: str, /, **params: Any) -> str:
        """The path of the route ``name``; a route of a database's pages gets the request's
        database (with several), so that every link and form of its pages stays within
        it."""
        database = getattr(request.state, "database", None)
        if database is not None and database.name is not None and name in self.scoped:
            params.setdefault("database", database.name)
        return request.url_for(name, **params).path

    def home(self, request: Request) -> str:
        """The first page: the list of the databases with several, else the queues."""
        return self.link(request, "databases" if self.several else "overview")

    def render(
        self, request: Request, template: str, csrf: str, *, status: int = 200, **context: Any
    ) -> HTMLResponse:
        def url(name: str, /, query: str = "", **params: Any) -> str:
            path = self.link(request, name, **params)
            return f"{path}?{query}" if query else path

        database = getattr(request.state, "database", None)
        body = self.env.get_template(template).render(
            several=self.several,
            database=None if database is None else database.name,
            title=self.s.title,
            table=self.s.table.fullname,
            read_only=self.s.read_only,
            replica=getattr(request.state, "replica", None),
            logged_in=getattr(request.state, "logged_in", False),
            statuses=self.statuses,
            has_workflows=self.s.workflow_table is not None,
            csrf=csrf,
            url=url,
            **context,
        )
        return HTMLResponse(body, status_code=status, headers=_HEADERS)

    def error(self, request: Request, status: int, message: str) -> HTMLResponse:
        return self.render(request, "error.html", "", status=status, code=status, message=message)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = "no such page" if exc.status_code == 404 else str(exc.detail)
        return self.error(request, exc.status_code, message)

    def _authorized(self, request: Request, at: int) -> access.Login | None:
        """The request's login (from its cookie), or None when it needs none (no token, or a
        bearer token); raises :class:`~.access.Denied` (401 or 403) without a valid one."""
        if self.s.token is None:
            return None
        header = request.headers.get("authorization")
        if header is not None:
            scheme, _, presented = header.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                presented.strip().encode(), self.s.token.encode()
            ):
                return None
            raise access.Denied(403, "wrong access token")
        cookie = request.cookies.get(AUTH_COOKIE)
        if cookie is None:
            raise access.Denied(401, "this dashboard needs its access token")
        return self.keys.read_login(cookie, at)

    def page(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` behind the access check, given the request's CSRF token (bound to the
        browser's nonce cookie and its login); the response sets those cookies as needed."""

        async def endpoint(request: Request) -> Response:
            at = access.now()
            try:
                login = self._authorized(request, at)
            except access.Denied as denied:
                return self.login_page(request, denied.status, denied.message)
            nonce = access.csrf_nonce(request)
            csrf = self.keys.csrf_token(nonce, "" if login is None else login.session)
            request.state.logged_in = login is not None  # the page offers a logout
            try:
                self._find_database(request)
                response = await handler(request, csrf)
            except PageError as exc:
                response = self.error(request, exc.status, exc.message)
            except SQLAlchemyError as exc:
                response = self.error(request, 503, f"database error: {first_line(exc)}")
            renewed = None if login is None else self.keys.renewed(login, at)
            self.keys.set_cookies(request, response, nonce=nonce, login=renewed, at=at)
            return response

        return endpoint

    def _find_database(self, request: Request) -> None:
        """Set ``request.state.database``: the only one, or the one the path names (with
        several; PageError 404 for a name that is none of theirs); not for the list of
        the databases."""
        if not self.several:
            request.state.database = self.databases[None]
            return
        name = request.path_params.get("database")
        if name is None:
            return
        database = self.databases.get(name)
        if database is None:
            names = ", ".join(str(known) for known in self.databases)
            raise PageError(404, f"no database named {name!r} here (the databases: {names})")
        request.state.database = database

    def read(self, request: Request, work: Callable[[Connection], Any]) -> Awaitable[Any]:
        """``work`` on the request's database's reader (the replica, else the primary) in a
        transaction of its own; on a replica, that transaction reads its lag too, for the
        page to show (``request.state.replica``)."""
        database = self.database(request)
        replica = database.replica

        def in_transaction() -> Any:
            with database.reader.begin() as connection:
                value = work(connection)
                if replica:
                    lag: ReplicaLag = read_replica_lag(connection)
                    request.state.replica = lag
                return value

        return run_in_threadpool(in_transaction)

    def write(self, request: Request, work: Callable[[Connection], Any]) -> Awaitable[Any]:
        """``work`` on the request's database's primary in a transaction of its own (an
        action)."""
        engine = self.database(request).engine
        assert engine is not None  # without one, the dashboard is read-only

        def in_transaction() -> Any:
            with engine.begin() as connection:
                return work(connection)

        return run_in_threadpool(in_transaction)

    # -- login ------------------------------------------------------------------------------

    def login_page(self, request: Request, status: int, message: str) -> Response:
        target = request.url.path
        if request.url.query:
            target += "?" + request.url.query
        return self.render(request, "login.html", "", status=status, message=message, next=target)

    async def login(self, request: Request) -> Response:
        if self.s.token is None:
            return self.error(request, 404, "this dashboard has no access token to log in with")
        if request.method == "GET":
            return self.login_page(request, 401, "this dashboard needs its access token")
        form = await request.form()
        presented = str(form.get("token", ""))
        target = str(form.get("next", ""))
        root = access.cookie_path(request)
        if not (target.startswith(root) and not target.startswith("//")):
            target = self.home(request)
        if not hmac.compare_digest(presented.encode(), self.s.token.encode()):
            return self.render(
                request, "login.html", "", status=403, message="wrong access token", next=target
            )
        response = RedirectResponse(target, status_code=303, headers=_HEADERS)
        at = access.now()
        self.keys.set_cookies(request, response, login=self.keys.new_login(at), at=at)
        return response

    async def logout(self, request: Request) -> Response:
        """End this browser's login: its cookie is deleted, and the login form drawn. Only
        with the CSRF field of a page of that login (else 403, and the login stays). The
        login cookie is signed, not stored: a copy taken before stays valid until it expires;
        a new ``token`` or ``secret`` ends every login at once."""
        if self.s.token is None:
            return self.error(request, 404, "this dashboard has no login to end")
        at = access.now()
        try:
            login = self._authorized(request, at)
        except access.Denied:
            login = None  # no valid login: nothing to protect, the cookie goes all the same
        if login is not None:
            csrf = self.keys.csrf_token(access.csrf_nonce(request), login.session)
            try:
                await _check_csrf(request, csrf, "still logged in")
            except PageError as exc:
                return self.error(request, exc.status, exc.message)
        response = RedirectResponse(
            request.url_for("login").path, status_code=303, headers=_HEADERS
        )
        self.keys.end_login(request, response)
        return response

    # -- pages ------------------------------------------------------------------------------

    async def database_list(self, request: Request, csrf: str) -> Response:
        """The list of the databases (with several): each one's counts, read at once."""
        if request.query_params:
            raise PageError(400, "this page takes no parameters")
        databases = list(self.databases.values())
        found: list[Summary | None] = [None] * len(databases)

        async def summarize(index: int) -> None:
            found[index] = await run_in_threadpool(summary, databases[index], self.s.model)

        async with anyio.create_task_group() as group:
            for index in range(len(databases)):
                group.start_soon(summarize, index)
        rows = [row for row in found if row is not None]
        answered = [row for row in rows if row.state == "ok"]
        oldest = [row.oldest_runnable for row in answered if row.oldest_runnable is not None]
        totals = {
            key: sum(getattr(row, key) for row in answered)
            for key in ("pending", "runnable", "running", "expired_leases", "dead")
        }
        return self.render(
            request,
            "databases.html",
            csrf,
            rows=rows,
            answered=len(answered),
            totals=totals,
            oldest=max(oldest) if oldest else None,
            age=_age,
            timeout=COUNTS_TIMEOUT,
        )

    def _where(self, request: Request, table: Table) -> str:
        """``table``'s name, and its database's with several (for a 404's message)."""
        name = self.database(request).name
        return table.fullname if name is None else f"{table.fullname} of the database {name}"

    async def overview(self, request: Request, csrf: str) -> Response:
        if request.query_params:
            raise PageError(400, "this page takes no parameters")
        scan = self.s.scan

        def read(connection: Connection) -> _Overview:
            stats = queue.queue_stats(connection, self.s.model)
            paused = queue.paused_queues(connection, self.s.model)
            rates = queue.rate_usage(connection, self.s.model)
            fair = tenant_depths(connection, self.s.model, self.s.fair_shares, top=TENANTS_SHOWN)
            with queue.readable_values(connection):
                busy = RUNNING.rows(connection, self.s.table, {"limit": RUNNING_SHOWN + 1})
            # Each source's newest window (a model with history: its finished jobs are there).
            recent = [
                row
                for source in self.sources
                for row in RECENT_THROUGHPUT.rows(
                    connection, source.table, {"before": statements.MAX_ID}, scan=scan
                )
            ]
            return _Overview(stats, recent, paused, rates, fair, busy)

        stats, recent, paused, rates, fair, busy = await self.read(request, read)
        queues: dict[str, dict[str, Any]] = {}
        # A paused, rate-limited or fairly shared queue is listed, with or without jobs.
        for kind, items in (("paused", paused), ("rate", rates), ("fair", fair)):
            for item in items:
                row = queues.setdefault(item.queue, {"counts": {}, "oldest": None, "recent": None})
                row[kind] = item
        for stat in stats:
            row = queues.setdefault(stat.queue, {"counts": {}, "oldest": None, "recent": None})
            row["counts"][stat.status.value] = stat.count
            if stat.oldest_pending_seconds is not None:
                row["oldest"] = max(row["oldest"] or 0.0, stat.oldest_pending_seconds)
        scanned = 0
        for item in recent:
            scanned += item.scanned
            row = queues.setdefault(item.queue, {"counts": {}, "oldest": None, "recent": None})
            sums = row["recent"] or {"succeeded_5m": 0, "succeeded_1h": 0, "dead_1h": 0}
            row["recent"] = {key: sums[key] + getattr(item, key) for key in sums}
        totals = {s: sum(q["counts"].get(s, 0) for q in queues.values()) for s in self.counted}
        return self.render(
            request,
            "overview.html",
            csrf,
            queues=sorted(queues.items()),
            totals=totals,
            counted=self.counted,
            scanned=scanned,
            scan=scan,
            age=_age,
            tenant_text=tenant_text,
            running=[RunningJob.of(row, self.s.time_limits) for row in busy[:RUNNING_SHOWN]],
            more_running=len(busy) > RUNNING_SHOWN,
            running_shown=RUNNING_SHOWN,
        )

    async def activity(self, request: Request, csrf: str) -> Response:
        if request.query_params:
            raise PageError(400, "this page takes no parameters")

        def read(connection: Connection) -> list[activity.QueueActivity]:
            return activity.read_activity(connection, self.s.model, self.sources)

        queues = await self.read(request, read)
        return self.render(
            request,
            "activity.html",
            csrf,
            queues=queues,
            minutes=statements.MINUTES,
            scan=self.s.scan,
        )

    async def failures(self, request: Request, csrf: str) -> Response:
        if request.query_params:
            raise PageError(400, "this page takes no parameters")

        def read(connection: Connection) -> list[activity.Failure]:
            return activity.read_failures(connection, self.sources)

        failures = await self.read(request, read)
        return self.render(
            request,
            "failures.html",
            csrf,
            failures=failures,
            hours=statements.FAILURE_HOURS,
            scan=self.s.scan,
        )

    async def job_list(self, request: Request, csrf: str) -> Response:
        query = parse_list_query(request.query_params, self.list_statuses)
        size = self.s.page_size

        def read(connection: Connection) -> Page:
            return read_page(connection, self.sources, query, size)

        page = await self.read(request, read)
        return self.render(
            request,
            "jobs.html",
            csrf,
            query=query,
            rows=page.rows,
            next_before=page.next_before,
            sparse=page.sparse,
            first_page=query.before == statements.MAX_ID,
            list_params=_list_params,
            scan=self.s.scan,
            done=_DONE.get(request.query_params.get("done", "")),
        )

    async def job_detail(self, request: Request, csrf: str) -> Response:
        unknown = set(request.query_params.keys()) - {"done"}
        if unknown:
            raise PageError(400, f"unknown parameter {sorted(unknown)[0]!r}")
        job_id = _job_id(request.path_params["job_id"])
        table, result_table = self.s.table, self.s.result_table

        def read(connection: Connection) -> tuple[Any, Any]:
            row = find_job(connection, self.sources, job_id)
            stored = None
            if result_table is not None:
                stored = RESULT.one(connection, result_table, {"job_id": job_id})
            return row, stored

        row, stored = await self.read(request, read)
        if row is None:
            raise PageError(404, f"no job {job_id} in {self._where(request, table)}")
        # A job found in the history table: its result is the row's own result column.
        in_history = self.history is not None and RESULT_COLUMN in row
        if in_history and row[RESULT_COLUMN] is not None:
            stored = {"value": row[RESULT_COLUMN], "finished_at": row["finished_at"]}
        shown = set(statements.LIST_COLUMNS) | {
            "args",
            "last_error",
            "leased_by",
            "lease_expires_at",
            *CONTROL_COLUMNS,  # time limit, snoozes, progress: shown on their own
        }
        if in_history:
            shown.add(RESULT_COLUMN)
        if self.s.workflow_table is not None:
            shown |= {"workflow_id", "step"}  # a step's: shown on their own, linked
        limits = self.s.time_limits
        extra = [(key, value) for key, value in row.items() if key not in shown]
        return self.render(
            request,
            "job.html",
            csrf,
            job=row,
            extra=extra,
            result=stored,
            has_results=result_table is not None or in_history,
            in_history=in_history,
            task_limit=None if limits is None else limits.get(row["task"]),
            limits_known=limits is not None,
            done=_DONE.get(request.query_params.get("done", "")),
        )

    async def workflow_list(self, request: Request, csrf: str) -> Response:
        if request.query_params:
            raise PageError(400, "this page takes no parameters")
        workflow_table = self.s.workflow_table
        assert workflow_table is not None  # the route exists only for a model with steps
        scan, shown = self.s.scan, WORKFLOWS_SHOWN

        def read(connection: Connection) -> tuple[list[WorkflowListRow], list[WorkflowListRow]]:
            with queue.readable_values(connection):
                running = RUNNING_WORKFLOWS.rows(
                    connection, workflow_table, {}, scan=scan, limit=shown + 1
                )
                finished = FINISHED_WORKFLOWS.rows(connection, workflow_table, {}, limit=shown)
            return running, finished

        running, finished = await self.read(request, read)
        return self.render(
            request,
            "workflows.html",
            csrf,
            workflow_table=workflow_table.fullname,
            rows=running[:shown] + finished,
            running=min(len(running), shown),
            more_running=len(running) > shown,
            shown=shown,
            scan=scan,
        )

    async def workflow_detail(self, request: Request, csrf: str) -> Response:
        if request.query_params:
            raise PageError(400, "this page takes no parameters")
        workflow_table = self.s.workflow_table
        assert workflow_table is not None  # the route exists only for a model with steps
        flow_id = _job_id(request.path_params["workflow_id"], "workflow")

        def read(connection: Connection) -> tuple[Any, list[WorkflowStepRow]]:
            with queue.readable_values(connection):
                flow = workflow_record(connection, workflow_table, flow_id)
                if flow is None:
                    return None, []
                steps = WORKFLOW_GRAPH.rows(
                    connection,
                    self.s.table,
                    {"flow_id": flow_id},
                    limit=STEPS_READ,
                    history=None if self.history is None else self.history.table,
                )
            return flow, steps

        flow, steps = await self.read(request, read)
        if flow is None:
            raise PageError(404, f"no workflow {flow_id} in {self._where(request, workflow_table)}")
        counts: dict[str, int] = {}
        for step in steps:
            counts[step.status] = counts.get(step.status, 0) + 1
        names = {step.id: step.step or f"#{step.id}" for step in steps}
        drawn = graph.layout(steps)
        listed = frozenset(statements.WORKFLOW_COLUMNS)  # the rest are the model's own
        return self.render(
            request,
            "workflow.html",
            csrf,
            flow=flow,
            extra=[(key, value) for key, value in flow.items() if key not in listed],
            steps=steps,
            counts=[(s.value, counts[s.value]) for s in JobStatus if s.value in counts],
            names=names,
            graph=drawn,
            box=graph,
            truncated=len(steps) >= STEPS_READ,
            steps_read=STEPS_READ,
            running=flow["status"] == WorkflowStatus.RUNNING.value,
        )

    async def queue_action(self, request: Request, csrf: str) -> Response:
        action = request.path_params["action"]
        if action not in ("pause", "resume"):
            raise PageError(404, "no such page")
        name = request.path_params["queue"]
        if self.s.read_only:
            raise PageError(403, "this dashboard is read-only: nothing was changed")
        await _check_csrf(request, csrf, "nothing was changed")

        def act(connection: Connection) -> object:
            if action == "pause":
                return queue.pause_queue(connection, self.s.model, name)
            return queue.resume_queue(connection, self.s.model, name)

        try:
            await self.write(request, act)
        except SqlaJobsError as exc:  # a malformed queue name, before any SQL
            raise PageError(400, f"{exc}: nothing was changed") from None
        return RedirectResponse(self.link(request, "overview"), status_code=303, headers=_HEADERS)

    async def job_action(self, request: Request, csrf: str) -> Response:
        action = request.path_params["action"]
        if action not in _ACTIONS:
            raise PageError(404, "no such page")
        job_id = _job_id(request.path_params["job_id"])
        if self.s.read_only:
            raise PageError(403, "this dashboard is read-only: nothing was changed")
        await _check_csrf(request, csrf, "nothing was changed")
        operation, done = _ACTIONS[action]

        history = self.history

        def act(connection: Connection) -> object:
            if action == "delete" and history is not None and history.job(connection, job_id):
                # A finished job in the partitioned history is pruned with its partition
                # (sqla-jobs prune, sqla_jobs.history.drop_partitions), never row by row.
                return _IN_HISTORY
            return operation(connection, self.s.model, job_id)

        try:
            outcome = await self.write(request, act)
        except JobNotFoundError:
            raise PageError(
                404, f"no job {job_id} in {self._where(request, self.s.table)}"
            ) from None
        except JobStateError as exc:
            raise PageError(409, f"{exc}: nothing was changed") from None
        except SqlaJobsError as exc:
            raise PageError(400, str(exc)) from None
        if outcome is _IN_HISTORY:
            raise PageError(
                409,
                f"job {job_id} is in the history table {history_table(self.s.table).fullname}, "
                "which is pruned by whole partitions (sqla-jobs prune), not job by job: "
                "nothing was changed",
            )
        if action == "cancel" and outcome is JobStatus.RUNNING:
            done = "cancel_requested"  # a running job ends cancelled once its worker hears
        if action == "delete":
            target = self.link(request, "jobs") + "?done=deleted"
        else:
            target = self.link(request, "job", job_id=str(job_id)) + f"?done={done}"
        return RedirectResponse(target, status_code=303, headers=_HEADERS)


def _when(value: datetime | str | None) -> str:
    # A str: a time Python cannot hold, as PostgreSQL wrote it (sources.readable_values).
    if value is None or isinstance(value, str):
        return value or "-"
    return value.isoformat(sep=" ", timespec="seconds")


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
