"""Administration, statistics and the worker's runtime statements: status, pruning,
vacuum, queue and table statistics, LISTEN, settings (see :mod:`sqla_jobs._queries`)."""

from __future__ import annotations

import functools
from datetime import datetime
from decimal import Decimal
from typing import Any, Final, NamedTuple, TypedDict

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    ColumnElement,
    Connection,
    Delete,
    Dialect,
    Float,
    Integer,
    Select,
    Table,
    Text,
    TextClause,
    and_,
    bindparam,
    cast,
    column,
    delete,
    exists,
    func,
    literal_column,
    null,
    select,
    text,
    union_all,
)
from sqlalchemy import table as catalog_table
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from sqla_jobs._queries._sql import (
    _ONE,
    _lit,
    _now,
    _seconds,
    _split,
)
from sqla_jobs._queries.run import NoParams, Query
from sqla_jobs.ddl import TRANSITION_TABLE, executable, qualified_name
from sqla_jobs.schema import FINISHED_STATUSES, JobStatus, names
from sqla_jobs.schema.pauses import pause_names
from sqla_jobs.schema.rates import rate_names


def transaction_isolation() -> Select[Any]:
    """The current transaction's isolation level (``'read committed'``, ...)."""
    return select(func.current_setting(literal_column("'transaction_isolation'")))


class IsolationRow(NamedTuple):
    current_setting: str


TRANSACTION_ISOLATION: Final = Query(transaction_isolation, NoParams, IsolationRow)


def status_of(table: Table) -> Select[Any]:
    """The status of job ``:job_id`` (no row when it does not exist)."""
    return select(table.c.status).where(table.c.id == bindparam("job_id", type_=BigInteger))


class JobIdParams(TypedDict):
    """One job, by its id."""

    job_id: int


class StatusRow(NamedTuple):
    status: str


STATUS_OF: Final = Query(status_of, JobIdParams, StatusRow)


