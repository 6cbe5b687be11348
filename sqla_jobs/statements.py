"""Every SQL statement sqla_jobs runs, as builders over the user's model class.

Pure functions: they take a mapped class (or its table) and return a SQLAlchemy statement.
No session, no I/O, no logging here. Batch statements take their rows as arrays
(``unnest(:fence_ids, :fence_attempts)``) so that the SQL text is the same for every batch size and
PostgreSQL prepares it once.

Time is always the database's: ``statement_timestamp()`` is the start of the current
statement (stable within it, so the planner can still use it in an index condition), never
the client's clock.

The fence: ``attempts`` only ever grows, and every claim adds one, so ``(id, attempts)``
names exactly one attempt. Every transition of a running job matches on that pair and on
``status = 'running'``; a stale attempt (its lease expired and another worker claimed the
job) matches zero rows.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    ColumnElement,
    Delete,
    Float,
    Insert,
    Integer,
    Select,
    Table,
    Text,
    TextClause,
    Update,
    and_,
    bindparam,
    case,
    cast,
    column,
    delete,
    exists,
    func,
    literal_column,
    null,
    or_,
    select,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy import table as catalog_table
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, insert
from sqlalchemy.sql.dml import ReturningDelete

from sqla_jobs.ddl import TRANSITION_TABLE, executable, qualified_name
from sqla_jobs.schema import FINISHED_STATUSES, JobStatus, names

__all__ = [
    "cancel",
    "claim",
    "complete",
    "complete_and_delete",
    "dead_rows",
    "enqueue_many",
    "fail",
    "heartbeat",
    "lock",
    "prune",
    "queue_stats",
    "release",
    "retry",
    "store_results",
    "vacuum",
    "wakeup_trigger_exists",
]


def _lit(status: JobStatus) -> ColumnElement[str]:
    # Statuses are rendered as literals, not bind parameters: the partial index predicate
    # can then be proven to hold even for a generic (prepared) plan.
    return literal_column(f"'{status.value}'")


def _now() -> ColumnElement[Any]:
    return func.statement_timestamp()


_ONE: Final[ColumnElement[int]] = literal_column("1", Integer)
_SECOND: Final[ColumnElement[Any]] = literal_column("interval '1 second'")


def _seconds(param: str) -> ColumnElement[Any]:
    return bindparam(param, type_=Float) * _SECOND


def _split(param: str, element: Any) -> ColumnElement[Any]:
    # The arrays arrive as comma-separated text ('1,2,3') and are split and cast here:
    # cheaper on the client than having the driver inspect and dump a list per parameter.
    text = func.string_to_array(bindparam(param, type_=Text), literal_column("','"))
    return cast(text, ARRAY(element))


def _fences(table: Table, *, leases: bool = False) -> tuple[Any, ColumnElement[bool]]:
    """The ``(id, attempt)`` pairs of a batch (with a lease in seconds each, if ``leases``),
    and the fenced match against the table."""
    arrays = [_split("fence_ids", BigInteger), _split("fence_attempts", Integer)]
    names_ = ["id", "attempt"]
    if leases:
        arrays.append(_split("fence_leases", Float))
        names_.append("lease")
    pairs = func.unnest(*arrays).table_valued(*names_).render_derived(name="fence")
    match = and_(
        table.c.id == pairs.c.id,
        table.c.attempts == pairs.c.attempt,
        table.c.status == _lit(JobStatus.RUNNING),
    )
    return pairs, match


# -- enqueue -------------------------------------------------------------------------------

#: The job inputs that the mixin declares, which :func:`enqueue_many` always takes.
ENQUEUE_COLUMNS: Final = ("queue", "task", "args", "priority", "run_at", "max_attempts")
#: The columns the queue itself manages; an enqueuer never sets them.
MANAGED_COLUMNS: Final = frozenset(
    {
        "id",
        "status",
        "attempts",
        "lease_expires_at",
        "leased_by",
        "last_error",
        "created_at",
        "finished_at",
    }
)

#: The columns filled in from the enqueuer's context, never from the enqueuer's values
#: (schema version 3: the trace context, see sqla_jobs.tracing).
CONTEXT_COLUMNS: Final = frozenset({"trace_context"})


def enqueue_columns(table: Table) -> tuple[str, ...]:
    """The columns :func:`enqueue_many` inserts: :data:`ENQUEUE_COLUMNS`, then the model's own
    columns (neither the mixin's inputs, nor :data:`MANAGED_COLUMNS`, nor
    :data:`CONTEXT_COLUMNS`) in table order."""
    own = tuple(
        c.name
        for c in table.columns
        if c.name not in MANAGED_COLUMNS
        and c.name not in ENQUEUE_COLUMNS
        and c.name not in CONTEXT_COLUMNS
    )
    return ENQUEUE_COLUMNS + own


def enqueue_many(table: Table) -> Insert:
    """Insert a batch of pending jobs from ``:rows``, a JSON array of objects (as text).

    ``INSERT INTO t (queue, task, args, ...) SELECT ... FROM jsonb_to_recordset(:rows)``:
    one statement per batch whatever its size, and the same SQL text for every size, so
    PostgreSQL prepares it once; the whole batch crosses the wire as one JSON document that
    the client encodes in one call (measured faster than one array per column, whose text
    elements the driver must escape one by one, and close to ``COPY``).

    The keys are :func:`enqueue_columns`; a missing key or a JSON null takes the column's
    server default (``coalesce``), so a row lands exactly as an ORM insert without that
    value would, and the columns not inserted (``id``, ``status``, ``attempts``,
    ``created_at``, ...) take their defaults as usual. ``:trace_context`` (a JSON object, or
    NULL) is every row's ``trace_context``. Locks: only the new rows. The statement-level
    NOTIFY trigger runs once per statement.
    """
    columns = [table.c[name] for name in enqueue_columns(table)]
    rows = (
        func.jsonb_to_recordset(func.cast(bindparam("rows", type_=Text), JSONB))
        .table_valued(*(column(c.name, c.type) for c in columns))
        .render_derived(name="r", with_types=True)
    )
    values: list[ColumnElement[Any]] = []
    for column_ in columns:
        value: ColumnElement[Any] = rows.c[column_.name]
        default_arg = getattr(column_.server_default, "arg", None)
        if isinstance(default_arg, str):
            value = func.coalesce(value, literal_column("'" + default_arg.replace("'", "''") + "'"))
        elif default_arg is not None:
            value = func.coalesce(value, default_arg)
        values.append(value)
    trace_context = table.c.trace_context
    values.append(bindparam("trace_context", type_=trace_context.type))
    return insert(table).from_select(
        [*(c.name for c in columns), trace_context.name],
        select(*values).select_from(rows),
        include_defaults=False,
    )


# -- claim, outcomes and administration ----------------------------------------------------


def claim(table: Table, *, queue_count: int) -> Update:
    """Claim up to ``:limit`` runnable jobs and start an attempt on each.

    Runnable: pending with ``run_at`` reached, or running with an expired lease (a crashed or
    stalled attempt; folding the reaper into the claim means no separate process has to run
    for crashed jobs to come back). Order: ``(priority, run_at, id)``.

    Indexes: each queue's pending jobs come from the pending index ``(queue, priority,
    run_at, id) WHERE status = 'pending'``, read in its order, and its expired leases from the
    running index ``(queue, lease_expires_at) WHERE status = 'running'``, read from the
    oldest lease end up to now; each read stops after ``:limit`` rows. So a claim reads
    neither the finished history, nor the jobs in flight on live leases, nor more than
    ``:limit`` rows per queue, however many queues it serves: with several queues
    (``queue_count`` > 1) the per-queue reads are a ``LATERAL`` join over the
    ``:queue_names`` array. The best ``:limit`` of these candidates by ``(priority, run_at,
    id)`` are claimed. (When more than ``:limit`` leases of one queue have expired, the
    oldest expired come first.)

    Locks: each per-queue read locks its rows ``FOR UPDATE SKIP LOCKED`` as it goes, so
    concurrent claimers take disjoint rows, skip (never wait for) the rows others hold, and a
    claim comes back short only when there are not enough unlocked runnable jobs. The lock is
    taken where the row is read, not over a join of candidates: that keeps PostgreSQL's
    re-check of a row updated since the statement's snapshot to that one row. The price: a
    claim over several queues also locks, until its transaction ends, candidates of other
    queues that do not make its best ``:limit`` (at most ``:limit`` per queue). (Following the
    update chain of a row claimed after this statement's snapshot, PostgreSQL may wait a
    moment for that claimer's completion to commit: brief, never for a held job.)

    The CTE is there on purpose: it fences the planner so that ``LIMIT`` and the row locks
    apply once, to the chosen rows, before the ``UPDATE`` joins them back.

    A running job whose lease expired on its last attempt is made ``dead`` instead (with
    ``last_error`` saying so) and comes back with status ``dead``: callers must hand out
    only the rows whose status is ``running``.

    Returns the job's columns (``trace_context`` last, NULL unless the job was enqueued
    under a trace). Parameters: ``:queue_name`` (one queue) or ``:queue_names`` (an array),
    ``:limit``, ``:lease_seconds``, ``:worker``.
    """
    now = _now()
    limit = bindparam("limit", type_=Integer)
    queues: Any = None
    queue: ColumnElement[str]
    if queue_count == 1:
        queue = bindparam("queue_name", type_=Text)
    else:
        queues = (
            func.unnest(bindparam("queue_names", type_=ARRAY(Text)))
            .table_valued("name")
            .render_derived(name="q")
        )
        queue = queues.c.name
    columns = (table.c.id, table.c.priority, table.c.run_at)
    pending_jobs = (
        select(*columns)
        .where(
            table.c.status == _lit(JobStatus.PENDING),
            table.c.queue == queue,
            table.c.run_at <= now,
        )
        .order_by(table.c.priority, table.c.run_at, table.c.id)
    )
    expired_leases = (
        select(*columns)
        .where(
            table.c.status == _lit(JobStatus.RUNNING),
            table.c.queue == queue,
            table.c.lease_expires_at <= now,
            table.c.run_at <= now,
        )
        .order_by(table.c.lease_expires_at)
    )
    # Each read locks as it goes (a locking clause is not allowed on a UNION's own branches,
    # hence one subquery each); correlated to the queue array when there is one.
    branches = []
    for name, read in (("pending", pending_jobs), ("expired", expired_leases)):
        read = read.limit(limit).with_for_update(skip_locked=True)
        if queues is not None:
            read = read.correlate(queues)
        branches.append(select(read.subquery(name)))
    candidates: Any = union_all(*branches).subquery("candidate")
    if queues is not None:
        candidates = candidates.lateral("candidate")
        chosen = select(candidates.c.id).select_from(queues).join(candidates, true())
    else:
        chosen = select(candidates.c.id)
    claimable = (
        chosen.order_by(candidates.c.priority, candidates.c.run_at, candidates.c.id)
        .limit(limit)
        .cte("claimable")
    )
    # An expired lease on the job's last attempt means that attempt died with its worker:
    # the job is dead now rather than run again, or a job that kills its worker every time
    # would loop forever. Such rows come back with status 'dead' and are not handed out.
    expired = table.c.status == _lit(JobStatus.RUNNING)
    exhausted = and_(expired, table.c.attempts >= table.c.max_attempts)
    lost_lease: ColumnElement[str] = (
        literal_column("'attempt '")
        + func.cast(table.c.attempts, Text)
        + literal_column("' lost its lease: its worker stopped or crashed mid-job'")
    )
    return (
        update(table)
        .where(table.c.id == claimable.c.id)
        .values(
            status=case((exhausted, _lit(JobStatus.DEAD)), else_=_lit(JobStatus.RUNNING)),
            attempts=case((exhausted, table.c.attempts), else_=table.c.attempts + _ONE),
            lease_expires_at=case((exhausted, null()), else_=now + _seconds("lease_seconds")),
            leased_by=case((exhausted, null()), else_=bindparam("worker", type_=Text)),
            finished_at=case((exhausted, now), else_=null()),
            last_error=case((expired, lost_lease), else_=table.c.last_error),
        )
        .returning(
            table.c.id,
            table.c.status,
            table.c.queue,
            table.c.task,
            table.c.args,
            table.c.priority,
            table.c.attempts,
            table.c.max_attempts,
            table.c.run_at,
            table.c.lease_expires_at,
            # NULL unless the job was enqueued under a span: free on the wire and to decode.
            table.c.trace_context,
        )
    )


def lock(table: Table) -> Select[Any]:
    """Lock the rows of attempts this worker holds, until the caller's transaction ends.

    The second half of a lock-held claim: :func:`claim` committed the attempt (so it counts
    even if the worker dies), and this ``SELECT ... FOR UPDATE`` holds the rows for the
    transaction that runs the handlers. Fenced by ``(id, attempts)``: an attempt whose lease
    already ran out and was taken over is not returned. Rows are locked in id order.

    Returns ``id, attempts`` and the locking transaction's start as epoch seconds (which,
    with the backend's pid, names that transaction: :func:`terminate_transactions`).
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    pairs, match = _fences(table)
    return (
        select(
            table.c.id,
            table.c.attempts,
            func.extract("epoch", func.transaction_timestamp()).label("xact_start"),
        )
        .select_from(table)
        .join(pairs, match)
        .order_by(table.c.id)
        .with_for_update(of=table)
    )


