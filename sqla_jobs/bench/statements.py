"""The benchmark's own SQL: the ceiling's plain queue, filling, watching and resetting its
tables, and server facts.

Builders in the manner of :mod:`sqla_jobs._queries`, which holds every statement the queue
itself runs. These are the ones only the benchmark needs, kept here so that the queue's
statement layer stays the queue's. Pure functions: no session, no I/O.

The ceiling (``seed_*``) is not the library's statements run bare: it is the simplest correct
queue SQL, the one the articles that made ``SKIP LOCKED`` queues popular show (a CTE that
selects ``FOR UPDATE SKIP LOCKED`` feeding an ``UPDATE ... RETURNING``), with the lease folded
into the claim and each completion fenced by the attempt it completes. Written as SQL text on
purpose: it is what a user would write by hand, and what the library has to be measured
against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    BindParameter,
    Column,
    ColumnElement,
    DateTime,
    Delete,
    Exists,
    Identity,
    Index,
    Insert,
    Integer,
    MetaData,
    Select,
    Table,
    Text,
    TextClause,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from sqla_jobs.ddl import qualified_name, quote
from sqla_jobs.schema import JobStatus

__all__ = [
    "SEED_TABLE",
    "WRITES_TABLE",
    "backend_pid",
    "clear",
    "create_database",
    "create_schema",
    "database_clock",
    "delete_queue",
    "drop_constraint",
    "drop_database",
    "drop_index",
    "drop_schema",
    "fill",
    "fill_burst",
    "fill_history",
    "fill_keyed",
    "fill_tenants",
    "finished",
    "first_claims",
    "has_runnable",
    "row_count",
    "seed_claim",
    "seed_complete",
    "seed_lock",
    "seed_lock_complete",
    "seed_metadata",
    "seed_relock",
    "server_facts",
    "set_user_triggers",
    "stored_results",
    "table_size",
    "truncate",
    "vacuum_analyze",
    "wait_events",
    "wal_position",
    "write_row",
]

_ONE: Final[ColumnElement[int]] = literal_column("1", Integer)

#: The tables only the benchmark makes (:data:`SEED_TABLE`).
seed_metadata: Final = MetaData()

#: The ceiling's own table: the seed articles' job table, with the columns its loops read
#: and write and nothing else (no unique key, ordering key, trace, time limit, progress),
#: and its one index, the pending jobs' in claim order. The fair ceiling (issue 27): the
#: simplest correct SQL on the simplest table that SQL needs, not on the library's table,
#: whose shape (more columns, more indexes) would make the ceiling pay what the library
#: pays. The same loops on the library's table are measured beside it.
SEED_TABLE: Final = Table(
    "sqla_jobs_bench_seed_jobs",
    seed_metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("queue", Text, nullable=False),
    Column("task", Text, nullable=False),
    Column("args", JSONB, nullable=False),
    Column("status", Text, nullable=False, server_default=JobStatus.PENDING.value),
    Column("priority", Integer, nullable=False, server_default="0"),
    Column("run_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Index(
        "sqla_jobs_bench_seed_jobs_pending_idx",
        "queue",
        "priority",
        "run_at",
        "id",
        postgresql_where=text(f"status = '{JobStatus.PENDING.value}'"),
    ),
)
#: What a lock-held handler that writes (``bench_write_lock``) writes: one row per job, through
#: the claim's session (``drain.lock.writes``).
WRITES_TABLE: Final = Table(
    "sqla_jobs_bench_writes",
    seed_metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("job_id", BigInteger, nullable=False),
)
_SUCCEEDED_VALUE: Final = JobStatus.SUCCEEDED.value
_SUCCEEDED: Final[ColumnElement[str]] = literal_column(f"'{_SUCCEEDED_VALUE}'")


def fill(table: Table, *, finished: bool = False) -> Insert:
    """Insert ``:count`` no-op jobs of task ``:task`` in queue ``:queue`` in one statement
    (``generate_series``): pending ones for a drain, or ``succeeded`` ones (``finished``)
    as the history a long-lived queue table carries."""
    series = func.generate_series(_ONE, bindparam("count", type_=Integer)).table_valued("n")
    values: list[ColumnElement[Any]] = [
        bindparam("queue", type_=Text),
        bindparam("task", type_=Text),
        literal_column("'{}'::jsonb"),
    ]
    names = ["queue", "task", "args"]
    if finished:
        values += [_SUCCEEDED, _ONE, func.statement_timestamp()]
        names += ["status", "attempts", "finished_at"]
    return insert(table).from_select(
        names, select(*values).select_from(series), include_defaults=False
    )


def _pending_in_order(table: Table, columns: str = "id") -> str:
    # The literal status matches the pending index's predicate, so the index serves it, in
    # its own order (queue, priority, run_at, id). On the library's job table, whose pending
    # index is partial on jobs without an ordering key too, the condition says so: without
    # it, no index of that table serves the claim, which then reads and sorts every pending
    # job (a sequential scan per claim).
    keyless = " AND ordering_key IS NULL" if "ordering_key" in table.c else ""
    return (
        f"SELECT {columns} FROM {qualified_name(table.name, table.schema)} "
        f"WHERE status = '{JobStatus.PENDING.value}'{keyless} AND queue = :queue "
        "AND run_at <= now() ORDER BY priority, run_at, id"
    )


def seed_claim(table: Table) -> TextClause:
    """The ceiling's lease-mode claim: up to ``:limit`` pending jobs of ``:queue``, locked
    ``FOR UPDATE SKIP LOCKED`` and flipped to ``running`` with an attempt counted and a lease
    of ``:lease_seconds``, in one statement. Returns ``id, attempts, task, args``."""
    name = qualified_name(table.name, table.schema)
    return text(
        f"WITH next_jobs AS ({_pending_in_order(table)} FOR UPDATE SKIP LOCKED LIMIT :limit) "
        f"UPDATE {name} AS job SET status = '{JobStatus.RUNNING.value}', "
        "attempts = job.attempts + 1, "
        "lease_expires_at = now() + make_interval(secs => :lease_seconds) "
        "FROM next_jobs WHERE job.id = next_jobs.id "
        "RETURNING job.id, job.attempts, job.task, job.args"
    )


def seed_complete(table: Table, *, many: bool) -> TextClause:
    """The ceiling's lease-mode completion, fenced by attempt: ``:id``/``:attempt`` succeed
    if that attempt still runs them; ``many``: the same for the arrays ``:ids``/``:attempts``
    (``unnest`` pairs them)."""
    name = qualified_name(table.name, table.schema)
    done = f"SET status = '{_SUCCEEDED_VALUE}', finished_at = now()"
    running = f"job.status = '{JobStatus.RUNNING.value}'"
    if not many:
        return text(
            f"UPDATE {name} AS job {done} "
            f"WHERE job.id = :id AND job.attempts = :attempt AND {running}"
        )
    return text(
        f"UPDATE {name} AS job {done} "
        "FROM unnest(CAST(:ids AS bigint[]), CAST(:attempts AS integer[])) AS f(id, attempt) "
        f"WHERE job.id = f.id AND job.attempts = f.attempt AND {running}"
    )


def seed_lock(table: Table) -> TextClause:
    """The ceiling's lock-held claim: up to ``:limit`` pending jobs of ``:queue`` locked
    ``FOR UPDATE SKIP LOCKED``, held until the transaction ends. Returns ``id, task, args``."""
    pending = _pending_in_order(table, "id, task, args")
    return text(f"{pending} FOR UPDATE SKIP LOCKED LIMIT :limit")


def seed_lock_complete(table: Table, *, many: bool) -> TextClause:
    """The ceiling's lock-held completion, in the claim's transaction (the row lock is the
    fence): job ``:id`` (``many``: every id of ``:ids``) succeeded, its attempt counted."""
    name = qualified_name(table.name, table.schema)
    where = "id = ANY(CAST(:ids AS bigint[]))" if many else "id = :id"
    return text(
        f"UPDATE {name} SET status = '{_SUCCEEDED_VALUE}', attempts = attempts + 1, "
        f"finished_at = now() WHERE {where}"
    )


def seed_relock(table: Table) -> TextClause:
    """The counted lock-held ceiling's second step: lock the rows of the attempts
    ``:ids``/``:attempts`` (claimed and committed by :func:`seed_claim`) until the
    transaction ends, those still running that attempt (fenced). Returns ``id``.

    Each row is found through the primary key and its attempt read at its id's place in
    ``:attempts``, as the library's own lock does (:func:`sqla_jobs._queries._sql._fences`).
    Written as a join with the unnested pairs, the loop ran at 21-23k jobs/s in one bench
    run and 49-61k in others: the planner's statistics made the join a nested loop over the
    pairs, or over an index, for each row, or not. One ``LATERAL`` lookup per pair read the
    running index once per pair (37 ms per batch of 500)."""
    name = qualified_name(table.name, table.schema)
    return text(
        f"SELECT id FROM {name} WHERE id = ANY(CAST(:ids AS bigint[])) "
        "AND attempts = (CAST(:attempts AS integer[]))[array_position(CAST(:ids AS bigint[]), id)] "
        f"AND status = '{JobStatus.RUNNING.value}' FOR UPDATE"
    )


def has_runnable(table: Table) -> Select[Any]:
    """Whether queue ``:queue`` has a pending or running job (reads the first entry of the
    pending index, of the keyed pending index and of the running index, nothing else)."""

    def any_in(status: JobStatus, *more: ColumnElement[bool]) -> Exists:
        # The status as a literal, so that the partial index is provably usable.
        return (
            select(_ONE)
            .where(
                table.c.status == literal_column(f"'{status.value}'"),
                table.c.queue == bindparam("queue", type_=Text),
                *more,
            )
            .exists()
        )

    return select(
        or_(
            any_in(JobStatus.PENDING, table.c.ordering_key.is_(None)),
            any_in(JobStatus.PENDING, table.c.ordering_key.is_not(None)),
            any_in(JobStatus.RUNNING),
        )
    )


def fill_keyed(table: Table) -> Insert:
    """Insert ``:count`` no-op jobs of task ``:task`` in queue ``:queue``, job ``n`` with the
    ordering key ``'key:' || n % :keys`` (so the first ``:keys`` jobs in claim order have
    distinct keys) and the key limit ``:key_limit``, in one statement."""
    return _fill(table, lambda n: literal_column("'key:'") + func.cast(n % _param("keys"), Text))


def fill_burst(table: Table) -> Insert:
    """As :func:`fill_keyed`, but the first ``:burst`` jobs in claim order have one key,
    ``'hot'``, and each job after them a key of its own."""
    return _fill(
        table,
        lambda n: case(
            (n <= _param("burst"), literal_column("'hot'")),
            else_=literal_column("'key:'") + func.cast(n, Text),
        ),
    )


def fill_tenants(table: Table, column: str) -> Insert:
    """Insert ``:count`` no-op jobs of task ``:task`` in queue ``:queue``, job ``n`` of the
    tenant ``:prefix`` followed by ``(n - 1) % :tenants`` in three digits (in ``column``,
    the fair bench's tenant column), in one statement: the first ``:tenants`` jobs in claim
    order have distinct tenants, and the tenants sort in the order of their numbers."""
    series = func.generate_series(_ONE, _param("count")).table_valued("n").render_derived(name="s")
    number = func.cast((series.c.n - _ONE) % _param("tenants"), Text)
    values: list[ColumnElement[Any]] = [
        bindparam("queue", type_=Text),
        bindparam("task", type_=Text),
        literal_column("'{}'::jsonb"),
        bindparam("prefix", type_=Text) + func.lpad(number, 3, literal_column("'0'")),
    ]
    return insert(table).from_select(
        ["queue", "task", "args", column],
        select(*values).select_from(series),
        include_defaults=False,
    )


def first_claims(table: Table, column: str) -> Select[Any]:
    """After a drain of queue ``:queue``: in which claim, counted from the first, the last of
    its tenants (values of ``column``) other than ``:backlog`` had its first job started;
    and how many such tenants there were. Every job of one claim has the claim statement's
    time as ``attempted_at``, so ``dense_rank()`` over ``attempted_at`` numbers the claims
    (each claim in a transaction of its own, so no two share a time)."""
    claims = (
        select(
            table.c[column].label("tenant"),
            func.dense_rank().over(order_by=table.c.attempted_at).label("claim"),
        )
        .where(table.c.queue == bindparam("queue", type_=Text))
        .subquery("claims")
    )
    firsts = (
        select(claims.c.tenant, func.min(claims.c.claim).label("first"))
        .where(claims.c.tenant != bindparam("backlog", type_=Text))
        .group_by(claims.c.tenant)
        .subquery("firsts")
    )
    counts: list[ColumnElement[Any]] = [func.max(firsts.c.first), func.count()]
    return select(*counts).select_from(firsts)


def _param(name: str) -> BindParameter[int]:
    return bindparam(name, type_=Integer)


def _fill(table: Table, key: Callable[[ColumnElement[int]], ColumnElement[str]]) -> Insert:
    series = func.generate_series(_ONE, _param("count")).table_valued("n").render_derived(name="s")
    values: list[ColumnElement[Any]] = [
        bindparam("queue", type_=Text),
        bindparam("task", type_=Text),
        literal_column("'{}'::jsonb"),
        key(series.c.n),
        _param("key_limit"),
    ]
    return insert(table).from_select(
        ["queue", "task", "args", "ordering_key", "key_limit"],
        select(*values).select_from(series),
        include_defaults=False,
    )


def finished(table: Table) -> Select[Any]:
    """How many jobs of queue ``:queue`` succeeded, and when the last one finished."""
    counts: list[ColumnElement[Any]] = [func.count(), func.max(table.c.finished_at)]
    return select(*counts).where(
        table.c.queue == bindparam("queue", type_=Text),
        table.c.status == _SUCCEEDED,
    )


def delete_queue(table: Table) -> Delete:
    """Delete every job of queue ``:queue`` (a benchmark's own rows, between runs)."""
    return delete(table).where(table.c.queue == bindparam("queue", type_=Text))


def clear(table: Table) -> Delete:
    """Delete every row of ``table`` (the ORM ceiling's plain table, between runs)."""
    return delete(table)


def stored_results(result_table: Table) -> Select[Any]:
    """Every stored result: ``job_id, value``."""
    return select(result_table.c.job_id, result_table.c.value)


def database_clock() -> Select[Any]:
    """``clock_timestamp()``: the database's wall clock now (not the transaction's start)."""
    return select(func.clock_timestamp())


def server_facts() -> Select[Any]:
    """The server's version and the settings that decide commit cost."""
    setting = func.current_setting
    return select(
        func.version().label("version"),
        setting(literal_column("'server_version'")).label("server_version"),
        setting(literal_column("'fsync'")).label("fsync"),
        setting(literal_column("'synchronous_commit'")).label("synchronous_commit"),
        setting(literal_column("'shared_buffers'")).label("shared_buffers"),
        setting(literal_column("'max_connections'")).label("max_connections"),
    )


def vacuum_analyze(table: Table) -> str:
    """``VACUUM (ANALYZE) <table>`` as SQL text; run it outside a transaction (autocommit)."""
    return f"VACUUM (ANALYZE) {qualified_name(table.name, table.schema)}"


def set_user_triggers(table: Table, *, enabled: bool) -> str:
    """``ALTER TABLE ... ENABLE|DISABLE TRIGGER USER``, as SQL text: the benchmark turns the
    NOTIFY trigger off to measure what it costs an enqueue."""
    action = "ENABLE" if enabled else "DISABLE"
    return f"ALTER TABLE {qualified_name(table.name, table.schema)} {action} TRIGGER USER"


def wait_events() -> TextClause:
    """What this database's other backends in a transaction are doing now: one row per
    ``state`` and wait (``wait_event_type:wait_event``, or ``CPU`` for an active backend
    that waits for nothing), with how many. ``idle in transaction`` backends wait for their
    client (``Client:ClientRead``). Reads ``pg_stat_activity``; takes no lock."""
    return text(
        "SELECT state, coalesce(wait_event_type || ':' || wait_event, 'CPU') AS wait, "
        "count(*) AS n FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND backend_type = 'client backend' "
        "AND state IN ('active', 'idle in transaction') GROUP BY 1, 2"
    )


def backend_pid() -> Select[Any]:
    """``pg_backend_pid()``: the process id of this connection's server backend (whose
    parent is the server's postmaster: :mod:`sqla_jobs.bench.cpu`)."""
    return select(func.pg_backend_pid())


def write_row() -> Insert:
    """One row of :data:`WRITES_TABLE` for job ``:job_id``: what ``bench_write_lock`` writes."""
    return insert(WRITES_TABLE).values(job_id=bindparam("job_id", type_=BigInteger))


def row_count(table: Table) -> Select[Any]:
    """The rows of ``table`` (``count(*)``: reads it all; for small tables)."""
    return select(func.count()).select_from(table)


def truncate(*tables: Table) -> str:
    """``TRUNCATE ... RESTART IDENTITY`` of these tables, as SQL text (resets between runs)."""
    return (
        "TRUNCATE "
        + ", ".join(qualified_name(t.name, t.schema) for t in tables)
        + " RESTART IDENTITY"
    )


def create_schema(name: str) -> str:
    """``CREATE SCHEMA``, as SQL text: a schema for one of the shape section's copies."""
    return f"CREATE SCHEMA {quote(name)}"


def drop_schema(name: str) -> str:
    """``DROP SCHEMA ... CASCADE``, as SQL text: a copy's schema and all in it."""
    return f"DROP SCHEMA IF EXISTS {quote(name)} CASCADE"


def drop_index(name: str, schema: str | None = None) -> str:
    """``DROP INDEX``, as SQL text."""
    return f"DROP INDEX {qualified_name(name, schema)}"


def drop_constraint(table: Table, name: str) -> str:
    """``ALTER TABLE ... DROP CONSTRAINT``, as SQL text."""
    return f"ALTER TABLE {qualified_name(table.name, table.schema)} DROP CONSTRAINT {quote(name)}"


def create_database(name: str) -> str:
    """``CREATE DATABASE``, as SQL text: the scratch database of a run on a given server."""
    return f"CREATE DATABASE {quote(name)}"


def drop_database(name: str) -> str:
    """``DROP DATABASE IF EXISTS ... WITH (FORCE)``, as SQL text (PostgreSQL 13+): the
    scratch database goes even if a worker process left a connection behind."""
    return f"DROP DATABASE IF EXISTS {quote(name)} WITH (FORCE)"


def fill_history(history: Table) -> Insert:
    """Insert finished jobs ``:first`` .. ``:last`` (their ids plus 10^12, apart from the
    job table's) of queue ``:queue`` straight into a history table, their finish times
    spread over the ``:days`` days before now (one partition each)."""
    series = (
        func.generate_series(bindparam("first", type_=Integer), bindparam("last", type_=Integer))
        .table_valued("n")
        .render_derived(name="s")
    )
    now = func.statement_timestamp()
    day: ColumnElement[Any] = literal_column("interval '1 day'")
    spread = now - (series.c.n % bindparam("days", type_=Integer)) * day
    values: list[ColumnElement[Any]] = [
        series.c.n + literal_column("1000000000000"),
        bindparam("queue", type_=Text),
        literal_column("'bench_noop'"),
        literal_column("'{}'::jsonb"),
        _SUCCEEDED,
        literal_column("0"),
        now,
        _ONE,
        _ONE,
        now,
        spread,
    ]
    names = [
        "id", "queue", "task", "args", "status", "priority", "run_at", "attempts",
        "max_attempts", "created_at", "finished_at",
    ]  # fmt: skip
    return insert(history).from_select(names, select(*values).select_from(series))


def table_size(table: Table) -> Select[Any]:
    """``pg_relation_size`` (heap) and ``pg_total_relation_size`` (heap, indexes, TOAST)
    of ``table`` in bytes, its rows (``count(*)``: reads the table) and its dead row
    versions (from the statistics)."""
    relation = func.to_regclass(
        bindparam("size_table", qualified_name(table.name, table.schema), type_=Text)
    )
    return select(
        func.pg_relation_size(relation).label("heap_bytes"),
        func.pg_total_relation_size(relation).label("total_bytes"),
        row_count(table).scalar_subquery().label("live_rows"),
        func.pg_stat_get_dead_tuples(relation).label("dead_rows"),
    )


def wal_position() -> Select[Any]:
    """``pg_current_wal_insert_lsn() - '0/0'``: the WAL written so far, in bytes."""
    return select(func.pg_current_wal_insert_lsn() - literal_column("'0/0'::pg_lsn"))