def prune(table: Table, *, steps: bool = False) -> Delete:
    """Delete up to ``:limit`` finished jobs whose ``finished_at`` is older than
    ``:older_than_seconds``, oldest ids first.

    Walks the primary key from the oldest id, where old finished jobs are; ``SKIP LOCKED``
    keeps it off rows an operator is touching. Call it in a loop until it deletes nothing.
    ``steps``: the table has workflow steps, which it leaves (they go with their workflow:
    :data:`~sqla_jobs._queries.workflows.PRUNE_WORKFLOWS`).
    """
    doomed = (
        select(table.c.id)
        .where(
            table.c.status.in_([_lit(s) for s in FINISHED_STATUSES]),
            table.c.finished_at < _now() - _seconds("older_than_seconds"),
            *([table.c.workflow_id.is_(None)] if steps else []),
        )
        .order_by(table.c.id)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return delete(table).where(table.c.id.in_(doomed))


class PruneParams(TypedDict):
    """Up to ``limit`` finished jobs older than ``older_than_seconds`` (:func:`prune`)."""

    older_than_seconds: float
    limit: int


#: Returns no rows: its ``result(...).rowcount`` is how many jobs it deleted.
PRUNE: Final[Query[PruneParams, tuple[()]]] = Query(prune, PruneParams)


def dead_rows(table: Table) -> Select[Any]:
    """How many dead row versions the table holds, as PostgreSQL's cumulative statistics
    count them (``pg_stat_get_dead_tuples``, reset by each vacuum of the table): one number,
    0 also when the table does not exist. Reads shared memory, not the table.

    Each claimed job leaves about two (the pending version, then the running one), and
    their entries fill the head of the pending index until a vacuum removes them (see
    :func:`vacuum`). The table's name is bound into the statement: execute it without
    parameters.
    """
    relation = func.to_regclass(
        bindparam("dead_rows_table", qualified_name(table.name, table.schema), type_=Text)
    )
    return select(func.coalesce(func.pg_stat_get_dead_tuples(relation), literal_column("0")))


class DeadRowsRow(NamedTuple):
    dead_rows: int


DEAD_ROWS: Final = Query(dead_rows, NoParams, DeadRowsRow)


def vacuum(table: Table) -> DDL:
    """``VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON)`` of the table. Run it outside a transaction
    (autocommit).

    A claim reads the pending index from its head, where the entries of the jobs claimed
    since the last vacuum sit, dead: a claim reads a few more index pages for every few
    hundred jobs claimed before it, until a vacuum removes them. This vacuum removes them
    whatever the table's size: ``INDEX_CLEANUP ON`` keeps PostgreSQL from skipping the
    index pass when the dead rows sit on few of a large table's pages. ``SKIP_LOCKED``: when
    another vacuum of the table (autovacuum's, another worker's) is running, it skips the
    table rather than wait. Locks: ``SHARE UPDATE EXCLUSIVE`` on the table, which blocks no
    claim, enqueue or outcome. Costs a pass over the heap pages changed since the last
    vacuum and over every index of the table.
    """
    return executable(
        f"VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON) {qualified_name(table.name, table.schema)}"
    )


def run_vacuum(connection: Connection, table: Table) -> None:
    """Run :func:`vacuum` of ``table`` on ``connection``, which must be in autocommit mode
    (VACUUM cannot run in a transaction): the caller owns it (:func:`sqla_jobs.vacuum` opens
    one of its own and gives it back to the pool). DDL, so not a :class:`Query`: it binds
    nothing and returns no rows."""
    connection.execute(vacuum(table))


def queue_stats(table: Table, *, history: Table | None = None) -> Any:
    """Live job counts by queue: ``queue, status, total, runnable, oldest_runnable_seconds,
    expired``, one row per queue and status among ``pending``, ``running`` and ``dead``.

    Reads only the partial indexes, never the finished history: the pending index gives
    each queue's pending count, how many of them are runnable (``run_at`` reached) and the
    age of the oldest runnable one, in seconds of database time; the running index the
    running count and how many leases have expired (``expired``); the dead index the dead
    count. Each is an index-only scan when the visibility map allows (the indexes hold every
    column read), so the cost grows with the jobs waiting, running and dead, and not with
    the succeeded or cancelled rows. ``succeeded`` and ``cancelled`` are not counted: they
    are history (:func:`table_stats` estimates the table's row count). Takes no lock.

    With ``history`` (the partitioned history table of a model with ``partitioned_history``)
    its dead jobs count too: read from the history's dead index (one partial index on each
    partition), never from its succeeded or cancelled rows.
    """
    now = _now()
    due = table.c.run_at <= now
    expired = table.c.lease_expires_at <= now
    zero = literal_column("0", BigInteger)
    total = func.count().label("total")

    def part(
        status: JobStatus, *columns: ColumnElement[Any], where: ColumnElement[bool] | None = None
    ) -> Select[Any]:
        query = select(table.c.queue, _lit(status).label("status"), total, *columns).where(
            table.c.status == _lit(status)
        )
        return (query if where is None else query.where(where)).group_by(table.c.queue)

    no_age = cast(null(), Float)

    def pending(keyed: ColumnElement[bool]) -> Select[Any]:
        # Pending jobs without an ordering key are in the pending index, those with one in
        # the keyed pending index: one read of each, so that each is an index-only scan.
        return part(
            JobStatus.PENDING,
            func.count().filter(due).label("runnable"),
            func.extract("epoch", now - func.min(table.c.run_at).filter(due)).label(
                "oldest_runnable_seconds"
            ),
            zero.label("expired"),
            where=keyed,
        )

    running = part(
        JobStatus.RUNNING,
        zero.label("runnable"),
        no_age.label("oldest_runnable_seconds"),
        func.count().filter(expired).label("expired"),
    )
    dead = part(
        JobStatus.DEAD,
        zero.label("runnable"),
        no_age.label("oldest_runnable_seconds"),
        zero.label("expired"),
    )
    selects = [
        pending(table.c.ordering_key.is_(None)),
        pending(table.c.ordering_key.is_not(None)),
        running,
        dead,
    ]
    if history is not None:
        selects.append(
            select(
                history.c.queue,
                _lit(JobStatus.DEAD).label("status"),
                func.count().label("total"),
                zero.label("runnable"),
                no_age.label("oldest_runnable_seconds"),
                zero.label("expired"),
            )
            .where(history.c.status == _lit(JobStatus.DEAD))
            .group_by(history.c.queue)
        )
    parts = union_all(*selects).subquery("parts")
    return (
        select(
            parts.c.queue,
            parts.c.status,
            func.sum(parts.c.total).cast(BigInteger).label("total"),
            func.sum(parts.c.runnable).cast(BigInteger).label("runnable"),
            func.max(parts.c.oldest_runnable_seconds).label("oldest_runnable_seconds"),
            func.sum(parts.c.expired).cast(BigInteger).label("expired"),
        )
        .group_by(parts.c.queue, parts.c.status)
        .order_by(parts.c.queue, parts.c.status)
    )


class QueueStatsRow(NamedTuple):
    """One queue and status of :func:`queue_stats`."""

    queue: str
    status: str
    total: int
    runnable: int
    oldest_runnable_seconds: float | None
    expired: int


#: ``history=``: the history table whose dead jobs count too.
QUEUE_STATS: Final = Query(queue_stats, NoParams, QueueStatsRow)


def table_stats(table: Table) -> Select[Any]:
    """The job table's size and vacuum state, from PostgreSQL's statistics and catalog
    (no read of the table): ``live_tuples``, ``dead_tuples`` (cumulative statistics, as
    :func:`dead_rows`), ``estimated_rows`` (the planner's ``reltuples``, -1 before the
    first ANALYZE), ``table_bytes`` (heap and TOAST), ``indexes_bytes`` (all its indexes),
    the sizes of the pending, running and dead indexes (NULL when missing), and
    ``vacuum_age_seconds``: database time since the last vacuum, manual or automatic (NULL
    if never). One row; NULLs when the table does not exist. The names are bound into the
    statement: execute it without parameters.
    """
    n = names(table.name)

    def regclass(key: str, name: str) -> ColumnElement[Any]:
        return func.to_regclass(bindparam(key, qualified_name(name, table.schema), type_=Text))

    relation = regclass("stats_table", table.name)
    last_vacuum = func.greatest(
        func.pg_stat_get_last_vacuum_time(relation), func.pg_stat_get_last_autovacuum_time(relation)
    )
    pg_class = catalog_table("pg_class", column("oid"), column("reltuples"), schema="pg_catalog")
    estimated = (
        select(cast(pg_class.c.reltuples, BigInteger))
        .where(pg_class.c.oid == relation)
        .scalar_subquery()
    )
    return select(
        func.pg_stat_get_live_tuples(relation).label("live_tuples"),
        func.pg_stat_get_dead_tuples(relation).label("dead_tuples"),
        estimated.label("estimated_rows"),
        func.pg_table_size(relation).label("table_bytes"),
        func.pg_indexes_size(relation).label("indexes_bytes"),
        func.pg_relation_size(regclass("stats_pending", n.pending_index)).label(
            "pending_index_bytes"
        ),
        func.pg_relation_size(regclass("stats_running", n.running_index)).label(
            "running_index_bytes"
        ),
        func.pg_relation_size(regclass("stats_dead", n.dead_index)).label("dead_index_bytes"),
        func.extract("epoch", _now() - last_vacuum).label("vacuum_age_seconds"),
    )


class TableStatsRow(NamedTuple):
    """The one row of :func:`table_stats` (NULLs when the table does not exist)."""

    live_tuples: int | None
    dead_tuples: int | None
    estimated_rows: int | None
    table_bytes: int | None
    indexes_bytes: int | None
    pending_index_bytes: int | None
    running_index_bytes: int | None
    dead_index_bytes: int | None
    vacuum_age_seconds: Decimal | None


TABLE_STATS: Final = Query(table_stats, NoParams, TableStatsRow)


def oldest_xmin() -> TextClause:
    """What holds back vacuum on the whole server: the oldest transaction snapshot, as
    rows ``measure, kind, holder, age_seconds, age_xids``, two at most: the holder with the
    oldest start (``measure = 'seconds'``) and the one with the oldest xmin (``measure =
    'xids'``), often the same.

    Holders: backends with a ``backend_xmin`` or a ``backend_xid`` in ``pg_stat_activity``
    (a snapshot: a running query, a REPEATABLE READ transaction; or a transaction that has
    written, idle or not; age from ``xact_start``), prepared transactions
    (``pg_prepared_xacts``, age from ``prepared``) and replication slots with an ``xmin``
    or ``catalog_xmin`` (no start time: ``age_seconds`` is NULL). Ages are in database time
    (``statement_timestamp()``) and in transaction ids (``age(xid)``). The asking backend is
    left out. A role without ``pg_read_all_stats`` sees other roles' backends without their
    ``xact_start`` and ``backend_xmin``: grant it to the monitoring role.
    """
    return text(
        """
        WITH holder AS (
            SELECT 'backend' AS kind,
                   pid::text || coalesce(' ' || nullif(application_name, ''), '')
                       || coalesce(' (' || state || ')', '') AS holder,
                   greatest(0, extract(epoch FROM statement_timestamp() - xact_start))
                       AS age_seconds,
                   greatest(age(backend_xmin), age(backend_xid))::bigint AS age_xids
            FROM pg_stat_activity
            WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
              AND pid <> pg_backend_pid()
            UNION ALL
            SELECT 'prepared', gid,
                   greatest(0, extract(epoch FROM statement_timestamp() - prepared)),
                   age(transaction)::bigint
            FROM pg_prepared_xacts
            UNION ALL
            SELECT 'slot', slot_name, NULL,
                   greatest(age(xmin), age(catalog_xmin))::bigint
            FROM pg_replication_slots
            WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
        )
        (SELECT 'seconds' AS measure, * FROM holder
         WHERE age_seconds IS NOT NULL ORDER BY age_seconds DESC LIMIT 1)
        UNION ALL
        (SELECT 'xids', * FROM holder
         WHERE age_xids IS NOT NULL ORDER BY age_xids DESC LIMIT 1)
        """
    )


class XminRow(NamedTuple):
    """A holder of the oldest snapshot by one ``measure`` (:func:`oldest_xmin`)."""

    measure: str
    kind: str
    holder: str
    age_seconds: Decimal | None
    age_xids: int | None


OLDEST_XMIN: Final = Query(oldest_xmin, NoParams, XminRow)


def statement_timeout() -> Select[Any]:
    """``set_config('statement_timeout', :timeout, true)``: a limit for the rest of the
    transaction (``:timeout`` as text, such as ``'2000ms'``), for reads that must not hang
    a health check or a metrics scrape on a slow server."""
    return select(
        func.set_config(
            literal_column("'statement_timeout'"),
            bindparam("timeout", type_=Text),
            literal_column("true", Boolean),
        )
    )


class TimeoutParams(TypedDict):
    """A ``statement_timeout`` as text, such as ``"2000ms"`` (:func:`statement_timeout`)."""

    timeout: str


class SetConfigRow(NamedTuple):
    """The setting's new value."""

    set_config: str


STATEMENT_TIMEOUT: Final = Query(statement_timeout, TimeoutParams, SetConfigRow)


def replica_lag() -> TextClause:
    """How far the server it runs on, a streaming standby, is behind its primary: one row.

    ``in_recovery`` is ``pg_is_in_recovery()``: false on a primary, where the other columns
    but ``taken_at`` are NULL (``streaming`` false, ``replay_paused`` NULL). On a standby:
    ``streaming``, whether its WAL receiver streams from the primary now (false without a
    receiver: the primary is unreachable, or WAL comes from an archive; NULL when the role
    may not see the receiver's details, which needs ``pg_read_all_stats``);
    ``receive_lsn`` and ``replay_lsn``, the WAL received and the WAL replayed (as text,
    ``0/3020B60``); ``unreplayed_bytes``, WAL received but not yet replayed (0: caught up
    with what it received); ``primary_bytes_ahead``, how far the primary's WAL end, as its
    last message to the receiver reported it, is ahead of the replay (NULL without a
    receiver or its details); ``replay_age_seconds``, the database time since the commit of
    the last transaction replayed (``pg_last_xact_replay_timestamp()``: the primary's commit
    time, so it grows while the primary commits nothing, caught up or not; NULL before the
    first); ``replay_paused``, ``pg_get_wal_replay_pause_state()`` is not ``'not paused'``.

    The age is database time, never the client's: the standby's ``statement_timestamp()``
    less the primary's commit time (two servers' clocks, which NTP keeps together; never
    below 0). Reads the server's own state (``pg_stat_wal_receiver``, the recovery
    functions), nothing of any table; takes no lock; runs in a read-only transaction, as on a
    standby it must.
    """
    # Each recovery function is called once (the MATERIALIZED CTE): the replay moves on
    # while the statement runs, and two calls could disagree.
    return text(
        """
        WITH state AS MATERIALIZED (
            SELECT pg_is_in_recovery() AS in_recovery,
                   CASE WHEN receiver.pid IS NULL THEN false
                        ELSE receiver.status = 'streaming' END AS streaming,
                   pg_last_wal_receive_lsn() AS receive_lsn,
                   pg_last_wal_replay_lsn() AS replay_lsn,
                   receiver.latest_end_lsn AS primary_lsn,
                   statement_timestamp() - pg_last_xact_replay_timestamp() AS replay_age,
                   CASE WHEN pg_is_in_recovery()
                        THEN pg_get_wal_replay_pause_state() <> 'not paused' END
                       AS replay_paused
            FROM (SELECT) AS here
            LEFT JOIN pg_stat_wal_receiver AS receiver ON true
        ), measured AS (
            SELECT *,
                   pg_wal_lsn_diff(receive_lsn, replay_lsn) AS unreplayed,
                   pg_wal_lsn_diff(primary_lsn, replay_lsn) AS ahead,
                   extract(epoch FROM replay_age) AS age
            FROM state
        )
        -- Never below 0 (a receive position behind the replay after a restart, the two
        -- servers' clocks apart), and NULL stays NULL.
        SELECT in_recovery, streaming, receive_lsn::text AS receive_lsn,
               replay_lsn::text AS replay_lsn,
               (CASE WHEN unreplayed < 0 THEN 0 ELSE unreplayed END)::bigint
                   AS unreplayed_bytes,
               (CASE WHEN ahead < 0 THEN 0 ELSE ahead END)::bigint AS primary_bytes_ahead,
               CASE WHEN age < 0 THEN 0 ELSE age END AS replay_age_seconds,
               replay_paused, statement_timestamp() AS taken_at
        FROM measured
        """
    )


class ReplicaLagRow(NamedTuple):
    """The one row of :func:`replica_lag`."""

    in_recovery: bool
    streaming: bool | None
    receive_lsn: str | None
    replay_lsn: str | None
    unreplayed_bytes: int | None
    primary_bytes_ahead: int | None
    replay_age_seconds: Decimal | None
    replay_paused: bool | None
    taken_at: datetime


REPLICA_LAG: Final = Query(replica_lag, NoParams, ReplicaLagRow)


# -- worker runtime and command line -------------------------------------------------------


def listen(table: Table) -> str:
    """``LISTEN`` on the table's new-job channel (:func:`sqla_jobs.schema.names`), as SQL
    text for a driver connection (the listener keeps one of its own, outside the pool).

    The channel is quoted, so its case is kept as ``pg_notify`` sends it. Run it on a
    connection in autocommit mode that stays open: LISTEN is session state.
    """
    channel = names(table.name).channel
    return 'LISTEN "{}"'.format(channel.replace('"', '""'))


def listen_on(connection: psycopg.Connection[Any], table: Table) -> None:
    """Run :func:`listen` on ``connection``, a psycopg connection in autocommit mode that its
    caller owns and keeps open (the listener's own, detached from the pool): LISTEN is
    session state, and in autocommit it takes effect at once."""
    connection.execute(listen(table))


_PG_TRIGGER: Final = catalog_table(
    "pg_trigger",
    column("tgrelid"),
    column("tgname"),
    column("tgfoid"),
    column("tgenabled"),
    column("tgtype", Integer),
    column("tgnewtable"),
    schema="pg_catalog",
)
_PG_PROC: Final = catalog_table(
    "pg_proc", column("oid"), column("prosrc", Text), schema="pg_catalog"
)
# pg_trigger.tgtype bits: FOR EACH ROW, BEFORE and INSTEAD OF (none of which the wake-up
# trigger is), and INSERT (which it is).
_TRIGGER_ROW_BEFORE_INSTEAD: Final[ColumnElement[int]] = literal_column("67", Integer)
_TRIGGER_INSERT: Final[ColumnElement[int]] = literal_column("4", Integer)


def wakeup_trigger_exists(table: Table) -> Select[Any]:
    """Whether the table has a working wake-up trigger: one boolean, false also when the
    table does not exist.

    Working means the trigger the migration helpers and ``create_all()`` create
    (:mod:`sqla_jobs.ddl`): ``names(table).notify_trigger`` on the table, enabled, ``AFTER
    INSERT ... FOR EACH STATEMENT`` with the ``NEW TABLE`` the function reads, running
    ``names(table).notify_function``, whose body notifies ``names(table).channel``. A table
    created by Alembic's autogenerate or a plain ``create_table`` has none, and then
    ``LISTEN`` hears nothing: workers find new jobs by polling only.

    The table's names are bound into the statement: execute it without parameters. Reads
    the catalog through its indexes (``pg_trigger`` by table and trigger name, ``pg_proc``
    by ``oid``); takes no lock. Names resolve through the connection's ``search_path``, as
    the queue's own statements do. For a worker at start, and for
    :func:`sqla_jobs.migrations.check_job_tables`.
    """
    n = names(table.name)
    trigger = _PG_TRIGGER.alias("t")
    function = _PG_PROC.alias("p")
    relation = func.to_regclass(
        bindparam("wakeup_table", qualified_name(table.name, table.schema), type_=Text)
    )
    notify_function = func.to_regprocedure(
        bindparam(
            "wakeup_function", qualified_name(n.notify_function, table.schema) + "()", type_=Text
        )
    )
    channel = func.quote_literal(bindparam("wakeup_channel", n.channel, type_=Text))
    return select(
        exists()
        .select_from(trigger.join(function, function.c.oid == trigger.c.tgfoid))
        .where(
            trigger.c.tgrelid == relation,
            trigger.c.tgname == bindparam("wakeup_trigger", n.notify_trigger, type_=Text),
            trigger.c.tgfoid == notify_function,
            trigger.c.tgenabled.in_([literal_column("'O'"), literal_column("'A'")]),
            trigger.c.tgtype.bitwise_and(_TRIGGER_ROW_BEFORE_INSTEAD) == literal_column("0"),
            trigger.c.tgtype.bitwise_and(_TRIGGER_INSERT) == _TRIGGER_INSERT,
            trigger.c.tgnewtable == literal_column(f"'{TRANSITION_TABLE}'"),
            func.strpos(function.c.prosrc, channel) > literal_column("0"),
        )
    )


class ExistsRow(NamedTuple):
    exists: bool


WAKEUP_TRIGGER_EXISTS: Final = Query(wakeup_trigger_exists, NoParams, ExistsRow)


def ping() -> Select[Any]:
    """``SELECT 1``: a listener's check that its idle connection is still alive."""
    return select(_ONE)


@functools.cache
def _psycopg_sql(builder: Any) -> str:
    # A statement run on a psycopg connection itself (no SQLAlchemy connection around it),
    # compiled once as the psycopg dialect compiles it.
    dialect: Dialect = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]
    return str(builder().compile(dialect=dialect))