def complete(table: Table) -> Update:
    """Mark the given attempts succeeded. Fenced.

    Returns ``id, attempts, task`` of each completed job.

    Parameters: ``:fence_ids``, ``:fence_attempts``. Locks the matched rows (an ``UPDATE``).
    """
    _, match = _fences(table)
    return (
        update(table)
        .where(match)
        .values(status=_lit(JobStatus.SUCCEEDED), finished_at=_now(), lease_expires_at=null())
        .returning(table.c.id, table.c.attempts, table.c.task)
    )


def complete_and_delete(table: Table) -> ReturningDelete[Any]:
    """Delete the rows of the given succeeded attempts (seed 001's variant). Fenced.

    Returns ``id, attempts, task`` of each deleted job.
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    _, match = _fences(table)
    return delete(table).where(match).returning(table.c.id, table.c.attempts, table.c.task)


def store_results(result_table: Table) -> Insert:
    """Insert (or replace) result rows from ``:results``, a jsonb array of
    ``{"job_id", "task", "value"}`` objects. The finish time is the database's."""
    rows = (
        func.jsonb_to_recordset(bindparam("results", type_=JSONB))
        .table_valued(column("job_id", BigInteger), column("task", Text), column("value", JSONB))
        .render_derived(name="r", with_types=True)
    )
    stmt = insert(result_table).from_select(
        ["job_id", "task", "value", "finished_at"],
        select(rows.c.job_id, rows.c.task, rows.c.value, _now()),
    )
    return stmt.on_conflict_do_update(
        index_elements=[result_table.c.job_id],
        set_={
            "task": stmt.excluded.task,
            "value": stmt.excluded.value,
            "finished_at": stmt.excluded.finished_at,
        },
    )


