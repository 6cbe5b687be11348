"""What the queue operations share: their types (:class:`ClaimedJob`, ...), limits, the
hot path's driver shortcut (:func:`_rows`), and the checks of their arguments (see
:mod:`sqla_jobs.queue`)."""

from __future__ import annotations

import contextlib
import functools
import json
import json.scanner
import operator
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any, Final, NamedTuple, TypeAlias, cast
from uuid import UUID

import psycopg
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg.rows import tuple_row
from psycopg.types.json import JsonbLoader
from sqlalchemy import (
    ClauseElement,
    Connection,
    Dialect,
    Executable,
    Table,
    inspect,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler

from sqla_jobs import statements, validation
from sqla_jobs.errors import (
    ConfigurationError,
    InvalidJobError,
)
from sqla_jobs.schema import (
    JobMixin,
    JobResultMixin,
    JobStatus,
)

MAX_CLAIM_LIMIT: Final = 10_000
DEFAULT_ENQUEUE_CHUNK: Final = 1_000
MAX_ENQUEUE_CHUNK: Final = 100_000
#: How long a claimed attempt owns its job unless heartbeated, when nobody says otherwise
#: (a registry's tasks, and so the worker, start from it too).
DEFAULT_LEASE: Final = timedelta(seconds=30)
MAX_ERROR_CHARS: Final = 16_000
#: Dead row versions at which :func:`vacuum` vacuums a job table by default: about 50k
#: claimed jobs (each leaves two), the interval at which a 1M-job drain kept the rate of a
#: 50k one.
VACUUM_DEAD_ROWS: Final = 100_000

_NO_RESULT: Final[Any] = object()

#: What the queue operations run on: an ORM session, or a Core connection (a worker's
#: background loops use connections, which cost less per transaction). Either way the
#: operation runs in the caller's current transaction and never commits it.
Executor: TypeAlias = Session | Connection


class ClaimedJob(NamedTuple):
    """One attempt at one job, as returned by :func:`claim`.

    Plain, immutable data, not an ORM object: it stays valid after the claiming session is
    gone. ``(id, attempt)`` is the fence that every later transition of this attempt
    carries. (A named tuple: a claim builds one per job, and a tuple is the cheapest
    immutable record Python has.)
    """

    model: type[JobMixin]
    id: int
    queue: str
    task: str
    args: dict[str, Any]
    priority: int
    attempt: int
    max_attempts: int
    #: None only for a row whose ``run_at`` Python's datetime cannot hold (``'-infinity'``, a
    #: year before 1: written by another program). A worker ends such a job dead before any
    #: handler sees it.
    run_at: datetime
    lease_expires_at: datetime
    #: The enqueuer's trace context (schema version 3), or None: see :mod:`sqla_jobs.tracing`.
    trace_context: dict[str, str] | None = None

    @property
    def is_last_attempt(self) -> bool:
        """Whether a failure of this attempt makes the job dead."""
        return self.attempt >= self.max_attempts


@dataclass(frozen=True, slots=True)
class FailOutcome:
    """What :func:`fail` did: ``status`` is ``pending`` (a retry at ``run_at``) or ``dead``.
    ``run_at`` is None only when the row's ``run_at`` (kept by a dead job) lies outside what
    Python's datetime holds (written by another program)."""

    job_id: int
    status: JobStatus
    run_at: datetime | None

    @property
    def will_retry(self) -> bool:
        return self.status is JobStatus.PENDING


@dataclass(frozen=True, slots=True)
class QueueStat:
    """A row of :func:`queue_stats`: one queue's jobs in one live status.

    ``oldest_pending_seconds`` (pending rows only) is how long the oldest runnable pending
    job has waited past its ``run_at``, in database time, None when none is runnable;
    ``runnable`` (pending rows) how many pending jobs have reached their ``run_at``;
    ``expired_leases`` (running rows) how many running jobs' leases have run out (a crashed
    or stalled worker's; the next claim takes them over).
    """

    queue: str
    status: JobStatus
    count: int
    oldest_pending_seconds: float | None
    runnable: int = 0
    expired_leases: int = 0


# -- plumbing ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _statement(builder: Callable[..., Executable], table: Table, **options: Any) -> Executable:
    # Building a statement costs far more Python time than running it; each builder's
    # output depends only on the table and the options, so build it once.
    return builder(table, **options)


@functools.lru_cache(maxsize=256)
def _driver_sql(
    builder: Callable[..., Executable], table: Table, dialect: Dialect, **options: Any
) -> str | None:
    """The SQL text of a built statement as the psycopg driver takes it, or None when it
    cannot run as plain text (a parameter SQLAlchemy would expand or render at run time)."""
    statement = cast(ClauseElement, _statement(builder, table, **options))
    compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
    if compiled.post_compile_params or compiled.literal_execute_params:
        return None
    return str(compiled)


def _rows(
    session: Executor,
    builder: Callable[..., Executable],
    table: Table,
    params: dict[str, Any],
    **options: Any,
) -> Sequence[Any]:
    """Run one of the hot-path statements (claim, complete) and return its rows, as tuples.

    On a Core ``Connection`` of the psycopg driver, inside a transaction SQLAlchemy knows
    of, the statement's compiled text runs straight on the driver connection: the
    same SQL in the same transaction, without SQLAlchemy's per-execution work (the context,
    the result wrapper, the row processors, the cursor events), which cost a busy worker
    more CPU than the statement itself. Every parameter here is a plain ``str``, ``int``,
    ``float`` or list of ``str``, which psycopg adapts as SQLAlchemy would. Anything else
    (an ORM ``Session``, another driver, ``paramstyle`` changed, a
    ``schema_translate_map``, no transaction begun) goes through ``execute``, and so does
    every statement on an engine with ``before_cursor_execute`` or ``after_cursor_execute``
    listeners (OpenTelemetry's SQLAlchemy instrumentation, a statement logger, ...): they
    see the SQL the hot path sends, at the price of the fast path.
    """
    if (
        type(session) is Connection
        and not session.dispatch.before_cursor_execute
        and not session.dispatch.after_cursor_execute
        and session.in_transaction()
        and session.dialect.driver == "psycopg"
        and session.dialect.paramstyle == "pyformat"
        and not session.get_execution_options().get("schema_translate_map")
    ):
        driver = session.connection.driver_connection
        sql = _driver_sql(builder, table, session.dialect, **options)
        if sql is not None and isinstance(driver, psycopg.Connection):
            # Prepared as psycopg decides (after ``prepare_threshold`` runs; never when it
            # is None, as behind PgBouncer in transaction mode); rows as tuples whatever
            # row factory the connection was given.
            try:
                with driver.cursor(row_factory=tuple_row) as cursor:
                    if _stock_jsonb(driver):
                        cursor.adapters.register_loader(_JSONB_OID, _JsonbLoader)
                    return cursor.execute(sql, params).fetchall()
            except psycopg.Error as exc:
                raise _wrapped(session, exc, sql, params) from exc
    statement = _statement(builder, table, **options)
    connection = (
        session
        if isinstance(session, Connection)
        else session.connection(bind_arguments={"clause": statement})
    )
    if connection.dialect.driver == "asyncpg" and builder in _CLAIMS:
        # asyncpg decodes jsonb with SQLAlchemy's json.loads codec, which a value Python's
        # json cannot decode would make fail the whole claim: read those columns as text.
        claimed = _statement(builder, table, json_text=True, **options)
        return [_json_decoded(row) for row in connection.execute(claimed, params)]
    with readable_jsonb(connection):
        return connection.execute(statement, params).all()


#: The statements that return claimed jobs (rows as :data:`_CLAIM_ORDER` reads them).
_CLAIMS: Final = frozenset({statements.claim, statements.claim_keyed})


def _json_decoded(row: Sequence[Any]) -> tuple[Any, ...]:
    # A claimed row whose args (4) and trace_context (10) came back as text (json_text).
    fields = list(row)
    for index in (4, 10):
        if fields[index] is not None:
            fields[index] = _loads(fields[index])
    return tuple(fields)


@contextlib.contextmanager
def readable_jsonb(connection: Connection) -> Iterator[None]:
    """Inside the block, jsonb values that Python's json cannot decode are read as an
    :class:`UnreadableJson` instead of failing the statement: on a psycopg connection that
    reads jsonb with psycopg's own loader (one given ``set_json_loads`` keeps its own). For
    the statements that read rows other programs may have written: a claim, a dashboard's
    job page."""
    driver = connection.connection.driver_connection
    if not isinstance(driver, (psycopg.Connection, psycopg.AsyncConnection)):
        yield
        return
    if not _stock_jsonb(driver):
        yield
        return
    adapters = driver.adapters
    adapters.register_loader(_JSONB_OID, _JsonbLoader)
    try:
        yield
    finally:
        adapters.register_loader(_JSONB_OID, JsonbLoader)


@contextlib.contextmanager
def readable_values(connection: Connection) -> Iterator[None]:
    """:func:`readable_jsonb`, and a timestamptz Python's datetime cannot hold (``'infinity'``,
    ``'-infinity'``, a year before 1 or after 9999) read as its text (a ``str``) instead of
    failing the statement. For the pages that show whole rows other programs may have written
    (the dashboard's); not for the hot path, where the statements hand back only times they
    made readable (:func:`sqla_jobs.statements._sql._readable_time`)."""
    driver = connection.connection.driver_connection
    if not isinstance(driver, (psycopg.Connection, psycopg.AsyncConnection)):
        yield
        return
    adapters = driver.adapters
    stock = adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT)
    if stock is None:
        yield
        return
    tolerant = type("ReadableTimestamptz", (_ReadableTime,), {"stock": stock})
    adapters.register_loader(_TIMESTAMPTZ_OID, tolerant)
    try:
        with readable_jsonb(connection):
            yield
    finally:
        adapters.register_loader(_TIMESTAMPTZ_OID, stock)