def ping_on(connection: psycopg.Connection[Any]) -> None:
    """Run :func:`ping` on ``connection``, a psycopg connection its caller owns (the
    listener's own, in autocommit mode): raises when the connection is gone."""
    connection.execute(_psycopg_sql(ping))


#: The settings the worker gives the connections it keeps (see :func:`set_setting`), and resets
#: before giving them back to the pool: ``plan_cache_mode`` on a direct connection
#: (:mod:`sqla_jobs.worker.link`).
WORKER_SETTINGS: Final = frozenset({"lock_timeout", "synchronous_commit", "plan_cache_mode"})


def set_setting(*, local: bool) -> Select[Any]:
    """``set_config(:name, :value, local)``: a setting for the rest of the transaction
    (``local``) or of the session. The worker sets ``lock_timeout`` on the connections it
    keeps (SKIP LOCKED skips row locks, not a migration's table lock), and
    ``synchronous_commit`` when asked to, and resets them (:func:`reset_setting`) before
    the connections go back to the pool."""
    is_local = literal_column("true" if local else "false", Boolean)
    return select(
        func.set_config(bindparam("name", type_=Text), bindparam("value", type_=Text), is_local)
    )


class SettingParams(TypedDict):
    """A setting's name (one of :data:`WORKER_SETTINGS`) and its
    value as text (:func:`set_setting`)."""

    name: str
    value: str