def fail(table: Table) -> Update:
    """Record a failed attempt: retry it after a backoff, or make it dead. Fenced.

    The job is dead when this was its last attempt (``attempts >= max_attempts``) or when
    ``:retry`` is false; otherwise it is pending again at ``statement_timestamp()`` plus
    ``:delay_seconds`` if given, else plus an exponential backoff with jitter, computed in
    the database from the row's own attempt count::

        least(:cap, :base * 2 ^ least(attempts - 1, 60)) * (1 + :jitter * (2 * random() - 1))

    Parameters: ``:job_id``, ``:attempt``, ``:error``, ``:retry``, ``:delay_seconds`` (null for
    the backoff), ``:base``, ``:cap``, ``:jitter``. Returns ``id, status, run_at``.
    """
    now = _now()
    is_dead = or_(
        table.c.attempts >= table.c.max_attempts,
        ~bindparam("retry", type_=Boolean),
    )
    # The exponent is clamped: 2.0 ^ 1024 overflows float8, and the cap is reached long
    # before 2 ^ 60 anyway.
    exponent = func.least(table.c.attempts - _ONE, literal_column("60"))
    backoff = func.least(
        bindparam("cap", type_=Float),
        bindparam("base", type_=Float) * func.power(literal_column("2.0"), exponent),
    ) * (_ONE + bindparam("jitter", type_=Float) * (literal_column("2") * func.random() - _ONE))
    delay = func.coalesce(bindparam("delay_seconds", type_=Float), backoff)
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.attempts == bindparam("attempt", type_=Integer),
            table.c.status == _lit(JobStatus.RUNNING),
        )
        .values(
            status=case((is_dead, _lit(JobStatus.DEAD)), else_=_lit(JobStatus.PENDING)),
            run_at=case(
                (is_dead, table.c.run_at),
                else_=now + delay * _SECOND,
            ),
            finished_at=case((is_dead, now), else_=null()),
            last_error=bindparam("error", type_=Text),
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id, table.c.status, table.c.run_at)
    )


