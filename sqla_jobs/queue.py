"""The queue operations: claim, complete, fail, heartbeat, release, retry, cancel, prune.

Every function takes the caller's :class:`~sqlalchemy.orm.Session` and runs inside the
caller's transaction: it may flush, it never commits, rolls back or closes. A claim in lease
mode is therefore durable only once the caller commits, and a completion commits together
with whatever else the caller wrote in that transaction.

For :class:`~sqlalchemy.ext.asyncio.AsyncSession`, :mod:`sqla_jobs.aio` runs these same
functions through ``AsyncSession.run_sync``.

A typical lease-mode worker step::

    with Session(engine) as session, session.begin():
        jobs = claim(session, EmailJob, queues=["email"], limit=10)
    for job in jobs:
        with Session(engine) as session, session.begin():
            try:
                send(job.args)
            except Exception as exc:
                fail(session, job, exc)
            else:
                complete(session, job)
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import json.scanner
import logging
import operator
import os
import socket
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from time import monotonic
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
    CursorResult,
    Dialect,
    Engine,
    Executable,
    Table,
    inspect,
)
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler

from sqla_jobs import statements, tracing, validation
from sqla_jobs.errors import (
    ConfigurationError,
    InvalidJobError,
    JobCancelledError,
    JobNotFoundError,
    JobStateError,
    LeaseLostError,
    SqlaJobsError,
    UniqueJobError,
)
from sqla_jobs.history import statements as history_statements
from sqla_jobs.history.schema import has_history, history_table
from sqla_jobs.policy import RetryPolicy
from sqla_jobs.schema import (
    DEFAULT_QUEUE,
    DEFAULT_UNIQUE_STATUSES,
    JobMixin,
    JobResultMixin,
    JobStatus,
    names,
)

__all__ = [
    "DEFAULT_LEASE",
    "KEY_SCAN_EXTRA",
    "MAX_CLAIM_LIMIT",
    "VACUUM_DEAD_ROWS",
    "ClaimedJob",
    "DeadJob",
    "Enqueued",
    "Executor",
    "FailOutcome",
    "QueueStat",
    "cancel",
    "cancel_attempts",
    "cancel_requests",
    "claim",
    "complete",
    "complete_attempts",
    "complete_held",
    "complete_many",
    "dead_jobs",
    "default_worker_name",
    "delete",
    "enqueue_many",
    "enqueue_unique",
    "enqueue_unique_many",
    "fail",
    "heartbeat",
    "job_columns",
    "lock",
    "lock_one",
    "lock_started",
    "prune",
    "queue_stats",
    "release",
    "retry",
    "unique_key_of",
    "vacuum",
]

logger = logging.getLogger(__name__)

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
    """What :func:`fail` did: ``status`` is ``pending`` (a retry at ``run_at``) or ``dead``."""

    job_id: int
    status: JobStatus
    run_at: datetime

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
    return session.execute(_statement(builder, table, **options), params).all()


_JSONB_OID: Final = psycopg.postgres.types["jsonb"].oid
# json's C scanner (typeshed types make_scanner's argument wrongly).
_SCAN: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


class _JsonbLoader(Loader):
    """psycopg's own jsonb loader (``json.loads`` of the text) in fewer Python calls, for
    the hot path's statements: a claim decodes every job's ``args``, and the stock loader
    costs more CPU than the rest of the row. The text goes straight to json's C scanner;
    anything it does not take whole (surrounding whitespace, which jsonb output never
    has, or an error) goes to ``json.loads``, which gives the same value or the same error.
    :func:`_rows` uses it only where the stock loader is in place: a connection given a
    ``loads`` of its own (``psycopg.types.json.set_json_loads``) keeps it."""

    def load(self, data: Buffer) -> Any:
        text = bytes(data).decode()
        try:
            value, end = _SCAN(text, 0)
        except StopIteration:
            return json.loads(text)
        return value if end == len(text) else json.loads(text)


def _stock_jsonb(driver: psycopg.Connection[Any]) -> bool:
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


# -- bulk enqueue -----------------------------------------------------------------------

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


def _attribute_values(model: type[JobMixin], job: JobMixin) -> dict[str, Any]:
    # Only what was assigned: an attribute never set takes the column's server default.
    if not isinstance(job, model):
        raise InvalidJobError(
            "jobs", f"holds a {type(job).__name__}; expected {model.__name__} or a mapping"
        )
    state = job.__dict__
    return {
        prop.columns[0].name: state[prop.key]
        # raiseerr spelled out: SQLAlchemy 2.0.30's stubs type the default as Optional.
        for prop in inspect(model, raiseerr=True).column_attrs
        if prop.key in state and state[prop.key] is not None
    }


def _job_row(
    model: type[JobMixin], job: Mapping[str, Any] | JobMixin, own: frozenset[str]
) -> dict[str, Any]:
    """Check one job as the mixin's validators would; return its row for the statement."""
    values: Mapping[str, Any] = job if isinstance(job, Mapping) else _attribute_values(model, job)
    row: dict[str, Any] = {"task": validation.check_name("task", values.get("task"))}
    for key, value in values.items():
        if key == "task" or value is None:
            continue  # None: the column's server default
        if key in validation.JOB_FIELDS:
            validation.check_field(key, value, max_args_bytes=model.max_args_bytes)
            if key == "run_at" and not isinstance(value, datetime):
                raise InvalidJobError(
                    key, "enqueue_many takes a datetime, not a SQL expression; use add() for that"
                )
        elif key in statements.UNIQUE_COLUMNS:
            raise UniqueJobError(
                key,
                "is set by sqla_jobs.enqueue_unique_many(session, model, jobs, statuses=...) "
                "(a mapping's own 'unique_key' too), which skips a duplicate; enqueue_many() "
                "would abort your transaction on one",
            )
        elif key in statements.MANAGED_COLUMNS or key in statements.CONTEXT_COLUMNS:
            raise InvalidJobError(key, "is set by the queue, not by the enqueuer")
        elif key not in own:
            raise InvalidJobError(key, f"is not a column of {model.__name__}")
        row[key] = value
    return row


def _next_chunk(
    model: type[JobMixin],
    jobs: Iterator[Mapping[str, Any] | JobMixin],
    size: int,
    own: frozenset[str],
) -> tuple[str, int] | None:
    """Take and check up to ``size`` jobs; return them as the statement's JSON and their
    number, or None when there are no more."""
    rows = [_job_row(model, job, own) for job in itertools.islice(jobs, size)]
    if not rows:
        return None
    try:
        return _encode(rows), len(rows)
    except (TypeError, ValueError) as exc:  # a value of the model's own columns
        raise InvalidJobError("jobs", str(exc)) from exc


def _insert_chunk(session: Session, table: Table, chunk: tuple[str, int]) -> int:
    # INSERT ... SELECT from the document inserts every row of it or raises (the driver
    # reports no row count for it when the statement is prepared). The trace context is
    # the span current at this statement (sqla_jobs.tracing), for every row of it.
    params = {"rows": chunk[0], "trace_context": tracing.enqueue_context()}
    session.execute(_statement(statements.enqueue_many, table), params)
    return chunk[1]