#: ``local=``: for the rest of the transaction (True) or of the session (False).
SET_SETTING: Final = Query(set_setting, SettingParams, SetConfigRow)


def reset_setting(name: str) -> TextClause:
    """``RESET <name>``: back to the server's (or role's) default for the session. ``name``
    is one of :data:`WORKER_SETTINGS` (an identifier, so not a bind parameter)."""
    if name not in WORKER_SETTINGS:
        raise ValueError(f"not a setting the worker manages: {name!r}")
    return text(f"RESET {name}")


#: ``name=``: the setting to reset. Returns no rows.
RESET_SETTING: Final[Query[NoParams, tuple[()]]] = Query(reset_setting, NoParams)


def terminate_transactions() -> Select[Any]:
    """End the given transactions: ``pg_terminate_backend`` on each backend in ``:pids``
    whose current transaction began at the matching time in ``:xact_starts`` (epoch seconds,
    comma-separated like ``:pids``). Returns one row per backend it ended.

    A worker shutting down uses it on its own lock-mode transactions whose handlers did not
    finish in the grace period: they roll back and their row locks go, so the jobs can be
    released at once. Matching the transaction's start as well as the pid means a backend
    whose connection went back to the pool meanwhile, and now serves someone else, is left
    alone.
    """
    wanted = (
        func.unnest(_split("pids", Integer), _split("xact_starts", Float))
        .table_valued("pid", "xact_start")
        .render_derived(name="wanted")
    )
    activity = table_valued_activity()
    return (
        select(func.pg_terminate_backend(activity.c.pid))
        .select_from(activity)
        .join(
            wanted,
            and_(
                activity.c.pid == wanted.c.pid,
                func.extract("epoch", activity.c.xact_start) == wanted.c.xact_start,
            ),
        )
    )


