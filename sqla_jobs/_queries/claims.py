"""The claim statements: plain and limited (queue limits), and what the keyed claim
(:mod:`sqla_jobs._queries.keyed`) shares with them; see :mod:`sqla_jobs._queries`."""

from __future__ import annotations

import zlib
from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
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
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import BindParameter

from sqla_jobs._queries._sql import (
    _ONE,
    _cancel_requested,
    _lit,
    _now,
    _readable_time,
    _seconds,
)
from sqla_jobs._queries.rows import ClaimRow
from sqla_jobs._queries.run import Query, json_text_on_asyncpg
from sqla_jobs.ddl import qualified_name
from sqla_jobs.schema import JobStatus
from sqla_jobs.schema.pauses import pause_table

# -- the plain claim -----------------------------------------------------------------------


def _start_attempts(
    table: Table,
    claimable: Any,
    *,
    by_address: bool = False,
    listed: bool = False,
    json_text: bool = False,
) -> Update:
    """The ``UPDATE`` that starts an attempt on each job of ``claimable`` (a CTE of ids), the
    second half of every claim statement (:func:`claim`, :func:`claim_keyed`).

    ``by_address``: ``claimable`` also holds each row's ``ctid`` (as ``row``), of a version
    that this statement's snapshot sees and that it has locked, and the rows are found by
    it (a TID scan) instead of through the primary key. Only exact when no locked row can
    be a version newer than the snapshot (:func:`claim_keyed` drops those): that version
    would be invisible to the scan, and its job left unclaimed.

    ``listed``: the rows are found through the primary key by the array of ``claimable``'s
    ids (``id = ANY (<array>)``, the array read once), whatever the planner guesses of how
    many there are: a plan made for any parameters (a prepared statement's generic plan)
    would otherwise join a CTE whose size it cannot know to the whole table.

    ``json_text``: ``args`` and ``trace_context`` come back as their text, for a driver that
    decodes jsonb itself where no tolerant decoder can be put in (asyncpg: SQLAlchemy gives
    it ``json.loads`` as the codec); :func:`sqla_jobs._queries.run.fetch` decodes them, so
    that a value Python's json cannot decode fails no claim (:class:`UnreadableJson`)."""
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
    match: list[ColumnElement[bool]] = [
        table.c.id
        == any_(cast(select(func.array_agg(claimable.c.id)).scalar_subquery(), ARRAY(BigInteger)))
        if listed
        else table.c.id == claimable.c.id
    ]
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
            attempted_at=case((exhausted, table.c.attempted_at), else_=now),
        )
        .returning(
            table.c.id,
            table.c.status,
            table.c.queue,
            table.c.task,
            _json(table.c.args, as_text=json_text),
            table.c.priority,
            table.c.attempts,
            table.c.max_attempts,
            _readable_time(table.c.run_at),
            table.c.lease_expires_at,
            # NULL unless the job was enqueued under a span: free on the wire and to decode.
            _json(table.c.trace_context, as_text=json_text),
            # NULL unless the job has a time limit of its own (schema version 4).
            table.c.time_limit,
        )
    )


def _json(column: Any, *, as_text: bool) -> Any:
    return cast(column, Text).label(column.key) if as_text else column


@json_text_on_asyncpg
def claim(
    table: Table, *, queue_count: int, limited: bool = False, json_text: bool = False
) -> Update:
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

    Paused queues (:func:`sqla_jobs.pause_queue`: a row in the table's pause table,
    :func:`~sqla_jobs.schema.pauses.pause_table`) are not read: neither their pending jobs
    nor their expired leases are claimed, and jobs running in them go on. The pause table
    (one row per paused queue) is read once per claim, before any index is read or a row
    locked: for one queue, a one-time filter over the candidates; for several, an
    anti-join of the queue array, so only the queues not paused are read.

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
    # A paused queue (a row in the pause table) is not read: one read of the pause table
    # per claim, before any index is read or a row locked. One queue: a one-time filter
    # over the candidates (it names the queue, not a job; PostgreSQL pushes no qual with a
    # subquery down into the reads, so it is evaluated once, not once per read), and when
    # it fails the reads do not run; several: a filter of the queue array (an anti-join),
    # so the lateral reads run only for the queues not paused.
    pauses = pause_table(table)
    paused = select(pauses.c.queue).where(pauses.c.queue == queue)
    not_paused = ~(paused if queues is None else paused.correlate(queues)).exists()
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
        chosen = (
            select(candidates.c.id).select_from(queues).join(candidates, true()).where(not_paused)
        )
    else:
        chosen = select(candidates.c.id).where(not_paused)
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
    return _start_attempts(table, claimable, json_text=json_text)


# -- the limited claim (per-queue concurrency limits) --------------------------------------


def _lock_space(name: str) -> int:
    digest = zlib.crc32(name.encode())
    return digest - (1 << 32) if digest >= 1 << 31 else digest


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


# -- the queries --------------------------------------------------------------------------


class _ClaimRequired(TypedDict):
    limit: int
    lease_seconds: float
    worker: str


class ClaimParams(_ClaimRequired, total=False):
    """:func:`claim`'s parameters: the queue (``queue_name`` for a statement built with
    ``queue_count=1``, else ``queue_names``), and a limited claim's ``queue_slots``."""

    queue_name: str
    queue_names: list[str]
    queue_slots: int


class QueueNamesParams(TypedDict):
    queue_names: list[str]


class LockedQueueRow(NamedTuple):
    """A queue :func:`lock_queues` locked."""

    name: str


CLAIM: Final = Query(claim, ClaimParams, ClaimRow)
LOCK_QUEUES: Final = Query(lock_queues, QueueNamesParams, LockedQueueRow)
