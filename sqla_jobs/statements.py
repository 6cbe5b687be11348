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

import zlib
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
    any_,
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
from sqlalchemy.sql.elements import BindParameter

from sqla_jobs.ddl import TRANSITION_TABLE, executable, qualified_name
from sqla_jobs.schema import FINISHED_STATUSES, JobStatus, names, unique_predicate

__all__ = [
    "cancel",
    "cancel_attempts",
    "cancel_requests",
    "claim",
    "claim_keyed",
    "complete",
    "complete_and_delete",
    "database_now",
    "dead_rows",
    "delete_job",
    "enqueue_many",
    "enqueue_unique",
    "fail",
    "heartbeat",
    "key_lock_space",
    "limited_count",
    "lock",
    "lock_keys",
    "lock_queues",
    "oldest_xmin",
    "own_columns",
    "prune",
    "queue_lock_space",
    "queue_stats",
    "release",
    "request_cancel",
    "retry",
    "schedule_advance",
    "schedule_create",
    "statement_timeout",
    "store_results",
    "table_stats",
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


def _cancel_requested(table: Table) -> ColumnElement[bool]:
    """Whether :func:`sqla_jobs.cancel` asked the job's running attempt to stop.

    The rule it carries, in every statement that ends or gives back an attempt (complete,
    fail, release, the claim's takeover of an expired lease): a job whose cancel was
    requested ends ``cancelled``; it is never made pending, running or succeeded again
    (until :func:`retry` clears the request).
    """
    return table.c.cancel_requested_at.is_not(null())


def _fences(table: Table, *, leases: bool = False) -> tuple[Any, ColumnElement[bool]]:
    """The ``(id, attempt)`` pairs of a batch (with a lease in seconds each, if ``leases``),
    and the fenced match against the table: a join of the pairs with the running rows,
    which the outcome writer's batches plan as one hash join with the running index
    (measured at 500 jobs and 3,000 running; a plan test holds it, custom and generic)."""
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


def _fenced_by_key(table: Table) -> ColumnElement[bool]:
    """The fenced match of :func:`_fences` for the statements a lock-held group runs once
    per chunk (:func:`lock`, :func:`complete_held`, and the history's held completion):
    the rows found through the primary key, no pair joined.

    The ids are matched as ``id = ANY(...)``, an index condition on the primary key, and
    each row's attempt as the one at its id's place in the attempts (``array_position``;
    both arrays split once per statement, in scalar subqueries). A join with the pairs was
    planned, under statistics taken before any job ran (they call the running rows one), as
    a nested loop that unnested both arrays again for each row: 15,750 pairs compared for a
    group of 126, 1.9 ms to lock it and 2.1 ms to complete it (0.29 and 0.66 ms now);
    without the ``id = ANY(...)`` index condition, the same statistics made the planner
    scan the whole table once per pair (100 ms for a chunk of 300 jobs in a table of
    40,000). The status test is written ``IS NOT DISTINCT FROM 'running'`` (the same test:
    the column is never null), which the planner cannot match to the running index's
    predicate: given ``= 'running'``, it may read that whole index instead, for each
    statement. (``array_position`` makes the match quadratic in the chunk, fine at a
    group's ``CAP`` of 200.) Parameters: ``:fence_ids``, ``:fence_attempts``."""
    ids = select(_split("fence_ids", BigInteger)).scalar_subquery()
    attempts = select(_split("fence_attempts", Integer)).scalar_subquery()
    at = func.array_position(ids, table.c.id, type_=Integer)
    return and_(
        table.c.id == func.any(_split("fence_ids", BigInteger)),
        table.c.attempts == attempts[at],
        table.c.status.is_not_distinct_from(_lit(JobStatus.RUNNING)),
    )


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
        "cancel_requested_at",
    }
)

#: The columns filled in from the enqueuer's context, never from the enqueuer's values
#: (schema version 3: the trace context, see sqla_jobs.tracing).
CONTEXT_COLUMNS: Final = frozenset({"trace_context"})


#: The unique-job columns (schema version 3), written only by :func:`enqueue_unique`.
UNIQUE_COLUMNS: Final = frozenset({"unique_key", "unique_statuses"})


#: The columns of ordering keys (schema version 3): an enqueuer sets them like its own
#: columns, but they are the library's, not the model's.
ORDERING_COLUMNS: Final = frozenset({"ordering_key", "key_limit"})


def enqueue_columns(table: Table) -> tuple[str, ...]:
    """The columns :func:`enqueue_many` inserts: :data:`ENQUEUE_COLUMNS`, then the model's own
    columns (neither the mixin's inputs, nor :data:`MANAGED_COLUMNS`, nor
    :data:`UNIQUE_COLUMNS`, nor :data:`CONTEXT_COLUMNS`) in table order."""
    own = tuple(
        c.name
        for c in table.columns
        if c.name not in MANAGED_COLUMNS
        and c.name not in ENQUEUE_COLUMNS
        and c.name not in UNIQUE_COLUMNS
        and c.name not in CONTEXT_COLUMNS
    )
    return ENQUEUE_COLUMNS + own