class TerminateParams(TypedDict):
    """Backends' pids and their transactions' starts in epoch seconds, each comma-separated
    and in the same order (:func:`terminate_transactions`)."""

    pids: str
    xact_starts: str


class TerminatedRow(NamedTuple):
    """A backend :func:`terminate_transactions` ended (whether the signal was sent)."""

    pg_terminate_backend: bool


TERMINATE_TRANSACTIONS: Final = Query(terminate_transactions, TerminateParams, TerminatedRow)


def table_valued_activity() -> Any:
    """``pg_stat_activity`` (the columns the worker reads), as a selectable."""
    return func.pg_stat_get_activity(null()).table_valued("pid", "xact_start").alias("activity")


def backend_transaction() -> Select[Any]:
    """``pg_backend_pid(), extract(epoch from transaction_timestamp())``: which backend
    and which of its transactions this is (see :func:`terminate_transactions`)."""
    return select(func.pg_backend_pid(), func.extract("epoch", func.transaction_timestamp()))


class BackendTransactionRow(NamedTuple):
    """This backend's pid, and its transaction's start in epoch seconds."""

    pid: int
    xact_start: Decimal


BACKEND_TRANSACTION: Final = Query(backend_transaction, NoParams, BackendTransactionRow)


def driver_backend_pid(connection: psycopg.Connection[Any]) -> int | None:
    """The pid of the backend that runs :func:`backend_transaction` on ``connection``, a
    psycopg connection (no SQLAlchemy connection around it, as at a pool's ``connect``),
    whose row factory may be any. It runs in the connection's current transaction, or
    begins one that its caller ends: the caller owns the connection."""
    with connection.cursor(row_factory=tuple_row) as cursor:
        row = cursor.execute(_psycopg_sql(backend_transaction)).fetchone()
    return None if row is None else int(row[0])