def heartbeat(table: Table) -> Update:
    """Extend the leases of the given attempts, each to ``now + its lease``. Fenced.

    One statement for the whole batch, whatever the attempts' leases (``:fence_leases``
    pairs a lease in seconds with each fence). It never waits on a row lock: the rows are
    locked in id order with ``SKIP LOCKED``, so a row that another transaction holds (a
    lock-mode handler's, an outcome being written, a claim taking over an expired lease) is
    skipped, not waited for, and a heartbeat can take part in no deadlock.

    Only ``lease_expires_at`` changes; it is a key of the running index (which lets a claim
    find expired leases without reading live ones), so the update is not HOT: each heartbeat
    adds an entry to the job table's indexes. Returns ``id, attempts`` of the attempts whose
    lease was extended.
    Parameters: ``:fence_ids``, ``:fence_attempts``, ``:fence_leases``.
    """
    pairs, match = _fences(table, leases=True)
    held = (
        select(table.c.id, pairs.c.lease)
        .select_from(table)
        .join(pairs, match)
        .order_by(table.c.id)
        .with_for_update(of=table, skip_locked=True)
        .cte("held")
    )
    return (
        update(table)
        .where(table.c.id == held.c.id)
        .values(lease_expires_at=_now() + held.c.lease * _SECOND)
        .returning(table.c.id, table.c.attempts)
    )


