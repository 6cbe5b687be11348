"""Enqueueing many jobs at once, and unique jobs (see :mod:`sqla_jobs.queue`)."""

from __future__ import annotations

import hashlib
import itertools
import json
import json.scanner
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import (
    Table,
    inspect,
)
from sqlalchemy.orm import Session

from sqla_jobs import _queries as statements
from sqla_jobs import tracing, validation
from sqla_jobs._queries.enqueueing import (
    ENQUEUE_DEBOUNCED,
    ENQUEUE_MANY,
    ENQUEUE_UNIQUE,
    DebouncedParams,
    EnqueueParams,
)
from sqla_jobs._queries.run import job_table_of
from sqla_jobs.errors import (
    InvalidJobError,
    SqlaJobsError,
    UniqueJobError,
)
from sqla_jobs.queue._plumbing import (
    DEFAULT_ENQUEUE_CHUNK,
    MAX_ENQUEUE_CHUNK,
    _check_count,
    _encode,
    _own_columns,
)
from sqla_jobs.schema import (
    DEFAULT_UNIQUE_STATUSES,
    JobMixin,
    JobStatus,
)

# -- bulk enqueue -----------------------------------------------------------------------


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
    ENQUEUE_MANY.result(
        session, table, {"rows": chunk[0], "trace_context": tracing.enqueue_context()}
    )
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
    chunk sent as one JSON document (:func:`sqla_jobs._queries.enqueue_many`). Like
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
    table = job_table_of(model)
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


def check_unique_key(key: object) -> str:
    """An explicit unique key: a string of 1 to :data:`MAX_UNIQUE_KEY_LENGTH` characters
    that PostgreSQL stores as given (:class:`~sqla_jobs.errors.UniqueJobError` otherwise)."""
    if not isinstance(key, str):
        raise UniqueJobError("unique_key", f"must be a string, not {type(key).__name__}")
    if not key or len(key) > MAX_UNIQUE_KEY_LENGTH:
        raise UniqueJobError(
            "unique_key", f"must be 1 to {MAX_UNIQUE_KEY_LENGTH} characters, got {len(key)}"
        )
    problem = validation.text_problem(key)
    if problem is not None:
        raise UniqueJobError("unique_key", problem)
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
        unique_key_of(row["task"], row.get("args")) if key is None else check_unique_key(key)
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
    table = job_table_of(model)
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
    """Run :data:`~sqla_jobs._queries.enqueueing.ENQUEUE_UNIQUE` for ``rows`` until every row
    has its job."""
    results: list[Enqueued | None] = [None] * len(rows)
    todo = list(range(len(rows)))
    trace_context = tracing.enqueue_context()  # as in _insert_chunk
    for _ in range(_MAX_UNIQUE_ROUNDS):
        batch = [rows[i] | {"n": position} for position, i in enumerate(todo)]
        try:
            document = _encode(batch)
        except (TypeError, ValueError) as exc:  # a value of the model's own columns
            raise InvalidJobError("jobs", str(exc)) from exc
        seen: set[str] = set()
        unresolved: list[int] = []
        params: EnqueueParams = {"rows": document, "trace_context": trace_context}
        for n, key, inserted_id, holder_id in ENQUEUE_UNIQUE.rows(session, table, params):
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


def enqueue_debounced(
    session: Session,
    job: JobMixin,
    *,
    window: timedelta | float,
    key: str | None = None,
    max_wait: timedelta | float | None = None,
) -> Enqueued:
    """Enqueue ``job`` (an unsaved instance of a job model) debounced: a burst of enqueues
    under one ``key`` leaves one pending job, which runs once, ``window`` after the last of
    them (by the database's clock), with the last one's arguments.

    The first enqueue of a burst inserts the job, to run ``window`` from now; each one after
    it, while the job is still pending, makes that job this one instead (its arguments, its
    priority, the model's own columns: every column it sets) and moves its ``run_at`` to
    ``window`` from now. Once the job has started, the next enqueue starts the next burst
    with a new job. ``max_wait`` (at least ``window``) caps the wait after the burst's first
    enqueue, so that a stream that never pauses still runs every ``max_wait``. ``key``
    defaults to the task's name (one debounced job per task); give one per entity
    (``key=f"reindex:{user_id}"``) to debounce each on its own. Keys are the unique jobs'
    (:func:`enqueue_unique`): a debounced job holds its key while pending, and a unique job
    with the same key would stand in its place.

    Enforced by the database, in the caller's transaction (it never commits): ``INSERT ...
    ON CONFLICT DO UPDATE`` on the unique index, so concurrent enqueuers in any number of
    processes leave one pending job per key; of enqueues racing each other, the last to
    commit writes the arguments. A rolled-back enqueue changes nothing (one that inserted
    the job takes it away again, unless another committed meanwhile). Use READ COMMITTED
    (the default): under REPEATABLE READ or SERIALIZABLE, a key another transaction changed
    since the snapshot is a serialization failure. Returns :class:`Enqueued` (``inserted``
    false when the pending job took this enqueue). The instance is not added to the session.

    Bad input (a job with a ``run_at``, which the window sets; a window or ``max_wait`` that
    is not more than 0 and at most a day; ``max_wait`` shorter than ``window``; a bad key)
    raises :class:`~sqla_jobs.errors.InvalidJobError` before any SQL runs::

        with Session(engine) as session, session.begin():
            sqla_jobs.enqueue_debounced(
                session,
                EmailJob(task="reindex", args={"user": 7}),
                key="reindex:7",
                window=timedelta(seconds=5),
            )
    """
    model = type(job)
    table = job_table_of(model)
    seconds = validation.check_debounce_window("window", window).total_seconds()
    cap = (
        None
        if max_wait is None
        else validation.check_debounce_window("max_wait", max_wait).total_seconds()
    )
    if cap is not None and cap < seconds:
        raise InvalidJobError(
            "max_wait", f"must be at least the window ({seconds:g} s), got {cap:g} s"
        )
    row = _job_row(model, job, _own_columns(table))
    if row.get("run_at") is not None:
        raise InvalidJobError(
            "run_at", "a debounced job runs `window` after the last enqueue: leave run_at unset"
        )
    row["unique_key"] = check_unique_key(row["task"] if key is None else key)
    document = _encode([row])
    session.flush()
    params: DebouncedParams = {
        "rows": document,
        "trace_context": tracing.enqueue_context(),
        "window": seconds,
        "max_wait": cap,
    }
    (found,) = ENQUEUE_DEBOUNCED.rows(session, table, params)
    return Enqueued(found.id, bool(found.inserted), row["unique_key"])