def dead_jobs(table: Table, *, history: Table | None = None) -> Select[Any]:
    """The ``:limit`` most recently finished dead jobs: ``id, queue, task, attempts,
    finished_at, last_error``. Reads the dead index (schema version 3) and the heap rows
    it points to, never the finished history.

    With ``history`` (the partitioned history table of a model with ``partitioned_history``)
    the dead jobs there are listed too: read through the history's dead index (one partial
    index on each partition) and the rows it points to, never its other rows.
    """

    def newest(source: Table) -> Select[Any]:
        return (
            select(
                source.c.id,
                source.c.queue,
                source.c.task,
                source.c.attempts,
                source.c.finished_at,
                source.c.last_error,
            )
            .where(source.c.status == _lit(JobStatus.DEAD))
            .order_by(source.c.finished_at.desc(), source.c.id.desc())
            .limit(bindparam("limit", type_=Integer))
        )

    if history is None:
        return newest(table)
    both = union_all(newest(table), newest(history)).subquery("dead")
    return (
        select(*both.c)
        .order_by(both.c.finished_at.desc(), both.c.id.desc())
        .limit(bindparam("limit", type_=Integer))
    )


class LimitParams(TypedDict):
    """At most ``limit`` rows."""

    limit: int


class DeadJobRow(NamedTuple):
    """A dead job of :func:`dead_jobs`."""

    id: int
    queue: str
    task: str
    attempts: int
    finished_at: datetime | None
    last_error: str | None