def release(table: Table) -> Update:
    """Give back the given attempts unfinished: pending again, runnable now. Fenced.

    ``attempts`` stays (it is the fence, and must never repeat); ``max_attempts`` grows by
    one instead, so a job given back at shutdown loses none of its remaining attempts.
    Returns ``id, attempts`` of the released attempts.
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    _, match = _fences(table)
    return (
        update(table)
        .where(match)
        .values(
            status=_lit(JobStatus.PENDING),
            run_at=_now(),
            max_attempts=table.c.max_attempts + _ONE,
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id, table.c.attempts)
    )


def retry(table: Table) -> Update:
    """Make a dead or cancelled job ``:job_id`` pending again, runnable now.

    It gets at least one more attempt; ``attempts`` is kept, so fencing stays sound.
    Returns the id, or no row when the job is not dead or cancelled.
    """
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.status.in_([_lit(JobStatus.DEAD), _lit(JobStatus.CANCELLED)]),
        )
        .values(
            status=_lit(JobStatus.PENDING),
            run_at=_now(),
            max_attempts=func.greatest(table.c.max_attempts, table.c.attempts + _ONE),
            finished_at=null(),
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id)
    )


def cancel(table: Table) -> Update:
    """Cancel pending job ``:job_id``. Returns the id, or no row when it is not pending.

    A running job is not cancelled here: its attempt owns it until it ends.
    """
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.status == _lit(JobStatus.PENDING),
        )
        .values(status=_lit(JobStatus.CANCELLED), finished_at=_now())
        .returning(table.c.id)
    )


def transaction_isolation() -> Select[Any]:
    """The current transaction's isolation level (``'read committed'``, ...)."""
    return select(func.current_setting(literal_column("'transaction_isolation'")))