def enqueue_many(
    session: Session,
    model: type[JobMixin],
    jobs: Iterable[Mapping[str, Any] | JobMixin],
    *,
    chunk_size: int = DEFAULT_ENQUEUE_CHUNK,
) -> int:
    """Enqueue many jobs at once, in the caller's transaction; return how many.

    For large batches, where building one ORM object per job is what costs: ``jobs`` is
    any iterable (a generator is consumed as it goes, so memory stays bounded by
    ``chunk_size`` whatever its length) of mappings with the keys ``task`` (required),
    ``queue``, ``args``, ``priority``, ``run_at`` (a datetime), ``max_attempts`` and the
    model's own columns, or of unsaved instances of ``model``. A missing or ``None`` value
    takes the column's server default, as an ORM insert would (Python-side ``default=``
    values of your own columns are not applied; give those columns a server default).

    Each chunk is checked with the same rules as the mixin's validators, and an
    :class:`InvalidJobError` naming the field is raised before the chunk's SQL runs; each
    chunk is then one ``INSERT ... SELECT FROM jsonb_to_recordset(...)`` statement, the
    chunk sent as one JSON document (:func:`sqla_jobs.statements.enqueue_many`). Like
    ``session.add``, it writes into the caller's transaction and never commits: the jobs
    exist if and only if the caller commits. When there is more than one chunk, they run
    under a savepoint, so an error in any chunk leaves nothing of this call behind (the
    caller's transaction stays usable). The session's pending objects are flushed first
    (a job may refer to them).

    Example::

        with Session(engine) as session, session.begin():
            sqla_jobs.enqueue_many(
                session, EmailJob, ({"task": "send", "args": {"n": n}} for n in range(10**6))
            )
    """
    table = _job_table(model)
    _check_count("chunk_size", chunk_size, MAX_ENQUEUE_CHUNK)
    own = _own_columns(table)
    iterator = iter(jobs)
    chunk = _next_chunk(model, iterator, chunk_size, own)
    if chunk is None:
        return 0
    session.flush()
    following = _next_chunk(model, iterator, chunk_size, own)
    if following is None:
        return _insert_chunk(session, table, chunk)
    count = 0
    with session.begin_nested():
        count += _insert_chunk(session, table, chunk)
        while following is not None:
            count += _insert_chunk(session, table, following)
            following = _next_chunk(model, iterator, chunk_size, own)
    return count


# -- unique jobs ------------------------------------------------------------------------

#: The longest unique key a caller may give (the stored key adds a period bucket to it).
MAX_UNIQUE_KEY_LENGTH: Final = 200
# A key whose holder keeps leaving its unique statuses just as it is looked up is tried
# again; this many rounds in a row means something is wrong (never seen in practice).
_MAX_UNIQUE_ROUNDS: Final = 1_000