_TIMESTAMPTZ_OID: Final = psycopg.postgres.types["timestamptz"].oid


class _ReadableTime(Loader):
    """The connection's own timestamptz loader (``stock``), or the value's text where it
    cannot make a datetime of it (:func:`readable_values`)."""

    stock: type[Loader]

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        self._load = self.stock(oid, context).load

    def load(self, data: Buffer) -> Any:
        try:
            return self._load(data)
        except psycopg.DataError:
            return bytes(data).decode()


class UnreadableJson:
    """A jsonb value that Python's json cannot decode, where the hot path's statements read
    one (a claimed job's ``args`` or ``trace_context``): nested deeper than the recursion
    limit lets it go, or a number with more digits than ``int()`` converts. Jobs enqueued
    through sqla_jobs never hold one (:func:`sqla_jobs.validation.check_json` refuses them);
    a row written by another program (psql, a trigger, another service) may.

    The rule it carries: **no row can fail a claim**. The loader gives this value instead of
    raising, the claim returns the job like any other, and the worker ends that job alone,
    dead with the reason (:meth:`sqla_jobs.worker.runner.Runner.admit`), while the other jobs
    of the claim run. Raising would fail the whole claim, every time: its queue would stop.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<UnreadableJson: {self.reason}>"


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        return UnreadableJson(
            f"nested deeper than Python's json can decode ({len(text)} characters of JSON)"
        )
    except ValueError as exc:  # a number too long for int() (sys.set_int_max_str_digits)
        return UnreadableJson(f"Python's json cannot decode it: {exc}")


_JSONB_OID: Final = psycopg.postgres.types["jsonb"].oid
# json's C scanner (typeshed types make_scanner's argument wrongly).
_SCAN: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


class _JsonbLoader(Loader):
    """psycopg's own jsonb loader (``json.loads`` of the text) in fewer Python calls, for
    the hot path's statements: a claim decodes every job's ``args``, and the stock loader
    costs more CPU than the rest of the row. A value json cannot decode becomes an
    :class:`UnreadableJson` instead of an error. The text goes straight to json's C scanner;
    anything it does not take whole (surrounding whitespace, which jsonb output never
    has, or an error) goes to ``json.loads``, which gives the same value or the same error.
    :func:`_rows` uses it only where the stock loader is in place: a connection given a
    ``loads`` of its own (``psycopg.types.json.set_json_loads``) keeps it."""

    def load(self, data: Buffer) -> Any:
        text = bytes(data).decode()
        try:
            value, end = _SCAN(text, 0)
        except (StopIteration, RecursionError, ValueError):
            return _loads(text)  # the value, or an UnreadableJson saying why
        return value if end == len(text) else _loads(text)


def _stock_jsonb(driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether ``driver`` reads jsonb with psycopg's own loader and ``json.loads``: neither
    ``set_json_loads`` for it (a loader class of its own) nor for every connection (the
    stock class's ``_loads`` replaced)."""
    loader = driver.adapters.get_loader(_JSONB_OID, Format.TEXT)
    return loader is JsonbLoader and JsonbLoader._loads is json.loads