#: ``history=``: the history table whose dead jobs are listed too.
DEAD_JOBS: Final = Query(dead_jobs, LimitParams, DeadJobRow)


# to_regclass takes no lock on the table: the check does not queue behind the ALTER TABLE of
# an upgrade. Indexes that a failed CREATE INDEX CONCURRENTLY left invalid do not count.
_LAYOUT: Final = """
    SELECT
        ARRAY(
            SELECT a.attname::text FROM pg_attribute AS a
            WHERE a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped
        ) AS columns,
        ARRAY(
            SELECT c.relname::text
            FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
            WHERE i.indrelid = t.oid AND i.indisvalid
        ) AS indexes,
        to_regclass(:pause_table) IS NOT NULL AS pauses,
        to_regclass(:rate_table) IS NOT NULL AS rates
    FROM (SELECT to_regclass(:layout_table) AS oid) AS t
"""


def table_layout(table: Table) -> TextClause:
    """The job table's columns and valid indexes: one row, ``columns`` and ``indexes``, two
    arrays of names (empty when the table does not exist), ``pauses``, whether its pause
    table (schema version 4: :mod:`sqla_jobs.schema.pauses`) exists, and ``rates``, whether
    its rate table (:mod:`sqla_jobs.schema.rates`, needed by rate limits) does.

    The table's name is bound into the statement: execute it without parameters. Reads
    ``pg_attribute`` and ``pg_index`` by the table's ``oid``; takes no lock on the table.
    Names resolve through the connection's ``search_path``, as the queue's own statements
    do."""
    name = qualified_name(table.name, table.schema)
    pauses = qualified_name(pause_names(table.name).table, table.schema)
    rates = qualified_name(rate_names(table.name).table, table.schema)
    return text(_LAYOUT).bindparams(
        bindparam("layout_table", name, type_=Text),
        bindparam("pause_table", pauses, type_=Text),
        bindparam("rate_table", rates, type_=Text),
    )