def _recordset_values(table: Table, *extra: Any) -> tuple[list[Any], Any, list[ColumnElement[Any]]]:
    """The enqueue columns, the ``jsonb_to_recordset(:rows)`` they are read from (with the
    ``extra`` columns too), and each column's value with its server default applied."""
    columns = [table.c[name] for name in enqueue_columns(table)]
    rows = (
        func.jsonb_to_recordset(func.cast(bindparam("rows", type_=Text), JSONB))
        .table_valued(*(column(c.name, c.type) for c in columns), *extra)
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
    return columns, rows, values


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
    columns, rows, values = _recordset_values(table)
    trace_context = table.c.trace_context
    values.append(bindparam("trace_context", type_=trace_context.type))
    return insert(table).from_select(
        [*(c.name for c in columns), trace_context.name],
        select(*values).select_from(rows),
        include_defaults=False,
    )


def enqueue_unique(table: Table) -> Select[Any]:
    """Insert a batch of unique jobs from ``:rows``, skipping each whose key is held; return,
    for every row, the id of the job that holds its key.

    ``:rows`` is :func:`enqueue_many`'s JSON document, each object with three more keys:
    ``unique_key`` (the key, or its base when there is a period), ``unique_period`` (the
    period in seconds, or null), ``unique_statuses`` (the statuses in which the job holds
    its key) and ``n`` (the row's position); ``:trace_context`` as for :func:`enqueue_many`.
    With a period, the stored key is ``<base>@<bucket>``, the bucket being
    ``floor(epoch(run_at) / period)``: the period is the one the job's ``run_at`` falls in,
    and ``run_at`` defaults to the database's ``now()``, the transaction's start.

    ``INSERT ... ON CONFLICT (unique_key) WHERE <unique predicate> DO NOTHING``, arbitrated by
    the unique index: a duplicate is skipped, never an error, so the caller's transaction
    goes on. Rows of the same key within the batch are reduced to the first (by ``n``), and
    inserted in key order (so that two batches over the same keys cannot deadlock). When
    the row holding a key is not yet committed, the INSERT waits for its transaction:
    skipped if it commits, inserted if it rolls back.

    Returns ``n, unique_key, inserted_id, holder_id`` per row in ``n`` order:
    ``inserted_id`` when this statement inserted the key's job, else ``holder_id``, the job
    that held it as this statement's snapshot saw it. Both are null when the holder was
    committed after the statement began, or left its unique statuses meanwhile: run the
    statement again for those rows (a new snapshot decides). Locks: the new rows; reads
    the unique index.
    """
    columns, rows, values = _recordset_values(
        table,
        column("unique_key", Text),
        column("unique_period", Float),
        column("unique_statuses", ARRAY(Text)),
        column("n", Integer),
    )
    names_ = [c.name for c in columns]
    run_at = values[names_.index("run_at")]
    base = rows.c.unique_key
    bucket = cast(
        func.floor(cast(func.extract("epoch", run_at), Float) / rows.c.unique_period),
        BigInteger,
    )
    key = case(
        (rows.c.unique_period.is_(None), base),
        else_=base + literal_column("'@'") + cast(bucket, Text),
    )
    trace_context = table.c.trace_context
    source = (
        select(
            *(value.label(name) for name, value in zip(names_, values, strict=True)),
            bindparam("trace_context", type_=trace_context.type).label(trace_context.name),
            key.label("unique_key"),
            cast(rows.c.unique_statuses, table.c.unique_statuses.type).label("unique_statuses"),
            rows.c.n,
            func.row_number().over(partition_by=key, order_by=rows.c.n).label("rank"),
        )
        .select_from(rows)
        .cte("source")
    )
    inserted_columns = [*names_, trace_context.name, "unique_key", "unique_statuses"]
    # In key order: two transactions inserting the same keys take them in the same order,
    # so their waits on each other's uncommitted keys cannot deadlock.
    first = (
        select(*(source.c[name] for name in inserted_columns))
        .where(source.c.rank == _ONE)
        .order_by(source.c.unique_key)
    )
    inserted = (
        insert(table)
        .from_select(inserted_columns, first, include_defaults=False)
        .on_conflict_do_nothing(index_elements=["unique_key"], index_where=text(unique_predicate()))
        .returning(table.c.id, table.c.unique_key)
        .cte("inserted")
    )
    # The unique predicate again, on this table's columns (qualified, inside a correlated
    # subquery), so that the lookup reads the unique index.
    holder = (
        select(table.c.id)
        .where(
            table.c.unique_key == source.c.unique_key,
            table.c.unique_key.is_not(None),
            table.c.status == any_(table.c.unique_statuses),
        )
        .scalar_subquery()
    )
    return (
        select(
            source.c.n,
            source.c.unique_key,
            inserted.c.id.label("inserted_id"),
            holder.label("holder_id"),
        )
        .select_from(source.outerjoin(inserted, inserted.c.unique_key == source.c.unique_key))
        .order_by(source.c.n)
    )


# -- periodic jobs -------------------------------------------------------------------------


def database_now() -> Select[Any]:
    """``statement_timestamp()``: the database's clock (the scheduler's slots, a report's
    time)."""
    return select(_now())


def schedule_create(schedule_table: Table) -> Insert:
    """Start periodic task ``:schedule_name``'s row at ``:slot`` unless it has one:
    ``INSERT ... ON CONFLICT (name) DO NOTHING RETURNING name``. A row comes back only to
    the one transaction that created it (a concurrent creator waits for it, then skips)."""
    stmt = insert(schedule_table).values(
        name=bindparam("schedule_name", type_=Text),
        last_slot=bindparam("slot", type_=schedule_table.c.last_slot.type),
    )
    return stmt.on_conflict_do_nothing(index_elements=["name"]).returning(schedule_table.c.name)


def schedule_advance(schedule_table: Table) -> Update:
    """Move periodic task ``:schedule_name`` to ``:slot`` if its last slot is earlier;
    return its name when it moved.

    The slot's one winner: concurrent schedulers updating the same row queue on its row
    lock, and each re-checks ``last_slot < :slot`` on the version the previous one
    committed, so exactly one transaction gets a row back per slot. Run it in the
    transaction that enqueues the slot's job: if that rolls back, the slot is free again.
    Uses the primary key.
    """
    slot = bindparam("slot", type_=schedule_table.c.last_slot.type)
    return (
        update(schedule_table)
        .where(
            schedule_table.c.name == bindparam("schedule_name", type_=Text),
            schedule_table.c.last_slot < slot,
        )
        .values(last_slot=slot, updated_at=_now())
        .returning(schedule_table.c.name)
    )


# -- claim, outcomes and administration ----------------------------------------------------


def _start_attempts(table: Table, claimable: Any, *, by_address: bool = False) -> Update:
    """The ``UPDATE`` that starts an attempt on each job of ``claimable`` (a CTE of ids), the
    second half of every claim statement (:func:`claim`, :func:`claim_keyed`).

    ``by_address``: ``claimable`` also holds each row's ``ctid`` (as ``row``), of a version
    that this statement's snapshot sees and that it has locked, and the rows are found by
    it (a TID scan) instead of through the primary key. Only exact when no locked row can
    be a version newer than the snapshot (:func:`claim_keyed` drops those): that version
    would be invisible to the scan, and its job left unclaimed."""
    now = _now()
    # An expired lease on the job's last attempt means that attempt died with its worker:
    # the job is dead now rather than run again, or a job that kills its worker every time
    # would loop forever. Such rows come back with status 'dead' and are not handed out.
    expired = table.c.status == _lit(JobStatus.RUNNING)
    # A cancel requested of an attempt whose worker died: the job ends cancelled, never
    # runs again (and comes back with status 'cancelled', not handed out either).
    cancelled = and_(expired, _cancel_requested(table))
    exhausted = or_(cancelled, and_(expired, table.c.attempts >= table.c.max_attempts))
    lost_lease: ColumnElement[str] = (
        literal_column("'attempt '")
        + func.cast(table.c.attempts, Text)
        + literal_column("' lost its lease: its worker stopped or crashed mid-job'")
    )
    match: list[ColumnElement[bool]] = [table.c.id == claimable.c.id]
    if by_address:
        # The target table's own ctid (a CTE has no system columns: the name is unambiguous);
        # the planner takes it over the primary key, whose match is then a filter.
        match.append(literal_column("ctid") == claimable.c.row)
    return (
        update(table)
        .where(*match)
        .values(
            status=case(
                (cancelled, _lit(JobStatus.CANCELLED)),
                (exhausted, _lit(JobStatus.DEAD)),
                else_=_lit(JobStatus.RUNNING),
            ),
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


def claim(table: Table, *, queue_count: int, limited: bool = False) -> Update:
    """Claim up to ``:limit`` runnable jobs and start an attempt on each.

    Runnable: pending with ``run_at`` reached, or running with an expired lease (a crashed or
    stalled attempt; folding the reaper into the claim means no separate process has to run
    for crashed jobs to come back). Order: ``(priority, run_at, id)``. Jobs with an ordering
    key are not this claim's: :func:`claim_keyed` takes them.

    Indexes: each queue's pending jobs come from the pending index ``(queue, priority,
    run_at, id) WHERE status = 'pending' AND ordering_key IS NULL``, read in its order, and
    its expired leases from the running index ``(queue, lease_expires_at) WHERE status =
    'running'``, read from the oldest lease end up to now (keyed ones filtered out); each
    read stops after ``:limit`` rows. So a claim reads neither the finished history, nor
    the jobs in flight on live leases, nor more than ``:limit`` rows per queue, however
    many queues it serves: with several queues
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
    ``last_error`` saying so) and comes back with status ``dead``, and one whose cancel was
    requested is made ``cancelled`` (:func:`_cancel_requested`): callers must hand out only
    the rows whose status is ``running``.

    ``limited`` (one queue, whose limit is ``:queue_slots`` and whose lock this transaction
    holds, :func:`lock_queues`): at most the queue's free slots are claimed
    (:func:`limited_count`, counted in this statement).

    Returns the job's columns (``trace_context`` last, NULL unless the job was enqueued
    under a trace). Parameters: ``:queue_name`` (one queue) or ``:queue_names`` (an array),
    ``:limit``, ``:lease_seconds``, ``:worker`` (and ``:queue_slots``).
    """
    if limited and queue_count != 1:
        raise ValueError("a limited claim serves one queue")
    now = _now()
    limit: ColumnElement[int] = bindparam("limit", type_=Integer)
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
            table.c.ordering_key.is_(None),
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
            table.c.ordering_key.is_(None),
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
    if limited:
        slots = (
            text(f"SELECT {limited_count(table)} AS n")
            .bindparams(*_limited_params())
            .columns(column("n", Integer))
            .subquery("slots")
        )
        limit = select(slots.c.n).scalar_subquery()
    claimable = (
        chosen.order_by(candidates.c.priority, candidates.c.run_at, candidates.c.id)
        .limit(limit)
        .cte("claimable")
    )
    return _start_attempts(table, claimable)


# -- the keyed claim (ordering keys, schema version 3) -------------------------------------


#: The transaction-local settings through which :func:`lock_keys` hands the keys it locked,
#: and their key limits, to :func:`claim_keyed` (arrays, in their text form).
LOCKED_KEYS: Final = "sqla_jobs.locked_keys"
LOCKED_KEY_LIMITS: Final = "sqla_jobs.locked_key_limits"


def _lock_space(name: str) -> int:
    digest = zlib.crc32(name.encode())
    return digest - (1 << 32) if digest >= 1 << 31 else digest


def key_lock_space(table: Table) -> int:
    """The first half of every key lock's id for this table (a signed 32-bit number derived
    from its qualified name), so that the same key in two job tables is two locks."""
    return _lock_space(qualified_name(table.name, table.schema))


def lock_keys(table: Table, *, rows: int, queue_count: int, limited: bool = False) -> TextClause:
    """Lock the ordering keys worth a keyed claim and hand them to :func:`claim_keyed`.

    The keys locked, in order, and each one's largest ``key_limit`` among the jobs that
    brought it in (how many of its jobs :func:`claim_keyed` reads), go into two
    transaction-local settings (``set_config(..., true)``: :data:`LOCKED_KEYS` and
    :data:`LOCKED_KEY_LIMITS`, arrays in their text form), where the next statement reads
    them: the keys never travel to the client and back (a claim of 50 locks some 66 keys,
    which the client would read as rows and send back as two arrays). Returns one row:
    how many keys were locked, and the two settings' values (``locked, keys,
    key_limits``).

    The first statement of a keyed claim, and its only way to serialise claimers per key:
    for each served queue, the keys of its first runnable keyed jobs in claim order (the
    keyed pending index ``(queue, priority, run_at, id) WHERE status = 'pending' AND
    ordering_key IS NOT NULL``) and of its first expired keyed leases (the running index),
    at most ``rows`` of each. Taken in the order of each key's best job, ``(priority,
    run_at, id)``, keys are locked while those before them could start fewer than ``:scan``
    jobs in all (a key can start up to its ``key_limit``, at most ``:per_key``): a claim of
    50 jobs of keys whose limit is 3 locks about a third as many keys as one of keys whose
    limit is 1, and :func:`claim_keyed` reads that many fewer rows. Each is locked with
    ``pg_try_advisory_xact_lock(<table's lock space>, hashtext(key))``. A key another claim
    holds is skipped, never waited for. The locks are transaction-scoped: they go at commit
    or rollback, also through PgBouncer in transaction mode; no session state is left.

    ``rows`` (at least ``:scan``) is part of the SQL text, not a parameter, and so is the
    queue when there is one (``queue_count`` 1: ``:queue_name``; else the ``:queue_names``
    array): PostgreSQL can then plan the prepared statement once (a generic plan) instead
    of on every run, which took as long as running it. With a ``LIMIT`` parameter or an
    array of queues, the generic plan's estimate (a tenth of the index per queue, a hundred
    queues) loses to a custom plan every time. Callers round ``rows`` up
    (:func:`sqla_jobs.queue.key_lock_params`), so that a worker's varying claim sizes make
    a few statements.

    The locks must be taken in a statement of their own, before :func:`claim_keyed`: under
    READ COMMITTED each statement reads a snapshot taken when it starts, so only a statement
    that starts after the lock is granted is sure to see the claim that the lock's previous
    holder committed. (Two keys whose hashes collide share a lock: a claim may skip a key
    that was free, never take one that was not.)

    ``limited`` (one queue, whose limit is ``:queue_slots``): the statement first takes the
    queue's lock (as :func:`lock_queues` does); if it got it, it counts the queue's free
    slots (:func:`limited_count`, up to ``:limit``), and locks keys only if one is free. It
    returns that count too (``locked, keys, key_limits, free``; ``free`` NULL when another
    claim holds the queue, and then no key is locked). The count is a hint: it was read
    with a snapshot taken before the queue's lock was granted, so it may miss a claim
    committed meanwhile (the exact count is the claim's, :func:`claim_keyed` ``limited``),
    or a completion (then this claim skips a queue that had a free slot: the next one
    takes it).

    Parameters: ``:queue_name`` or ``:queue_names``, ``:scan``, ``:per_key`` (and
    ``:queue_slots``, ``:limit``).
    """
    t = qualified_name(table.name, table.schema)
    pending, running = JobStatus.PENDING.value, JobStatus.RUNNING.value
    columns = "j.ordering_key, j.key_limit, j.priority, j.run_at, j.id"
    limit = int(rows)
    if limited and queue_count != 1:
        raise ValueError("a limited keyed claim serves one queue")
    if queue_count == 1:
        served, queue = "FROM ", ":queue_name"
        served_by: BindParameter[Any] = bindparam("queue_name", type_=Text)
    else:
        served = (
            "FROM unnest(CAST(:queue_names AS text[])) AS q (name)\n            CROSS JOIN LATERAL "
        )
        queue = "q.name"
        served_by = bindparam("queue_names", type_=ARRAY(Text))
    # The CASE makes the cut come first: no key past it is locked.
    gate = "g.free > 0 AND " if limited else ""
    keys = f"""SELECT k.ordering_key, k.key_limit, k.first FROM (
    SELECT g.ordering_key, g.key_limit, g.first,
        sum(least(g.key_limit, :per_key)) OVER (ORDER BY g.first ROWS UNBOUNDED PRECEDING)
            - least(g.key_limit, :per_key) AS ahead
    FROM (
        SELECT c.ordering_key, max(coalesce(c.key_limit, 1)) AS key_limit, min(c.n) AS first
        FROM (
            SELECT u.ordering_key, u.key_limit,
                row_number() OVER (ORDER BY u.priority, u.run_at, u.id) AS n
            {served}(
                (SELECT {columns} FROM {t} AS j
                 WHERE j.status = '{pending}' AND j.ordering_key IS NOT NULL
                   AND j.queue = {queue} AND j.run_at <= statement_timestamp()
                 ORDER BY j.priority, j.run_at, j.id LIMIT {limit})
                UNION ALL
                (SELECT {columns} FROM {t} AS j
                 WHERE j.status = '{running}' AND j.queue = {queue}
                   AND j.lease_expires_at <= statement_timestamp()
                   AND j.ordering_key IS NOT NULL
                 ORDER BY j.lease_expires_at LIMIT {limit})
            ) AS u
        ) AS c
        GROUP BY c.ordering_key
    ) AS g
) AS k
WHERE CASE WHEN {gate}k.ahead < :scan
    THEN pg_try_advisory_xact_lock({key_lock_space(table)}, hashtext(k.ordering_key))
    ELSE false END"""
    params = [served_by, bindparam("scan", type_=Integer), bindparam("per_key", type_=Integer)]
    # The keys and their limits go to claim_keyed through two transaction-local settings:
    # array_agg skips no row, and the arrays' text form reads back exactly.
    handed = f"""count(l.ordering_key) AS locked,
    set_config('{LOCKED_KEYS}',
        CAST(coalesce(array_agg(l.ordering_key ORDER BY l.first)
            FILTER (WHERE l.ordering_key IS NOT NULL), '{{}}') AS text), true) AS keys,
    set_config('{LOCKED_KEY_LIMITS}',
        CAST(coalesce(array_agg(l.key_limit ORDER BY l.first)
            FILTER (WHERE l.ordering_key IS NOT NULL), '{{}}') AS text), true) AS key_limits"""
    if not limited:
        sql = f"SELECT {handed} FROM ({keys}) AS l"
        return text(sql).bindparams(*params)
    sql = f"""WITH queue AS MATERIALIZED (SELECT {_queue_lock(table, ":queue_name")} AS locked),
gate AS MATERIALIZED (
    SELECT CASE WHEN q.locked THEN {limited_count(table)} END AS free FROM queue AS q
)
SELECT {handed}, g.free
FROM gate AS g LEFT JOIN LATERAL ({keys}) AS l ON true
GROUP BY g.free"""
    counted = [param for param in _limited_params() if param.key != "queue_name"]
    return text(sql).bindparams(*params, *counted)


def claim_keyed(table: Table, *, limited: bool = False) -> Update:
    """Claim up to ``:limit`` jobs of the ordering keys that :func:`lock_keys` locked earlier
    in this transaction (and left in :data:`LOCKED_KEYS`, with their limits in
    :data:`LOCKED_KEY_LIMITS`; none if it did not run) from the queues in
    ``:queue_names``, and start an attempt on each, as :func:`claim` does.

    The rule, per key: its jobs *in progress* are its running attempts on a live lease (or
    whose row a lock-held worker holds) and its jobs waiting for a retry (pending with
    ``attempts > 0`` and ``run_at`` not reached): they keep their place. Next in line come
    its expired attempts that nobody holds (taken over first, so a crashed worker's key is
    free again when its lease ends), then its retries that are due, then its new runnable
    jobs (``attempts = 0``, ``run_at`` reached; a job scheduled later blocks nobody) in
    ``(priority, run_at, id)`` order. A job in line at place ``p`` may start when ``in
    progress + p <= its key_limit`` (NULL: 1, one at a time). A job in line that this claim
    does not serve (another queue) or cannot lock keeps its place: no job behind it is
    taken instead. The chosen jobs of all keys are claimed best first, ``:limit`` at most.

    Why it is exact: a key's jobs change from pending to running only in a claim that holds
    the key's lock, and this statement's snapshot was taken after the lock was granted, so it
    sees every such change committed before. Other transitions (completion, failure,
    cancelling) only ever free a place; read late, they make a claim take less, never more.

    Indexes: per key, two ranges of the key index ``(ordering_key, status, attempts,
    priority, run_at, id) WHERE status IN ('pending', 'running')``: its jobs in progress
    and its retries, everything after ``('pending', 0)`` in ``(status, attempts)``, a row
    comparison that only this index can bound (written ``status = 'running'``, the read
    could go to the running index instead, which the planner does when statistics taken
    before any job ran call it small, and filter every job in flight by key, for each
    key); and its new jobs, pending with ``attempts = 0`` (read in order, as many rows as
    the key's entry in :data:`LOCKED_KEY_LIMITS` says, the key limit :func:`lock_keys` saw, but at
    most ``:per_key``: a claim starts at most that many jobs of one key, whatever its
    ``key_limit``). Locks: expired attempts, and then the chosen rows, ``FOR UPDATE SKIP
    LOCKED``. The chosen rows are found again by the address (``ctid``) of the version the
    key's reads saw, a TID scan that reads no index: a chosen row that another transaction
    has changed since this statement's snapshot has a new version elsewhere, and is dropped
    (PostgreSQL re-checks the address against the new version), never claimed in a state
    this statement did not rank. (The address is good within the statement: the version it
    saw is visible to its snapshot, so no vacuum can free it meanwhile.)

    ``limited`` (a limited queue's keyed claim, as for :func:`claim`): at most the queue's
    free slots are claimed (:func:`limited_count`, counted in this statement; ``:queue_name``
    names the queue, ``:queue_names`` holds it alone).

    Parameters: ``:queue_names`` (an array), ``:limit``, ``:per_key``, ``:lease_seconds``,
    ``:worker`` (and ``:queue_name``, ``:queue_slots``).
    """
    t = qualified_name(table.name, table.schema)
    pending, running = JobStatus.PENDING.value, JobStatus.RUNNING.value
    columns = (
        "j.ctid AS row, j.id, j.ordering_key, j.queue, j.status, j.attempts, j.priority, "
        "j.run_at, j.lease_expires_at, j.key_limit"
    )
    now = "statement_timestamp()"
    chosen = (
        text(
            f"""WITH member AS MATERIALIZED (
    SELECT m.*
    FROM unnest(
        CAST(current_setting('{LOCKED_KEYS}', true) AS text[]),
        CAST(current_setting('{LOCKED_KEY_LIMITS}', true) AS integer[])
    ) AS k (ordering_key, reads)
    CROSS JOIN LATERAL (
        (SELECT {columns} FROM {t} AS j
         WHERE j.ordering_key = k.ordering_key
           AND j.status IN ('{pending}', '{running}') AND (j.status, j.attempts) > ('{pending}', 0))
        UNION ALL
        (SELECT {columns} FROM {t} AS j
         WHERE j.ordering_key = k.ordering_key AND j.status = '{pending}' AND j.attempts = 0
           AND j.run_at <= {now}
         ORDER BY j.priority, j.run_at, j.id LIMIT least(k.reads, :per_key))
    ) AS m
), free AS MATERIALIZED (
    SELECT j.id FROM {t} AS j
    WHERE j.id IN (
        SELECT member.id FROM member
        WHERE member.status = '{running}' AND member.lease_expires_at <= {now}
    )
      AND j.status = '{running}' AND j.lease_expires_at <= {now}
    FOR UPDATE OF j SKIP LOCKED
), staged AS (
    SELECT m.*, CASE
        WHEN m.id IN (SELECT free.id FROM free) THEN 0
        WHEN m.status = '{running}' THEN NULL
        WHEN m.attempts > 0 AND m.run_at > {now} THEN NULL
        WHEN m.attempts > 0 THEN 1
        ELSE 2
    END AS stage
    FROM member AS m
), ranked AS (
    SELECT s.*,
        count(*) FILTER (WHERE s.stage IS NULL) OVER (PARTITION BY s.ordering_key) AS held,
        row_number() OVER (
            PARTITION BY s.ordering_key ORDER BY s.stage, s.priority, s.run_at, s.id
        ) AS place
    FROM staged AS s
), chosen AS (
    SELECT r.row FROM ranked AS r
    WHERE r.stage IS NOT NULL AND r.held + r.place <= coalesce(r.key_limit, 1)
      AND r.queue = ANY (CAST(:queue_names AS text[]))
    ORDER BY r.priority, r.run_at, r.id
    LIMIT {limited_count(table) if limited else ":limit"}
)
SELECT j.id, j.ctid AS row FROM {t} AS j
WHERE j.ctid = ANY (ARRAY(SELECT chosen.row FROM chosen))
  AND (j.status = '{pending}' AND j.run_at <= {now}
       OR j.status = '{running}' AND j.lease_expires_at <= {now})
FOR UPDATE OF j SKIP LOCKED"""
        )
        .bindparams(
            bindparam("queue_names", type_=ARRAY(Text)),
            bindparam("per_key", type_=Integer),
            *(_limited_params() if limited else [bindparam("limit", type_=Integer)]),
        )
        .columns(column("id", BigInteger), column("row"))
        .cte("claimable")
    )
    return _start_attempts(table, chosen, by_address=True)


# -- the limited claim (per-queue concurrency limits) --------------------------------------


def queue_lock_space(table: Table) -> int:
    """The first half of every queue lock's id for this table: :func:`key_lock_space`'s
    rule over ``<qualified name>#queues``, so that a queue and an ordering key of the same
    name are two locks (a collision would only make a claim skip, never overrun)."""
    return _lock_space(qualified_name(table.name, table.schema) + "#queues")


def lock_queues(table: Table) -> TextClause:
    """Lock the queues of ``:queue_names`` (the limited queues a claim serves) for this
    transaction; returns the names locked, in the order given.

    The first statement of a limited claim, and its only way to serialise claimers per
    queue: ``pg_try_advisory_xact_lock(<table's queue lock space>, hashtext(queue))``. A
    queue another claim holds is skipped this round, never waited for. Transaction-scoped,
    as :func:`lock_keys`, and for the same reason a statement of its own: the claim that
    counts the queue's free slots (:func:`limited_count`) starts after the lock was
    granted, so it sees every claim the queue's previous holder committed. Reads no table.
    (A keyed claim takes its queue's lock in :func:`lock_keys` instead, with its keys.)

    Parameters: ``:queue_names`` (an array).
    """
    return text(
        f"""SELECT q.name
FROM unnest(CAST(:queue_names AS text[])) WITH ORDINALITY AS q (name, n)
WHERE {_queue_lock(table, "q.name")}
ORDER BY q.n"""
    ).bindparams(bindparam("queue_names", type_=ARRAY(Text)))


def _queue_lock(table: Table, queue: str) -> str:
    # A queue's transaction-scoped try-lock, as SQL (``queue``: a column or a parameter).
    return f"pg_try_advisory_xact_lock({queue_lock_space(table)}, hashtext({queue}))"


def limited_count(table: Table) -> str:
    """How many jobs a claim of ``:limit`` may start in the limited queue ``:queue_name``,
    whose limit is ``:queue_slots``: the smaller of ``:limit`` and the queue's free slots,
    its limit minus its live attempts (zero when it is full), as a SQL expression, the
    ``LIMIT`` of :func:`claim` and :func:`claim_keyed` ``limited``. The one home of the rule
    a queue limit counts by; the queue's lock (:func:`lock_queues`, or :func:`lock_keys`
    ``limited``) must be held, taken in an earlier statement.

    Live attempts are the queue's running jobs except those whose lease has expired and
    whose row nobody holds: a crashed worker's attempt stops counting when its lease ends
    (the claim that takes it over is a new attempt, and must fit in the limit), while a
    lock-held attempt whose handler outlives its lease still counts (its row is locked).
    Counted as all running minus the expired rows the statement can lock ``FOR UPDATE
    SKIP LOCKED``; those stay locked by this transaction, and the claim, which evaluates
    its ``LIMIT`` before it reads a row, takes them over without skipping them. A row that
    another transaction holds for a moment (a completion, a heartbeat) counts as live:
    read late, a freed slot is used by the next claim, never one too many by this one.
    Exact because a queue's jobs become running only in a claim that holds the queue's
    lock, and a statement that starts after the lock was granted has a younger snapshot
    (the count and the claim share the statement's snapshot: a claim later in the same
    transaction, filling a keyed claim's batch with plain jobs, counts the keyed ones).

    Indexes: the running index ``(queue, lease_expires_at) WHERE status = 'running'``
    twice: the count of all the queue's running rows (an index-only scan where the
    visibility map allows), and its expired range from the oldest lease end up to now.
    """
    t = qualified_name(table.name, table.schema)
    running = JobStatus.RUNNING.value
    return f"""greatest(0, least(:limit, :queue_slots
    - (SELECT count(*) FROM {t} AS j WHERE j.status = '{running}' AND j.queue = :queue_name)
    + (SELECT count(*) FROM (
        SELECT j.id FROM {t} AS j
        WHERE j.status = '{running}' AND j.queue = :queue_name
          AND j.lease_expires_at <= statement_timestamp()
        FOR UPDATE OF j SKIP LOCKED
      ) AS expired)))"""


def _limited_params() -> list[BindParameter[Any]]:
    # The parameters of limited_count.
    return [
        bindparam("limit", type_=Integer),
        bindparam("queue_slots", type_=Integer),
        bindparam("queue_name", type_=Text),
    ]


def lock(table: Table) -> Select[Any]:
    """Lock the rows of attempts this worker holds, until the caller's transaction ends.

    The second half of a lock-held claim: :func:`claim` committed the attempt (so it counts
    even if the worker dies), and this ``SELECT ... FOR UPDATE`` holds the rows for the
    transaction that runs the handlers. Fenced by ``(id, attempts)``: an attempt whose lease
    already ran out and was taken over is not returned. Rows are locked in id order.

    The lock is ``FOR KEY SHARE``: every claim and heartbeat locks ``FOR UPDATE SKIP
    LOCKED``, which conflicts with it, so they skip the row as before; but a plain
    ``UPDATE`` of a non-key column does not wait for it, so :func:`request_cancel` can
    record a cancel request while the handler holds the row (the handler's own completion
    then waits for that request to commit, sees it, and the worker rolls back).

    Returns ``id, attempts`` and the locking transaction's start as epoch seconds (which,
    with the backend's pid, names that transaction: :func:`terminate_transactions`).
    Parameters: ``:fence_ids``, ``:fence_attempts``. Finds the rows through the primary key
    (:func:`_fenced_by_key`).
    """
    return (
        select(
            table.c.id,
            table.c.attempts,
            func.extract("epoch", func.transaction_timestamp()).label("xact_start"),
        )
        .where(_fenced_by_key(table))
        .order_by(table.c.id)
        .with_for_update(of=table, read=True, key_share=True)
    )


def complete(table: Table) -> Update:
    """Mark the given attempts succeeded, or cancelled when their cancel was requested
    (:func:`_cancel_requested`). Fenced.

    Returns ``id, attempts, task, status`` of each job it ended.

    Parameters: ``:fence_ids``, ``:fence_attempts``. Locks the matched rows (an ``UPDATE``).
    """
    _, match = _fences(table)
    return (
        update(table)
        .where(match)
        .values(
            status=case(
                (_cancel_requested(table), _lit(JobStatus.CANCELLED)),
                else_=_lit(JobStatus.SUCCEEDED),
            ),
            finished_at=_now(),
            lease_expires_at=null(),
        )
        .returning(table.c.id, table.c.attempts, table.c.task, table.c.status)
    )


def complete_held(table: Table) -> Update:
    """Mark succeeded the given attempts whose rows the caller's transaction holds locked
    (:func:`lock`), except those whose cancel was requested: a lock-held group's
    completion. Fenced; finds the rows through the primary key (:func:`_fenced_by_key`).

    A job whose cancel was requested is left as it is (running, its cancel requested): its
    handler's writes roll back, and the worker cancels it once its transaction has ended.
    Returns ``id, attempts`` of each job it completed.
    Parameters: ``:fence_ids``, ``:fence_attempts``. Locks the matched rows (an ``UPDATE``).
    """
    match = _fenced_by_key(table)
    return (
        update(table)
        .where(match, table.c.cancel_requested_at.is_(null()))
        .values(
            status=_lit(JobStatus.SUCCEEDED),
            finished_at=_now(),
            lease_expires_at=null(),
        )
        .returning(table.c.id, table.c.attempts)
    )


def complete_and_delete(table: Table) -> ReturningDelete[Any]:
    """Delete the rows of the given succeeded attempts (seed 001's variant). Fenced.

    A job whose cancel was requested is not deleted (it is not succeeded): it comes back
    as not matched, for :func:`cancel_attempts`. Returns ``id, attempts, task`` of each
    deleted job.
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    _, match = _fences(table)
    return (
        delete(table)
        .where(match, table.c.cancel_requested_at.is_(null()))
        .returning(table.c.id, table.c.attempts, table.c.task)
    )


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

    The job is cancelled when its cancel was requested (:func:`_cancel_requested`), dead
    when this was its last attempt (``attempts >= max_attempts``) or when ``:retry`` is
    false; otherwise it is pending again at ``statement_timestamp()`` plus
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
            status=case(
                (_cancel_requested(table), _lit(JobStatus.CANCELLED)),
                (is_dead, _lit(JobStatus.DEAD)),
                else_=_lit(JobStatus.PENDING),
            ),
            run_at=case(
                (or_(is_dead, _cancel_requested(table)), table.c.run_at),
                else_=now + delay * _SECOND,
            ),
            finished_at=case((or_(is_dead, _cancel_requested(table)), now), else_=null()),
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

    A job whose cancel was requested is not given back: it ends cancelled instead.

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
            status=case(
                (_cancel_requested(table), _lit(JobStatus.CANCELLED)),
                else_=_lit(JobStatus.PENDING),
            ),
            run_at=_now(),
            max_attempts=table.c.max_attempts + _ONE,
            finished_at=case((_cancel_requested(table), _now()), else_=null()),
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id, table.c.attempts)
    )


def retry(table: Table) -> Update:
    """Make a dead or cancelled job ``:job_id`` pending again, runnable now.

    It gets at least one more attempt; ``attempts`` is kept, so fencing stays sound; a
    cancel request it carried is cleared. Returns the id, or no row when the job is not
    dead or cancelled.
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
            cancel_requested_at=null(),
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


def delete_job(table: Table) -> ReturningDelete[Any]:
    """Delete job ``:job_id`` unless it is running. Returns the id, or no row when the job
    is running (or does not exist).

    A running job is not deleted: its attempt owns it until it ends, and would find its row
    gone. Locks the row (a ``DELETE``); uses the primary key.
    """
    return (
        delete(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.status != _lit(JobStatus.RUNNING),
        )
        .returning(table.c.id)
    )


#: The NOTIFY payload that asks a worker to stop attempt ``<attempt>`` of job ``<id>``:
#: ``"!cancel:<id>:<attempt>"``, sent on the table's channel. A queue name cannot begin
#: with ``!`` (:data:`sqla_jobs.validation.NAME_RULE`), so it is never taken for one.
CANCEL_PAYLOAD_PREFIX: Final = "!cancel:"


def request_cancel(table: Table) -> Update:
    """Ask the running attempt of job ``:job_id`` to stop: set ``cancel_requested_at``
    (kept if set already: idempotent) and notify the table's channel with
    ``!cancel:<id>:<attempt>`` (:data:`CANCEL_PAYLOAD_PREFIX`), delivered at commit.

    Returns ``id, attempts`` (and the notification's empty value), or no row when the job
    is not running. Locks the row like any ``UPDATE``; a lock-held handler's ``FOR KEY
    SHARE`` lock (:func:`lock`) does not make it wait.
    """
    payload: ColumnElement[str] = (
        literal_column(f"'{CANCEL_PAYLOAD_PREFIX}'")
        + func.cast(table.c.id, Text)
        + literal_column("':'")
        + func.cast(table.c.attempts, Text)
    )
    channel: ColumnElement[str] = literal_column(
        "'" + names(table.name).channel.replace("'", "''") + "'"
    )
    return (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.status == _lit(JobStatus.RUNNING),
        )
        .values(cancel_requested_at=func.coalesce(table.c.cancel_requested_at, _now()))
        .returning(table.c.id, table.c.attempts, func.pg_notify(channel, payload))
    )


def cancel_attempts(table: Table) -> Update:
    """End the given attempts' jobs ``cancelled`` (a worker's cancel outcome). Fenced.

    Returns ``id, attempts`` of the cancelled jobs.
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    _, match = _fences(table)
    return (
        update(table)
        .where(match)
        .values(
            status=_lit(JobStatus.CANCELLED),
            finished_at=_now(),
            lease_expires_at=null(),
            leased_by=null(),
        )
        .returning(table.c.id, table.c.attempts)
    )


def cancel_requests(table: Table) -> Select[Any]:
    """Which of the given attempts have a cancel request: ``id, attempts``. Fenced.

    A plain read (no row lock, so it also sees the rows that lock-held handlers hold):
    the heartbeat's fallback for a cancel notification the worker missed.
    Parameters: ``:fence_ids``, ``:fence_attempts``.
    """
    pairs, match = _fences(table)
    return (
        select(table.c.id, table.c.attempts)
        .select_from(table)
        .join(pairs, match)
        .where(_cancel_requested(table))
    )


def own_columns(table: Table) -> Select[Any]:
    """The model's own columns (:func:`enqueue_columns` past :data:`ENQUEUE_COLUMNS`) of
    job ``:job_id``, by primary key; no lock. What a handler's ``ctx.columns`` reads."""
    own = [
        name
        for name in enqueue_columns(table)[len(ENQUEUE_COLUMNS) :]
        if name not in ORDERING_COLUMNS
    ]
    return select(*(table.c[name] for name in own)).where(
        table.c.id == bindparam("job_id", type_=BigInteger)
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