def _wrapped(
    connection: Connection, exc: psycopg.Error, sql: str, params: dict[str, Any]
) -> BaseException:
    """A driver error as ``execute`` would have raised it: the matching
    ``sqlalchemy.exc.DBAPIError`` subclass, with the connection invalidated when the error
    means it is gone (so the pool does not hand it out again)."""
    dialect = connection.dialect
    gone = dialect.is_disconnect(cast(Any, exc), connection.connection.dbapi_connection, None)
    if gone:
        connection.invalidate(exc)
    return DBAPIError.instance(
        sql, params, exc, psycopg.Error, connection_invalidated=gone, dialect=dialect
    )


def _mapped_table(model: object, mixin: type) -> Table:
    if not (isinstance(model, type) and issubclass(model, mixin)):
        raise ConfigurationError(f"{model!r} is not a mapped class that mixes in {mixin.__name__}")
    if inspect(model, raiseerr=False) is None:
        raise ConfigurationError(f"{model.__name__} mixes in {mixin.__name__} but is not mapped")
    return cast(Table, model.__table__)  # type: ignore[attr-defined]


def _job_table(model: object) -> Table:
    return _mapped_table(model, JobMixin)


def _result_table(model: object) -> Table:
    return _mapped_table(model, JobResultMixin)


def _one_model(jobs: Sequence[ClaimedJob]) -> type[JobMixin]:
    model = jobs[0].model
    if any(job.model is not model for job in jobs):
        raise ConfigurationError("a batch must hold jobs of one model; split it by model")
    return model