def status_of(table: Table) -> Select[Any]:
    """The status of job ``:job_id`` (no row when it does not exist)."""
    return select(table.c.status).where(table.c.id == bindparam("job_id", type_=BigInteger))


def prune(table: Table) -> Delete:
    """Delete up to ``:limit`` finished jobs whose ``finished_at`` is older than
    ``:older_than_seconds``, oldest ids first.

    Walks the primary key from the oldest id, where old finished jobs are; ``SKIP LOCKED``
    keeps it off rows an operator is touching. Call it in a loop until it deletes nothing.
    """
    doomed = (
        select(table.c.id)
        .where(
            table.c.status.in_([_lit(s) for s in FINISHED_STATUSES]),
            table.c.finished_at < _now() - _seconds("older_than_seconds"),
        )
        .order_by(table.c.id)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return delete(table).where(table.c.id.in_(doomed))


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


def queue_stats(table: Table) -> Select[Any]:
    """Counts by queue and status, with the oldest runnable pending job's age in seconds."""
    now = _now()
    oldest = func.max(
        case(
            (
                and_(table.c.status == _lit(JobStatus.PENDING), table.c.run_at <= now),
                func.extract("epoch", now - table.c.run_at),
            ),
            else_=None,
        )
    )
    return (
        select(
            table.c.queue,
            table.c.status,
            func.count().label("total"),
            oldest.label("oldest_pending_seconds"),
        )
        .group_by(table.c.queue, table.c.status)
        .order_by(table.c.queue, table.c.status)
    )


# -- worker runtime and command line -------------------------------------------------------


def listen(table: Table) -> str:
    """``LISTEN`` on the table's new-job channel (:func:`sqla_jobs.schema.names`), as SQL
    text for a driver connection (the listener keeps one of its own, outside the pool).

    The channel is quoted, so its case is kept as ``pg_notify`` sends it. Run it on a
    connection in autocommit mode that stays open: LISTEN is session state.
    """
    channel = names(table.name).channel
    return 'LISTEN "{}"'.format(channel.replace('"', '""'))


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


def ping() -> Select[Any]:
    """``SELECT 1``: a listener's check that its idle connection is still alive."""
    return select(_ONE)


#: The settings the worker gives the connections it keeps (see :func:`set_setting`).
WORKER_SETTINGS: Final = frozenset({"lock_timeout", "synchronous_commit"})


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


def reset_setting(name: str) -> TextClause:
    """``RESET <name>``: back to the server's (or role's) default for the session. ``name``
    is one of :data:`WORKER_SETTINGS` (an identifier, so not a bind parameter)."""
    if name not in WORKER_SETTINGS:
        raise ValueError(f"not a setting the worker manages: {name!r}")
    return text(f"RESET {name}")


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


def table_valued_activity() -> Any:
    """``pg_stat_activity`` (the columns the worker reads), as a selectable."""
    return func.pg_stat_get_activity(null()).table_valued("pid", "xact_start").alias("activity")


def backend_transaction() -> Select[Any]:
    """``pg_backend_pid(), extract(epoch from transaction_timestamp())``: which backend
    and which of its transactions this is (see :func:`terminate_transactions`)."""
    return select(func.pg_backend_pid(), func.extract("epoch", func.transaction_timestamp()))


def dead_jobs(table: Table) -> Select[Any]:
    """The ``:limit`` most recently finished dead jobs: ``id, queue, task, attempts,
    finished_at, last_error``. Reads the primary key and the heap (dead jobs are few)."""
    return (
        select(
            table.c.id,
            table.c.queue,
            table.c.task,
            table.c.attempts,
            table.c.finished_at,
            table.c.last_error,
        )
        .where(table.c.status == _lit(JobStatus.DEAD))
        .order_by(table.c.finished_at.desc(), table.c.id.desc())
        .limit(bindparam("limit", type_=Integer))
    )