class LayoutRow(NamedTuple):
    """The job table's column names and valid index names (:func:`table_layout`)."""

    columns: list[str]
    indexes: list[str]
    pauses: bool
    rates: bool


TABLE_LAYOUT: Final = Query(table_layout, NoParams, LayoutRow)


def may_keep_partitions() -> TextClause:
    """Whether this role may make and drop partitions of the history table ``:history`` (its
    qualified name): ``role, owner, acts_as_owner, may_create``. PostgreSQL allows partition
    DDL to its owner, or a role that has the owner's privileges (a member that inherits
    them), with CREATE on its schema. One row, or none when the table does not exist (then
    the maintenance itself says what is wrong). Reads the catalog; takes no lock."""
    return text(
        "SELECT current_user AS role, pg_get_userbyid(c.relowner) AS owner, "
        "pg_has_role(c.relowner, 'USAGE') AS acts_as_owner, "
        "has_schema_privilege(c.relnamespace, 'CREATE') AS may_create "
        "FROM pg_class c WHERE c.oid = to_regclass(:history)"
    )


class HistoryNameParams(TypedDict):
    """A history table's qualified name."""

    history: str


class PartitionPrivilegesRow(NamedTuple):
    """What :func:`may_keep_partitions` found: this role, the history table's owner, whether
    this role acts as the owner and whether it may create tables in the table's schema."""

    role: str
    owner: str
    acts_as_owner: bool
    may_create: bool


MAY_KEEP_PARTITIONS: Final = Query(may_keep_partitions, HistoryNameParams, PartitionPrivilegesRow)