def _fence_params(jobs: Sequence[ClaimedJob]) -> dict[str, Any]:
    # Comma-separated text, split and cast by the statement (statements._sql._fences); built by
    # C-level iteration (map), as a worker's outcome writer does for every job it writes.
    return {
        "fence_ids": ",".join(map(str, map(_JOB_ID, jobs))),
        "fence_attempts": ",".join(map(str, map(_JOB_ATTEMPT, jobs))),
    }


_JOB_ID: Final = operator.attrgetter("id")
_JOB_ATTEMPT: Final = operator.attrgetter("attempt")
#: A claim row's (priority, run_at, id): the order of claimed jobs.
_CLAIM_ORDER: Final = operator.itemgetter(5, 8, 0)


def _claim_order_with_unreadable(row: Sequence[Any]) -> tuple[int, datetime, int]:
    """:data:`_CLAIM_ORDER` for rows among which a ``run_at`` came back None (unreadable:
    :func:`sqla_jobs.statements._sql._readable_time`), which sorts first, as its
    ``'-infinity'`` or ancient time does in the claim's own order."""
    return (row[5], row[8] or datetime.min.replace(tzinfo=timezone.utc), row[0])


#: The status column of statements.complete's rows.
_ROW_STATUS: Final = operator.itemgetter(3)


def _seconds(field: str, value: timedelta | float) -> float:
    # The statements take durations as float seconds (``:lease_seconds``, ...).
    return validation.check_duration(field, value).total_seconds()


def _check_count(field: str, value: object, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise InvalidJobError(field, f"must be an integer in [1, {maximum}], got {value!r}")


def _check_queues(queues: str | Iterable[str]) -> list[str]:
    names = [queues] if isinstance(queues, str) else list(queues)
    if not names:
        raise InvalidJobError("queues", "must name at least one queue")
    for name in names:
        validation.check_name("queues", name)
    return list(dict.fromkeys(names))


@functools.cache
def default_worker_name() -> str:
    """``host:pid``, recorded as ``leased_by`` on the jobs a process claims."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _fenced(rows: Iterable[Any]) -> set[tuple[int, int]]:
    """The ``(id, attempt)`` fences that a fenced statement's ``RETURNING`` matched."""
    # Positional: every fenced statement returns ``id, attempts`` first.
    return {(row[0], row[1]) for row in rows}


def _lost(jobs: Sequence[ClaimedJob], kept: set[tuple[int, int]]) -> list[ClaimedJob]:
    # Keyed by (id, attempt), never by id alone: one batch may hold a stale attempt and the
    # current attempt of the same job.
    return [job for job in jobs if (job.id, job.attempt) not in kept]


# -- the model's own columns, as enqueue_many sends them ------------------------------------


_MIXIN_INPUTS: Final = frozenset(statements.ENQUEUE_COLUMNS)


def _json_default(value: object) -> object:
    # Values of the model's own columns that JSON has no type for; PostgreSQL parses the
    # text with the column type's input function.
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, Decimal | UUID):
        return str(value)
    if isinstance(value, timedelta):
        return f"{value.total_seconds()} seconds"
    raise TypeError(f"cannot send a {type(value).__name__} through enqueue_many")


_encode = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_json_default
).encode


@functools.lru_cache(maxsize=64)
def _own_columns(table: Table) -> frozenset[str]:
    return frozenset(statements.enqueue_columns(table)) - _MIXIN_INPUTS