_canonical = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False
).encode


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What :func:`enqueue_unique` did with one job.

    ``inserted`` is true when this call inserted the job, whose id is ``id``; false when
    another job already held the key, and ``id`` is that job's. ``unique_key`` is the key as
    stored (with its period bucket, if any).
    """

    id: int
    inserted: bool
    unique_key: str


def unique_key_of(task: str, args: Mapping[str, Any] | None = None) -> str:
    """The key a unique job gets when none is given: ``sha256:`` and the SHA-256 of the
    canonical JSON (sorted keys, no spaces, UTF-8) of ``{"args": args, "task": task}``.

    Stable across processes and versions: the same task and arguments always give the same
    key, however the dict was built (``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` are one
    key; ``1`` and ``1.0`` are two).
    """
    document = _canonical({"args": dict(args or {}), "task": task})
    return "sha256:" + hashlib.sha256(document.encode()).hexdigest()


def _unique_statuses(statuses: Iterable[JobStatus | str]) -> list[str]:
    if isinstance(statuses, str):
        statuses = [statuses]
    known = {s.value for s in JobStatus}
    values = {status.value if isinstance(status, JobStatus) else status for status in statuses}
    unknown = sorted(repr(status) for status in values if status not in known)
    if unknown:
        raise UniqueJobError(
            "unique_statuses", f"{', '.join(unknown)} is not one of {sorted(known)}"
        )
    missing = [s.value for s in DEFAULT_UNIQUE_STATUSES if s.value not in values]
    if missing:
        raise UniqueJobError(
            "unique_statuses",
            f"must include {missing}: a job holds its key from its enqueue (pending) until "
            "it finishes (running); without running, a duplicate could run beside it",
        )
    return sorted(values)


def _unique_period(period: timedelta | float | None) -> float | None:
    if period is None:
        return None
    if isinstance(period, bool) or not isinstance(period, timedelta | int | float):
        raise UniqueJobError(
            "unique_period", f"must be a timedelta or seconds, not {type(period).__name__}"
        )
    try:
        seconds = validation.check_duration("unique_period", period).total_seconds()
    except InvalidJobError as exc:
        raise UniqueJobError("unique_period", exc.reason) from None
    if seconds != int(seconds):
        raise UniqueJobError("unique_period", f"must be whole seconds, got {seconds!r}")
    return seconds


def _check_unique_key(key: object) -> str:
    if not isinstance(key, str):
        raise UniqueJobError("unique_key", f"must be a string, not {type(key).__name__}")
    if not key or len(key) > MAX_UNIQUE_KEY_LENGTH:
        raise UniqueJobError(
            "unique_key", f"must be 1 to {MAX_UNIQUE_KEY_LENGTH} characters, got {len(key)}"
        )
    if "\x00" in key:
        raise UniqueJobError("unique_key", "must not contain NUL characters")
    return key


def _unique_row(
    model: type[JobMixin],
    job: Mapping[str, Any] | JobMixin,
    own: frozenset[str],
    period: float | None,
    statuses: list[str],
) -> dict[str, Any]:
    """Check one unique job (as :func:`_job_row`, plus its key); return its row."""
    key: object = None
    if isinstance(job, Mapping) and "unique_key" in job:
        key = job["unique_key"]
        job = {name: value for name, value in job.items() if name != "unique_key"}
    row = _job_row(model, job, own)
    row["unique_key"] = (
        unique_key_of(row["task"], row.get("args")) if key is None else _check_unique_key(key)
    )
    row["unique_period"] = period
    row["unique_statuses"] = statuses
    return row


def enqueue_unique_many(
    session: Session,
    model: type[JobMixin],
    jobs: Iterable[Mapping[str, Any] | JobMixin],
    *,
    period: timedelta | float | None = None,
    statuses: Iterable[JobStatus | str] = DEFAULT_UNIQUE_STATUSES,
    chunk_size: int = DEFAULT_ENQUEUE_CHUNK,
) -> list[Enqueued]:
    """Enqueue unique jobs: each is inserted unless a job with its key exists; return, for
    each job in order, what happened (:class:`Enqueued`).

    ``jobs`` as for :func:`enqueue_many`; a mapping may carry its own ``"unique_key"`` (a
    string of up to 200 characters), else the key is :func:`unique_key_of` its task and
    arguments. ``period`` (whole seconds, or a ``timedelta``) makes the key "at most one per
    period": the job holds ``<key>@<bucket>``, its bucket being the period its ``run_at``
    falls in (counted from the Unix epoch; ``run_at`` defaults to the database's clock at
    the transaction's start). ``statuses`` are the statuses in which a job holds its key
    (default pending and running; they must include both; add ``succeeded`` to refuse a
    job whose twin already succeeded, for as long as that row stays in the table).

    A duplicate is skipped, never an error: the caller's transaction is never aborted, and
    gets the id of the job that holds the key instead (duplicates within the batch get the
    id of the first one of their key). Enforced by the database, by the table's unique
    index and ``INSERT ... ON CONFLICT DO NOTHING``, so concurrent enqueuers in other
    transactions and processes agree: when the holder is not committed yet, this call waits
    for its transaction, and inserts the job if that one rolls back. Use it in a READ
    COMMITTED transaction (the default): under REPEATABLE READ or SERIALIZABLE, PostgreSQL
    raises a serialization failure when the holder committed after the snapshot.

    Like :func:`enqueue_many`, it writes in the caller's transaction and never commits; bad
    input raises :class:`~sqla_jobs.errors.InvalidJobError` (a
    :class:`~sqla_jobs.errors.UniqueJobError` for the unique options) before the chunk's
    SQL runs, and several chunks run under one savepoint.

    Example::

        with Session(engine) as session, session.begin():
            results = sqla_jobs.enqueue_unique_many(
                session, EmailJob, [{"task": "send", "args": {"to": "a@example.com"}}]
            )
            results[0].inserted   # False if that email is already pending or running
    """
    table = _job_table(model)
    _check_count("chunk_size", chunk_size, MAX_ENQUEUE_CHUNK)
    seconds = _unique_period(period)
    held_in = _unique_statuses(statuses)
    own = _own_columns(table)
    iterator = iter(jobs)

    def next_rows() -> list[dict[str, Any]]:
        return [
            _unique_row(model, job, own, seconds, held_in)
            for job in itertools.islice(iterator, chunk_size)
        ]

    rows = next_rows()
    if not rows:
        return []
    session.flush()
    following = next_rows()
    if not following:
        return _insert_unique(session, table, rows)
    results: list[Enqueued] = []
    with session.begin_nested():
        results += _insert_unique(session, table, rows)
        while following:
            results += _insert_unique(session, table, following)
            following = next_rows()
    return results


def _insert_unique(session: Session, table: Table, rows: list[dict[str, Any]]) -> list[Enqueued]:
    """Run :func:`statements.enqueue_unique` for ``rows`` until every row has its job."""
    results: list[Enqueued | None] = [None] * len(rows)
    todo = list(range(len(rows)))
    statement = _statement(statements.enqueue_unique, table)
    trace_context = tracing.enqueue_context()  # as in _insert_chunk
    for _ in range(_MAX_UNIQUE_ROUNDS):
        batch = [rows[i] | {"n": position} for position, i in enumerate(todo)]
        try:
            document = _encode(batch)
        except (TypeError, ValueError) as exc:  # a value of the model's own columns
            raise InvalidJobError("jobs", str(exc)) from exc
        seen: set[str] = set()
        unresolved: list[int] = []
        params = {"rows": document, "trace_context": trace_context}
        for n, key, inserted_id, holder_id in session.execute(statement, params):
            index = todo[n]
            if inserted_id is not None:
                results[index] = Enqueued(inserted_id, key not in seen, key)
                seen.add(key)
            elif holder_id is not None:
                results[index] = Enqueued(holder_id, False, key)
            else:
                # The holder committed after this statement's snapshot, or left its unique
                # statuses meanwhile: a new statement (a new snapshot) settles it.
                unresolved.append(index)
        if not unresolved:
            return [result for result in results if result is not None]
        todo = unresolved
    raise SqlaJobsError(
        f"enqueue_unique: {len(todo)} keys kept changing hands for {_MAX_UNIQUE_ROUNDS} "
        "rounds; nothing was skipped, retry the transaction"
    )


def enqueue_unique(
    session: Session,
    job: JobMixin,
    *,
    key: str | None = None,
    period: timedelta | float | None = None,
    statuses: Iterable[JobStatus | str] = DEFAULT_UNIQUE_STATUSES,
) -> Enqueued:
    """Enqueue ``job`` (an unsaved instance of a job model) unless a job with its unique key
    exists; return what happened.

    ``key`` defaults to :func:`unique_key_of` the job's task and arguments; ``period`` and
    ``statuses`` as for :func:`enqueue_unique_many`, which this is for one job. The instance
    is not added to the session: the row is written with a statement of its own (load it
    with ``session.get(model, result.id)`` if you need the object).

    Never aborts the caller's transaction on a duplicate, unlike ``session.add`` of a job
    with a unique key (which the mixin refuses, with a :class:`UniqueJobError` naming this
    call)::

        with Session(engine) as session, session.begin():
            result = sqla_jobs.enqueue_unique(
                session, EmailJob(task="digest", args={"user": 7}), period=3600
            )
            if not result.inserted:
                print("already queued this hour as job", result.id)
    """
    model = type(job)
    values: dict[str, Any] | JobMixin = job
    if key is not None:
        values = _attribute_values(model, job) | {"unique_key": key}
    return enqueue_unique_many(session, model, [values], period=period, statuses=statuses)[0]


# -- claim ------------------------------------------------------------------------------


def claim(
    session: Executor,
    model: type[JobMixin],
    *,
    queues: str | Iterable[str] = DEFAULT_QUEUE,
    limit: int = 1,
    lease: timedelta | float = DEFAULT_LEASE,
    worker: str | None = None,
    hold: bool = False,
    keys: bool = False,
    queue_limits: Mapping[str, int] | None = None,
) -> list[ClaimedJob]:
    """Claim up to ``limit`` runnable jobs and start an attempt on each.

    Runnable means pending with ``run_at`` no later than the database's clock, or running
    with an expired lease (its worker crashed or stalled). Jobs are taken in
    ``(priority, run_at, id)`` order, with ``FOR UPDATE SKIP LOCKED``, in one statement:
    concurrent claimers get disjoint jobs and skip, never wait for, jobs another worker
    holds. Each claimed job's ``attempts`` grows by one; that number is the attempt's fence.
    The statement reads up to ``limit`` candidates per queue, so its cost grows with the
    number of queues and ``limit``, not with the backlog; with several queues, the
    candidates that did not make the batch stay locked until the transaction ends (keep it
    short). See :func:`sqla_jobs.statements.claim`.

    **Lease mode** (``hold=False``, the default). The claim runs in the caller's transaction
    and is durable once the caller commits. Each job is then ``running`` with a lease that
    ends ``lease`` after the claim, in database time; :func:`heartbeat` extends it. When the
    lease ends before the attempt does, the next claim takes the job over as a new attempt
    and every later transition by the old attempt raises :class:`LeaseLostError`. A job
    whose lease ran out on its last attempt is made ``dead`` by the claim that finds it.

    **Lock-held mode** (``hold=True``). The attempt is first counted in a short transaction
    of its own on a separate connection from the session's engine, and committed, so that a
    worker that dies mid-job still uses up an attempt (a job that kills its worker every time
    ends dead). The rows are then locked with ``SELECT ... FOR UPDATE`` in the caller's
    transaction and stay locked until it ends. Complete the jobs in that same transaction
    and the handler's own writes commit together with the completion, or not at all. If the
    worker dies, its locks go with its connection and the jobs come back once ``lease`` has
    passed; while the caller's transaction lives, no other claim can take them, however
    long the handler runs. Claim data committed by others only: the separate connection
    does not see the caller's uncommitted rows.

    **Ordering keys** (``keys=True``). Jobs with an ``ordering_key`` are claimed only with
    ``keys=True`` (a plain claim never takes one, so it cannot break a key's order). Then
    the claim first takes keyed jobs, key by key: a job starts only when fewer than its
    ``key_limit`` (default 1) jobs of its key are in progress (running on a live lease or
    held by a lock-held worker, or waiting for a retry), and only after the key's jobs that
    come before it (expired attempts first, then due retries, then new jobs in ``(priority,
    run_at, id)`` order; a job whose ``run_at`` is still ahead blocks nobody). Claimers are
    serialised per key by transaction-scoped advisory try-locks
    (:func:`sqla_jobs.statements.lock_keys`), taken in a statement before the claim's, so
    that the claim sees whatever the key's previous claimer committed; a key another claim
    is locking is skipped, not waited for. The keyed jobs' batch is filled up with plain
    jobs. Three statements instead of one (two when no key is free), in the same
    transaction, and the key locks last until it ends: keep it short.

    **Queue limits** (``queue_limits={"emails": 3}``). At most that many jobs of a limited
    queue run at once, across all claimers that pass the same limits (declare them once,
    in code every worker shares: :class:`~sqla_jobs.registry.Registry` ``queue_limits``).
    Only live attempts count: running on a lease that has not ended in database time, or
    held by a lock-held worker; a crashed worker's attempt frees its slot when its lease
    ends, and taking it over is a new claim that must fit in the limit. Per limited queue
    served, the claim takes a transaction-scoped advisory try-lock
    (:func:`sqla_jobs.statements.lock_queues`; a queue another claim holds is skipped this
    round, never waited for), then claims at most the queue's free slots from it with a
    claim statement that counts its live attempts
    (:func:`~sqla_jobs.statements.limited_count`), keyed jobs included (``keys=True``:
    they respect both limits; the keyed claim's first statement takes the queue's lock with
    its keys). Limited queues are served first, then the others fill the rest of ``limit``
    with the plain claim, which is unchanged (the same statement as without limits; a
    claim with no limited queue among ``queues`` runs exactly as before). The queue locks
    last until the transaction ends: keep it short.

    Returns the claimed jobs, possibly none. Raises :class:`InvalidJobError` for bad
    arguments, before any SQL runs.
    """
    table = _job_table(model)
    queue_names = _check_queues(queues)
    _check_count("limit", limit, MAX_CLAIM_LIMIT)
    params: dict[str, Any] = {
        "limit": limit,
        "lease_seconds": _seconds("lease", lease),
        "worker": validation.check_name("worker", worker or default_worker_name()),
    }
    if not isinstance(keys, bool):
        raise InvalidJobError("keys", f"must be True or False, not {keys!r}")
    limited: dict[str, int] = {}
    if queue_limits is not None:
        limits = validation.check_queue_limits("queue_limits", queue_limits)
        limited = {name: limits[name] for name in queue_names if name in limits}
    if hold:
        _check_holdable(session)
        if isinstance(session, Connection):
            engine = session.engine
        else:
            bind = session.get_bind()
            engine = bind.engine if isinstance(bind, Connection) else bind
        with engine.begin() as connection:
            rows = _claim_rows(connection, table, params, queue_names, keys, limited)
    else:
        rows = _claim_rows(session, table, params, queue_names, keys, limited)
    running = JobStatus.RUNNING.value
    # The hot path. The rows are sorted in (priority, run_at, id) order by a C-level key,
    # and each job is built positionally (in the order of the claim statement's RETURNING)
    # by tuple.__new__, which ClaimedJob's own __new__ is a Python-level call around.
    new, ordered = tuple.__new__, sorted(rows, key=_CLAIM_ORDER)
    jobs: list[ClaimedJob] = [
        new(
            ClaimedJob,
            (model, job_id, queue, task, args, prio, attempt, most, run_at, lease, trace),
        )
        for job_id, status, queue, task, args, prio, attempt, most, run_at, lease, trace in ordered
        if status == running
    ]
    if len(jobs) < len(rows):
        _log_exhausted(rows, running)
    if hold and jobs:
        return lock(session, jobs)
    return jobs


#: How many keyed jobs per queue (and keys in all) a keyed claim of ``limit`` jobs looks at,
#: beyond ``limit``: keys that are busy are passed over, so it looks a little further.
KEY_SCAN_EXTRA: Final = 16
#: The most jobs of one key a keyed claim starts (a key whose ``key_limit`` is higher gets
#: the rest in the next claims): each costs the claim a read of the job's row.
KEY_CLAIM_MAX: Final = 16


def key_lock_params(queue_names: list[str], limit: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`statements.lock_keys`'s parameters for a keyed claim of ``limit`` jobs, and
    its build options: the rows it reads per queue, ``limit + KEY_SCAN_EXTRA`` rounded up
    (part of the SQL text, so that the statement is planned once, see
    :func:`statements.lock_keys`; rounded to a multiple of 16, or of an eighth of the next
    power of two past 128, so that a worker's varying claim sizes make a few statements,
    8 per doubling at most, and each reads at most an eighth more rows than it needs), and
    the queue count (1, or 2 for several)."""
    scan = limit + KEY_SCAN_EXTRA
    params = _queue_params(queue_names) | {"scan": scan, "per_key": min(limit, KEY_CLAIM_MAX)}
    step = max(16, (1 << (scan - 1).bit_length()) // 8)
    rows = -(-scan // step) * step
    return params, {"rows": rows, "queue_count": min(len(queue_names), 2)}


def _queue_params(queue_names: list[str]) -> dict[str, Any]:
    # The claim statements' queue: a scalar for one (statements built with queue_count=1),
    # else an array.
    if len(queue_names) == 1:
        return {"queue_name": queue_names[0]}
    return {"queue_names": queue_names}


def _claim_rows(
    session: Executor,
    table: Table,
    params: dict[str, Any],
    queue_names: list[str],
    keys: bool,
    limited: dict[str, int],
) -> list[Any]:
    """The rows of one claim: the limited queues' first, each up to its free slots, then
    the other queues' up to ``limit``."""
    if not limited:
        return _claim_from(session, table, params, queue_names, keys)
    limit = params["limit"]
    rows: list[Any] = []
    # A keyed claim takes each queue's lock with its keys; a plain one all of them at once.
    served = list(limited)
    if not keys:
        lock = {"queue_names": served}
        served = [row[0] for row in _rows(session, statements.lock_queues, table, lock)]
    for name in served:
        if len(rows) < limit:
            room = params | {"limit": limit - len(rows), "queue_slots": limited[name]}
            rows.extend(_claim_from(session, table, room, [name], keys, limited=True))
    others = [name for name in queue_names if name not in limited]
    if others and len(rows) < limit:
        rest = params | {"limit": limit - len(rows)}
        rows.extend(_claim_from(session, table, rest, others, keys))
    return rows


def _claim_from(
    session: Executor,
    table: Table,
    params: dict[str, Any],
    queue_names: list[str],
    keys: bool,
    limited: bool = False,
) -> list[Any]:
    """The rows of a claim from ``queue_names``: keyed jobs first (``keys``), then plain
    ones up to the limit. ``limited``: one queue with a concurrency limit
    (``params["queue_slots"]``), whose lock this transaction holds (a plain claim), or takes
    with its keys (a keyed claim: nothing if another claim holds it); each claim statement
    counts the free slots (:func:`statements.limited_count`)."""
    params = params | _queue_params(queue_names)
    options: dict[str, Any] = {"queue_count": min(len(queue_names), 2), "limited": limited}
    if not keys:
        return list(_rows(session, statements.claim, table, params, **options))
    limit = params["limit"]
    lock_params, lock_options = key_lock_params(queue_names, limit)
    if limited:
        lock_params |= {"limit": limit, "queue_slots": params["queue_slots"]}
        lock_options["limited"] = True
    # The keys locked go from the first statement to the second inside the transaction
    # (statements.lock_keys): only their count comes back.
    (locked,) = _rows(session, statements.lock_keys, table, lock_params, **lock_options)
    if limited:
        # The queue's free slots, a hint (the claims count exactly): none, or its lock is
        # another claim's (NULL; then no key was locked either); fewer than the limit, and
        # the claims ask for no more.
        limit = min(limit, locked[3] or 0)
        if limit <= 0:
            return []
    rows: list[Any] = []
    if locked[0]:
        keyed = {
            "queue_names": queue_names,
            "limit": limit,
            "per_key": lock_params["per_key"],
            "lease_seconds": params["lease_seconds"],
            "worker": params["worker"],
        }
        if limited:
            keyed |= {"queue_name": queue_names[0], "queue_slots": params["queue_slots"]}
        rows.extend(_rows(session, statements.claim_keyed, table, keyed, limited=limited))
    if len(rows) < limit:
        rest = params | {"limit": limit - len(rows)}
        rows.extend(_rows(session, statements.claim, table, rest, **options))
    return rows


def _check_holdable(session: Executor) -> None:
    """A lock-held claim commits the attempt on another connection and then locks the rows
    in the caller's transaction: only a READ COMMITTED transaction sees that commit. Under
    REPEATABLE READ or SERIALIZABLE, a snapshot taken earlier would not, and the job would
    be left running with an attempt used up."""
    level = session.execute(statements.transaction_isolation()).scalar()
    if level != "read committed":
        raise ConfigurationError(
            f"claim(hold=True) needs a READ COMMITTED transaction, not {level!s}: the "
            "attempt is committed on another connection, which an earlier snapshot would not "
            "see; begin the transaction with isolation_level='READ COMMITTED'"
        )


def _log_exhausted(rows: Sequence[Any], running: str) -> None:
    # Jobs the claim made dead: their last attempt's lease ran out (its worker died). Logged
    # here, by whoever claimed, so that alerting on errors hears of a crash-looping job.
    for job_id, status, queue, task, _args, _priority, attempt, maximum, *_ in rows:
        if status == running:
            continue
        if status == JobStatus.CANCELLED.value:
            logger.info(
                "job %d (%s) is cancelled: attempt %d lost its lease after its cancel was "
                "requested, and is not run again",
                job_id,
                task,
                attempt,
                extra={
                    "action": "job_cancelled",
                    "job_id": job_id,
                    "task": task,
                    "queue": queue,
                    "attempt": attempt,
                },
            )
            continue
        logger.error(
            "job %d (%s) is dead: attempt %d of %d lost its lease (its worker stopped or "
            "crashed mid-job) and no attempt is left",
            job_id,
            task,
            attempt,
            maximum,
            extra={
                "action": "attempts_exhausted",
                "job_id": job_id,
                "task": task,
                "queue": queue,
                "attempt": attempt,
            },
        )


def lock(session: Executor, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """Lock the rows of these attempts until the caller's transaction ends.

    Returns the jobs whose attempt is still current (fenced); the others were taken over
    after their lease ran out and must not be run. Used by lock-held claims, and by workers
    that count the attempt on one connection and then hold the rows.
    """
    return lock_started(session, jobs)[0]


def job_columns(job: ClaimedJob, session: Executor | None = None) -> dict[str, Any]:
    """The values of the job model's own columns (those not declared by
    :class:`~sqla_jobs.JobMixin`, such as an ``order_id``) in the job's row, by column name:
    one query by primary key, in ``session``'s transaction. A model without columns of its
    own gives ``{}`` without any query (and needs no session)."""
    table = _job_table(job.model)
    own = _own_columns(table)
    if not own:
        return {}
    if session is None:
        raise ConfigurationError("job_columns needs a session to read the job row with")
    row = session.execute(_statement(statements.own_columns, table), {"job_id": job.id}).first()
    if row is None:
        raise JobNotFoundError(f"{job.model.__name__} has no job {job.id}")
    return dict(row._mapping)


def lock_one(session: Executor, job: ClaimedJob) -> float | None:
    """:func:`lock` for one attempt, for a worker that must later be able to end the
    transaction holding the lock: returns that transaction's start (epoch seconds), or None
    when the attempt was taken over (nothing is locked then)."""
    return lock_started(session, [job])[1]


def lock_started(
    session: Executor, jobs: Sequence[ClaimedJob]
) -> tuple[list[ClaimedJob], float | None]:
    """:func:`lock`, returning also what a worker needs to end the transaction holding the
    locks later: the jobs locked (the others were taken over) and that transaction's start
    (epoch seconds; None if none was locked). One statement, on the driver's fast path where
    there is one (:func:`_rows`)."""
    if not jobs:
        return [], None
    rows = _rows(session, statements.lock, _job_table(_one_model(jobs)), _fence_params(jobs))
    kept = _fenced(rows)
    return [job for job in jobs if (job.id, job.attempt) in kept], (
        float(rows[0][2]) if rows else None
    )


# -- outcomes ---------------------------------------------------------------------------


def complete(
    session: Executor,
    job: ClaimedJob,
    *,
    result: Any = _NO_RESULT,
    result_model: type[JobResultMixin] | None = None,
) -> None:
    """Mark this attempt's job succeeded, optionally storing ``result`` in ``result_model``.

    Runs in the caller's transaction: the completion commits together with the caller's
    other writes. ``result_model`` defaults to the job model's own ``result_model`` (see
    :class:`~sqla_jobs.JobMixin`). Raises :class:`LeaseLostError` when the attempt no longer
    owns the job (nothing changes then), and :class:`InvalidJobError` for a result jsonb
    cannot store. When the job's cancel was requested (:func:`cancel`) it is made
    ``cancelled`` instead, its result not stored, and :class:`JobCancelledError` is raised:
    commit as usual to record it (or roll back: the job still ends cancelled, once the
    attempt's lease runs out).
    """
    results = None if result is _NO_RESULT else [result]
    lost, cancelled = complete_attempts(session, [job], results=results, result_model=result_model)
    if lost:
        raise LeaseLostError(
            f"job {job.id} attempt {job.attempt} no longer owns the job; nothing was changed"
        )
    if cancelled:
        raise JobCancelledError(
            f"job {job.id} was cancelled while attempt {job.attempt} ran: it is cancelled, "
            "not succeeded, and its result was not stored"
        )


def complete_many(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    *,
    results: Sequence[Any] | None = None,
    result_model: type[JobResultMixin] | None = None,
) -> list[ClaimedJob]:
    """Complete a batch of attempts in one statement (two with results).

    ``results``, if given, pairs with ``jobs`` by position and needs ``result_model`` (by
    default the job model's ``result_model``). Returns the attempts that had lost their job
    (fenced out, nothing changed for them); the others are succeeded, or deleted if the
    model sets ``delete_on_success``, or cancelled (their results not stored) when their
    cancel was requested.
    """
    return complete_attempts(session, jobs, results=results, result_model=result_model)[0]


def complete_attempts(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    *,
    results: Sequence[Any] | None = None,
    result_model: type[JobResultMixin] | None = None,
) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
    """:func:`complete_many`, also saying which of the jobs ended cancelled instead (their
    cancel was requested): returns ``(lost, cancelled)``."""
    if not jobs:
        return [], []
    model = _one_model(jobs)
    table = _job_table(model)
    if has_history(model):
        return _complete_into_history(session, table, jobs, results)
    result_table = _results_target(model, jobs, results, result_model)
    cancelled: set[tuple[int, int]] = set()
    if model.delete_on_success:
        done = _fenced(_rows(session, statements.complete_and_delete, table, _fence_params(jobs)))
        if len(done) < len(jobs):  # not deleted: lost, or cancel requested (rare)
            cancelled = _fenced(
                session.execute(
                    _statement(statements.cancel_attempts, table),
                    _fence_params(_lost(jobs, done)),
                )
            )
    else:
        cancelled_value = JobStatus.CANCELLED.value
        rows = _rows(session, statements.complete, table, _fence_params(jobs))
        if (
            len(rows) == len(jobs)
            and result_table is None
            and cancelled_value not in map(_ROW_STATUS, rows)
        ):
            # The common case, without a set built and searched per job: every attempt
            # matched (a row comes back once per distinct fence matched, so as many rows as
            # jobs means all of them), and none ended cancelled.
            return [], []
        done = set()
        for row in rows:
            (cancelled if row[3] == cancelled_value else done).add((row[0], row[1]))
    _store_results(session, result_table, jobs, results, done)
    if not cancelled:
        return _lost(jobs, done), []
    ended_cancelled = [job for job in jobs if (job.id, job.attempt) in cancelled]
    return _lost(jobs, done | cancelled), ended_cancelled


def complete_held(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    *,
    results: Sequence[Any] | None = None,
    result_model: type[JobResultMixin] | None = None,
) -> list[ClaimedJob]:
    """:func:`complete_many` for attempts whose rows the caller's transaction holds locked
    (:func:`lock`), as a lock-held worker completes its group: each row is found through
    its primary key (:func:`sqla_jobs.statements.complete_held`), and a job whose cancel
    was requested is left untouched, still running. Returns the attempts not completed
    (their cancel requested, or no longer theirs): roll back what was done for them, and
    cancel them (fenced) once this transaction has ended."""
    if not jobs:
        return []
    model = _one_model(jobs)
    table = _job_table(model)
    if has_history(model):
        lost, _ = _complete_into_history(session, table, jobs, results, held=True)
        return lost
    result_table = _results_target(model, jobs, results, result_model)
    # complete_and_delete leaves a job whose cancel was requested as it is already.
    builder = (
        statements.complete_and_delete if model.delete_on_success else statements.complete_held
    )
    done = _fenced(_rows(session, builder, table, _fence_params(jobs)))
    _store_results(session, result_table, jobs, results, done)
    return _lost(jobs, done)


def _results_target(
    model: type[JobMixin],
    jobs: Sequence[ClaimedJob],
    results: Sequence[Any] | None,
    result_model: type[JobResultMixin] | None,
) -> Table | None:
    """The result table that ``results`` (checked here) go to; None without results."""
    if results is None:
        return None
    result_model = result_model or model.result_model
    if result_model is None:
        raise InvalidJobError("result_model", "is required to store results")
    if len(results) != len(jobs):
        raise InvalidJobError("results", f"has {len(results)} items for {len(jobs)} jobs")
    for value in results:
        validation.check_json("result", value)
    return _result_table(result_model)


def _store_results(
    session: Executor,
    result_table: Table | None,
    jobs: Sequence[ClaimedJob],
    results: Sequence[Any] | None,
    done: set[tuple[int, int]],
) -> None:
    if result_table is None or results is None or not done:
        return
    payload = [
        {"job_id": job.id, "task": job.task, "value": value}
        for job, value in zip(jobs, results, strict=True)
        if (job.id, job.attempt) in done
    ]
    session.execute(_statement(statements.store_results, result_table), {"results": payload})


def _complete_into_history(
    session: Executor,
    table: Table,
    jobs: Sequence[ClaimedJob],
    results: Sequence[Any] | None,
    *,
    held: bool = False,
) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
    # The job moves into its history table, succeeded, with its result, in one statement
    # (sqla_jobs.history.statements.complete): no result table is involved.
    values: dict[str, Any] = {}
    if results is not None:
        if len(results) != len(jobs):
            raise InvalidJobError("results", f"has {len(results)} items for {len(jobs)} jobs")
        for job, value in zip(jobs, results, strict=True):
            validation.check_json("result", value)
            if value is not None:  # None: no result (SQL null), as a worker stores none
                values[f"{job.id}:{job.attempt}"] = value
    params = _fence_params(jobs) | {"results": _encode(values) if values else "{}"}
    done: set[tuple[int, int]] = set()
    cancelled: set[tuple[int, int]] = set()
    for row in _rows(session, history_statements.complete, table, params, held=held):
        (cancelled if row[3] == JobStatus.CANCELLED.value else done).add((row[0], row[1]))
    ended_cancelled = [job for job in jobs if (job.id, job.attempt) in cancelled]
    return _lost(jobs, done | cancelled), ended_cancelled


def storable_text(text: str) -> str:
    """``text`` as a PostgreSQL text column stores it: NUL replaced, and lone surrogates
    (``os.fsdecode`` of a file name that is not UTF-8) written as ``\\udcff`` escapes,
    which the driver could not encode."""
    text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _error_text(error: str | BaseException) -> str:
    if isinstance(error, BaseException):
        try:
            text = "".join(traceback.format_exception(error))
        except Exception:  # an exception whose __str__ raises: say what it was at least
            text = f"{type(error).__name__} (its message could not be read)"
    else:
        text = str(error)
    # Keep the end of a long traceback, where the cause is.
    if len(text) > MAX_ERROR_CHARS:
        text = "...\n" + text[-MAX_ERROR_CHARS:]
    return storable_text(text)


def fail(
    session: Executor,
    job: ClaimedJob,
    error: str | BaseException,
    *,
    retry: bool = True,
    delay: timedelta | float | None = None,
    policy: RetryPolicy | None = None,
) -> FailOutcome:
    """Record that this attempt failed with ``error`` (a message or an exception).

    The job is retried after ``delay`` if given, else after the ``policy``'s exponential
    backoff with jitter, both measured from the database's clock; it is dead instead when
    this was its last attempt or ``retry`` is false, and ``cancelled`` when its cancel was
    requested (:func:`cancel`). The error (a traceback for an
    exception) is kept in ``last_error``, which nothing else clears: a job that later
    succeeds keeps it, so it is the last error of any attempt. Raises
    :class:`LeaseLostError` when the attempt no longer owns the job, and then nothing
    changes.
    """
    policy = policy or RetryPolicy()
    table = _job_table(job.model)
    params = {
        "job_id": job.id,
        "attempt": job.attempt,
        "error": _error_text(error),
        "retry": bool(retry),
        "delay_seconds": None if delay is None else _seconds("delay", delay),
        "base": policy.base.total_seconds(),
        "cap": policy.cap.total_seconds(),
        "jitter": policy.jitter,
    }
    row = session.execute(_statement(statements.fail, table), params).one_or_none()
    if row is None:
        raise LeaseLostError(
            f"job {job.id} attempt {job.attempt} no longer owns the job; nothing was changed"
        )
    if row.status == JobStatus.DEAD.value and has_history(job.model):
        # Dead: into the history, in the same transaction as the failure.
        session.execute(_statement(history_statements.move_finished, table), {"job_id": job.id})
    return FailOutcome(job_id=row.id, status=JobStatus(row.status), run_at=row.run_at)


def heartbeat(
    session: Executor,
    jobs: Sequence[ClaimedJob],
    *,
    lease: timedelta | float | Sequence[timedelta | float] = DEFAULT_LEASE,
) -> list[ClaimedJob]:
    """Extend these attempts' leases to ``lease`` from now, in database time.

    ``lease`` is one duration for all, or a sequence with one per job. One statement for
    the batch; it never waits on a row lock (see :func:`sqla_jobs.statements.heartbeat`).
    Returns the attempts whose lease was not extended: their lease had run out and another
    attempt took over, or the job is finished, or its row was locked by another transaction
    at that moment (a lock-held job's own transaction: its row lock keeps every other claim
    away already). Stop working on a lease-mode attempt returned here.
    """
    if not jobs:
        return []
    table = _job_table(_one_model(jobs))
    if isinstance(lease, timedelta | float | int):
        seconds = [_seconds("lease", lease)] * len(jobs)
    else:
        seconds = [_seconds("lease", value) for value in lease]
        if len(seconds) != len(jobs):
            raise InvalidJobError("lease", f"has {len(seconds)} items for {len(jobs)} jobs")
    params = _fence_params(jobs) | {"fence_leases": ",".join(map(repr, seconds))}
    rows = _rows(session, statements.heartbeat, table, params)
    return _lost(jobs, _fenced(rows))


def release(session: Executor, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """Give these attempts' jobs back unfinished, runnable at once by any worker.

    For a worker shutting down with work it will not finish. The attempt is not charged
    against the job (``max_attempts`` grows by one); a job whose cancel was requested ends
    ``cancelled`` instead. Returns the attempts that had already lost their job.
    """
    if not jobs:
        return []
    table = _job_table(_one_model(jobs))
    rows = session.execute(_statement(statements.release, table), _fence_params(jobs))
    return _lost(jobs, _fenced(rows))


# -- administration ---------------------------------------------------------------------


def _admin(
    session: Executor,
    model: type[JobMixin],
    job_id: int,
    builder: Callable[..., Executable],
    expected: str,
) -> None:
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise InvalidJobError("job_id", f"must be an integer, not {type(job_id).__name__}")
    table = _job_table(model)
    params = {"job_id": job_id}
    history = has_history(model)
    if session.execute(_statement(builder, table), params).first() is not None:
        if history:  # a cancelled job moves into the history at once
            session.execute(_statement(history_statements.move_finished, table), params)
        return
    # A finished job of a model with history is there: a retry moves it back, pending.
    if (
        history
        and builder is statements.retry
        and session.execute(_statement(history_statements.retry, table), params).first()
    ):
        return
    status = session.execute(_statement(statements.status_of, table), params).scalar()
    if status is None and history:
        status = session.execute(_statement(history_statements.status_of, table), params).scalar()
    if status is None:
        raise JobNotFoundError(f"{model.__name__} has no job {job_id}")
    raise JobStateError(f"job {job_id} is {status}; only {expected} jobs can be changed so")


def retry(session: Executor, model: type[JobMixin], job_id: int) -> None:
    """Make a dead or cancelled job pending again, runnable now, with at least one more
    attempt. Raises :class:`JobNotFoundError` or :class:`JobStateError`, the latter also
    when the job is a unique job whose key another pending or running job holds now (the
    caller's transaction stays usable: the attempt runs under a savepoint).

    For a model with ``partitioned_history``, a dead or cancelled job found in the history
    moves back into the job table (same id, ``attempts`` kept), in one statement."""
    try:
        with session.begin_nested():
            _admin(session, model, job_id, statements.retry, "dead or cancelled")
    except IntegrityError as exc:
        if names(_job_table(model).name).unique_index not in str(exc.orig):
            raise
        raise JobStateError(
            f"job {job_id} cannot be retried: another job holds its unique key"
        ) from exc


def cancel(session: Executor, model: type[JobMixin], job_id: int) -> JobStatus:
    """Cancel a job: at once if it is pending, by asking its worker if it is running.

    Returns the job's status once the caller commits: ``cancelled`` for a pending job (or
    one already cancelled: idempotent), ``running`` for a running one, whose cancel is now
    *requested* (:func:`sqla_jobs.statements.request_cancel`): its worker hears of it
    through a notification on the table's channel at commit (and at its next heartbeat if
    it missed that), cancels a coroutine handler, raises
    :class:`~sqla_jobs.errors.JobCancelledError` from ``ctx.raise_if_cancelled()`` in a
    thread handler, rolls a lock-mode handler's transaction back, and ends the job
    ``cancelled``, fenced by its attempt. From the request on, the job never succeeds,
    retries or runs again: a handler that ignores the request and returns ends cancelled
    all the same (its result is not stored), and if its worker died, the claim that finds
    its lease expired makes it cancelled instead of running it.

    Runs in the caller's transaction: nothing happens until the caller commits. Raises
    :class:`InvalidJobError` for a ``job_id`` that is not an integer (before any SQL),
    :class:`JobNotFoundError` when there is no such job, and :class:`JobStateError` when it
    already succeeded or is dead (use :func:`retry` first for a dead one).
    """
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise InvalidJobError("job_id", f"must be an integer, not {type(job_id).__name__}")
    table = _job_table(model)
    params = {"job_id": job_id}
    history = has_history(model)
    if session.execute(_statement(statements.cancel, table), params).first() is not None:
        if history:  # a cancelled job moves into the history at once
            session.execute(_statement(history_statements.move_finished, table), params)
        return JobStatus.CANCELLED
    if session.execute(_statement(statements.request_cancel, table), params).first() is not None:
        return JobStatus.RUNNING
    status = session.execute(_statement(statements.status_of, table), params).scalar()
    if status is None and history:
        status = session.execute(_statement(history_statements.status_of, table), params).scalar()
    if status is None:
        raise JobNotFoundError(f"{model.__name__} has no job {job_id}")
    if status == JobStatus.CANCELLED.value:
        return JobStatus.CANCELLED
    raise JobStateError(f"job {job_id} is {status}; only pending or running jobs can be cancelled")


def cancel_attempts(session: Executor, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """End these attempts' jobs ``cancelled`` (the worker's outcome for an attempt whose
    cancel was requested). Fenced: returns the attempts that had lost their job."""
    if not jobs:
        return []
    table = _job_table(_one_model(jobs))
    rows = session.execute(_statement(statements.cancel_attempts, table), _fence_params(jobs))
    return _lost(jobs, _fenced(rows))


def cancel_requests(session: Executor, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """Which of these attempts' jobs have a cancel request (:func:`cancel`). A plain read,
    no lock; the worker's heartbeat asks it, in case it missed the notification."""
    if not jobs:
        return []
    table = _job_table(_one_model(jobs))
    rows = session.execute(_statement(statements.cancel_requests, table), _fence_params(jobs))
    asked = _fenced(rows)
    return [job for job in jobs if (job.id, job.attempt) in asked]


def delete(session: Executor, model: type[JobMixin], job_id: int) -> None:
    """Delete a job that is not running (pending, succeeded, dead or cancelled), in the
    caller's transaction. Raises :class:`JobNotFoundError`, or :class:`JobStateError` when
    the job is running (its attempt owns it until it ends). A stored result row of the job
    is kept (results are deliberately not tied to job rows; see :class:`JobResultMixin`).
    """
    _admin(session, model, job_id, statements.delete_job, "pending or finished")


def prune(
    session: Executor,
    model: type[JobMixin],
    *,
    older_than: timedelta | float,
    limit: int = 10_000,
) -> int:
    """Delete one batch: up to ``limit`` finished jobs (succeeded, dead, cancelled) that
    finished more than ``older_than`` ago, by the database's clock, oldest ids first.
    Returns how many were deleted.

    One call deletes one batch, in the caller's transaction. To delete them all, call it
    again, each time in a new transaction (so that no transaction holds a long delete),
    until it returns less than ``limit``. ``sqla-jobs prune --batch-size N`` is that loop:
    one batch of ``N`` per transaction until a batch comes back short.

    A model with ``partitioned_history`` keeps no finished job here to delete: its history
    is pruned by dropping whole partitions, which :func:`sqla_jobs.history.drop_partitions`
    and ``sqla-jobs prune`` do; this raises :class:`ConfigurationError` for it."""
    table = _job_table(model)
    if has_history(model):
        raise ConfigurationError(
            f"{model.__name__} keeps its finished jobs in a partitioned history: prune it "
            "with sqla_jobs.history.drop_partitions(engine, model, older_than=...) or "
            "sqla-jobs prune, which drop whole partitions"
        )
    _check_count("limit", limit, MAX_CLAIM_LIMIT * 100)
    params = {"older_than_seconds": _seconds("older_than", older_than), "limit": limit}
    result = cast(CursorResult[Any], session.execute(_statement(statements.prune, table), params))
    return result.rowcount


def vacuum(engine: Engine, model: type[JobMixin], *, min_dead_rows: int = VACUUM_DEAD_ROWS) -> bool:
    """Vacuum the job table if it holds at least ``min_dead_rows`` dead row versions; return
    whether a ``VACUUM`` was run.

    Why: a claim reads the pending index from its head, and every job claimed since the last
    vacuum leaves a dead entry there, so claims get slower the more jobs are claimed between
    vacuums (measured on PostgreSQL 15: a 1M-job drain without a vacuum ran at 0.39 of the
    rate of 50k-job drains beside it; with this, called every 5,000 jobs, at 0.90).
    Autovacuum wakes up once a minute per database at best, and may be off or busy; the
    processes that claim call this instead, every few thousand jobs they claim (the check is
    one read of the statistics; the VACUUM runs only past the threshold), so that no one has
    to tune autovacuum::

        # in a thread of its own, after every 5,000 jobs this process claimed
        sqla_jobs.vacuum(engine, EmailJob)

    It reads the table's dead row count from PostgreSQL's statistics (no table access), and
    only if that reaches ``min_dead_rows`` runs :func:`sqla_jobs.statements.vacuum`: a
    ``VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON)``, which skips the table when another vacuum of
    it (autovacuum's, another worker's) is running, and blocks no claim, enqueue or outcome.
    Many workers calling it need no coordination. It takes time (a pass over every index of
    the table): call it from a thread of its own, never from a loop that claims.

    VACUUM cannot run in a transaction, so this takes an :class:`~sqlalchemy.engine.Engine`
    and runs on a connection of its own in autocommit mode, returned to the pool afterwards:
    nothing of the caller's transactions is involved. A vacuum removes only the rows that no
    open transaction can still see: a long transaction anywhere on the server (an idle one,
    a long report) leaves the dead entries in place until it ends.
    """
    table = _job_table(model)
    threshold: object = min_dead_rows
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise InvalidJobError("min_dead_rows", f"must be an integer >= 0, got {threshold!r}")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        dead = connection.execute(_statement(statements.dead_rows, table)).scalar_one()
        if dead < min_dead_rows:
            return False
        started = monotonic()
        connection.execute(statements.vacuum(table))
    seconds = monotonic() - started
    logger.info(
        "vacuumed %s (%d dead row versions) in %.2f s",
        table.fullname,
        dead,
        seconds,
        extra={"action": "table_vacuumed", "dead_rows": dead, "seconds": seconds},
    )
    return True


def queue_stats(session: Executor, model: type[JobMixin]) -> list[QueueStat]:
    """Live job counts by queue and status (``pending``, ``running``, ``dead``), with the
    runnable count and the age of the oldest runnable job, and the expired leases.

    Cheap at any size of history: it reads only the pending, running and dead partial
    indexes (:func:`sqla_jobs.statements.queue_stats`), so its cost grows with the jobs
    waiting, running and dead, never with the succeeded and cancelled rows, which it does
    not count. For a model with ``partitioned_history`` the dead count includes the dead
    jobs in its history table (read from the history's dead index, not from the history).
    Ages are the database's clock. Takes no lock; runs in the caller's
    transaction. For the server-wide gauges (vacuum, table size) see
    :func:`sqla_jobs.health.read_gauges`.
    """
    table = _job_table(model)
    return [
        QueueStat(
            queue=row.queue,
            status=JobStatus(row.status),
            count=int(row.total),
            oldest_pending_seconds=(
                None if row.oldest_runnable_seconds is None else float(row.oldest_runnable_seconds)
            ),
            runnable=int(row.runnable),
            expired_leases=int(row.expired),
        )
        for row in session.execute(
            _statement(statements.queue_stats, table, history=_dead_history(model, table))
        )
    ]


def _dead_history(model: type[JobMixin], table: Table) -> Table | None:
    # A model with partitioned_history keeps its dead jobs in its history table: health
    # reads them there too (from the history's dead index), other models pay nothing.
    return history_table(table) if has_history(model) else None


@dataclass(frozen=True, slots=True)
class DeadJob:
    """A row of :func:`dead_jobs`."""

    id: int
    queue: str
    task: str
    attempts: int
    finished_at: datetime | None
    last_error: str | None


def dead_jobs(session: Executor, model: type[JobMixin], *, limit: int = 20) -> list[DeadJob]:
    """The ``limit`` most recently finished dead jobs, newest first, with their last error
    (for a model with ``partitioned_history``, those in its history table too)."""
    table = _job_table(model)
    _check_count("limit", limit, MAX_CLAIM_LIMIT)
    rows = session.execute(
        _statement(statements.dead_jobs, table, history=_dead_history(model, table)),
        {"limit": limit},
    )
    return [
        DeadJob(
            id=row.id,
            queue=row.queue,
            task=row.task,
            attempts=row.attempts,
            finished_at=row.finished_at,
            last_error=row.last_error,
        )
        for row in rows
    ]
