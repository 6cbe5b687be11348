"""The keyed claim (ordering keys, schema version 3): :func:`lock_keys`, :func:`walk_keys`
and :func:`claim_keyed`, the statements of one keyed claim in the order they run; see
:mod:`sqla_jobs._queries`."""

from __future__ import annotations

from typing import Any, Final, TypedDict

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    Integer,
    Table,
    Text,
    TextClause,
    Update,
    bindparam,
    column,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import BindParameter

from sqla_jobs._queries.claims import (
    _limited_params,
    _lock_space,
    _queue_lock,
    _start_attempts,
    limited_count,
)
from sqla_jobs._queries.rows import ClaimRow, LockKeysRow, WalkKeysRow
from sqla_jobs._queries.run import Query, json_text_on_asyncpg
from sqla_jobs.ddl import qualified_name
from sqla_jobs.schema import JobStatus
from sqla_jobs.schema.pauses import paused_predicate
from sqla_jobs.schema.rates import rate_table_name

# -- the keyed claim -------------------------------------


#: The transaction-local settings through which :func:`lock_keys` hands the keys it locked,
#: and their key limits, to :func:`claim_keyed` (arrays, in their text form).
LOCKED_KEYS: Final = "sqla_jobs.locked_keys"
LOCKED_KEY_LIMITS: Final = "sqla_jobs.locked_key_limits"


def _handed_over(kind: str) -> str:
    """The keys (``text[]``) or their limits (``integer[]``) that :func:`lock_keys` left in its
    settings for this transaction: NULL if it did not run (a setting once set in the
    session reads back as an empty string afterwards, not as NULL)."""
    name = LOCKED_KEYS if kind == "text[]" else LOCKED_KEY_LIMITS
    return f"CAST(nullif(current_setting('{name}', true), '') AS {kind})"


def key_lock_space(table: Table) -> int:
    """The first half of every key lock's id for this table (a signed 32-bit number derived
    from its qualified name), so that the same key in two job tables is two locks."""
    return _lock_space(qualified_name(table.name, table.schema))


def _key_lock(table: Table, key: str) -> str:
    """The try-lock on the ordering key ``key`` (a SQL expression) of this table's jobs, as
    every keyed statement takes it (:func:`_queue_lock`'s twin for keys)."""
    return f"pg_try_advisory_xact_lock({key_lock_space(table)}, hashtext({key}))"


def _after_new_jobs(key: str) -> str:
    """The condition on ``j`` (a job row) for the key ``key``'s jobs other than its new ones:
    its running attempts and its retries, everything after ``('pending', 0)`` in ``(status,
    attempts)``: one range of the key index (see :func:`claim_keyed`), where a key's jobs in
    progress are."""
    pending, running = JobStatus.PENDING.value, JobStatus.RUNNING.value
    return (
        f"j.ordering_key = {key} AND j.status IN ('{pending}', '{running}') "
        f"AND (j.status, j.attempts) > ('{pending}', 0)"
    )


def lock_keys(table: Table, *, rows: int, queue_count: int, limited: bool = False) -> TextClause:
    """Lock the ordering keys worth a keyed claim and hand them to :func:`claim_keyed`.

    The keys locked, in order, and each one's largest ``key_limit`` among the jobs that
    brought it in (how many of its jobs :func:`claim_keyed` reads), go into two
    transaction-local settings (``set_config(..., true)``: :data:`LOCKED_KEYS` and
    :data:`LOCKED_KEY_LIMITS`, arrays in their text form), where the next statement reads
    them: the keys never travel to the client and back (a claim of 50 locks some 54 keys,
    which the client would read as rows and send back as two arrays). Returns one row:
    how many keys were locked, the two settings' values, how many jobs those keys could
    start (a key counts for its ``key_limit``, at most ``:per_key``), and whether a queue
    had ``rows`` jobs in line, so that more may wait behind them (``locked, keys,
    key_limits, capacity, full``; see :func:`walk_keys`).

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
    returns that count too (``locked, keys, key_limits, capacity, full, free``; ``free``
    NULL when another claim holds the queue, and then no key is locked). The count is a
    hint: it was read with a snapshot taken before the queue's lock was granted, so it may
    miss a claim committed meanwhile (the exact count is the claim's, :func:`claim_keyed`
    ``limited``), or a completion (then this claim skips a queue that had a free slot: the
    next one takes it).

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
    # A paused queue's keys are not read (a one-time filter of each read: it names the
    # queue, not the job), so none of them is locked.
    paused = paused_predicate(table, queue)
    # The CASE makes the cut come first: no key past it is locked. ``got`` is evaluated
    # once per key (a subquery with a volatile function in its select list is not pulled
    # up); ``full`` counts every key in line, locked or not: a claim whose keys in line are
    # all held by other claims still walks on past them (walk_keys).
    gate = "g.free > 0 AND " if limited else ""
    keys = f"""SELECT k.ordering_key, k.key_limit, k.first, k.last,
    CASE WHEN {gate}k.ahead < :scan
        THEN {_key_lock(table, "k.ordering_key")}
        ELSE false END AS got
FROM (
    SELECT g.ordering_key, g.key_limit, g.first, g.last,
        sum(least(g.key_limit, :per_key)) OVER (ORDER BY g.first ROWS UNBOUNDED PRECEDING)
            - least(g.key_limit, :per_key) AS ahead
    FROM (
        SELECT c.ordering_key, max(coalesce(c.key_limit, 1)) AS key_limit, min(c.n) AS first,
            max(c.n) AS last
        FROM (
            SELECT u.ordering_key, u.key_limit,
                row_number() OVER (ORDER BY u.priority, u.run_at, u.id) AS n
            {served}(
                (SELECT {columns} FROM {t} AS j
                 WHERE j.status = '{pending}' AND j.ordering_key IS NOT NULL
                   AND j.queue = {queue} AND j.run_at <= statement_timestamp()
                   AND NOT {paused}
                 ORDER BY j.priority, j.run_at, j.id LIMIT {limit})
                UNION ALL
                (SELECT {columns} FROM {t} AS j
                 WHERE j.status = '{running}' AND j.queue = {queue}
                   AND j.lease_expires_at <= statement_timestamp()
                   AND j.ordering_key IS NOT NULL AND NOT {paused}
                 ORDER BY j.lease_expires_at LIMIT {limit})
            ) AS u
        ) AS c
        GROUP BY c.ordering_key
    ) AS g
) AS k"""
    params = [served_by, bindparam("scan", type_=Integer), bindparam("per_key", type_=Integer)]
    # The keys and their limits go to claim_keyed through two transaction-local settings:
    # array_agg skips no row, and the arrays' text form reads back exactly. ``capacity``:
    # how many jobs the keys locked could start; ``full``: a queue had ``rows`` jobs in
    # line, and others may wait behind them (walk_keys finds their keys).
    handed = f"""count(*) FILTER (WHERE l.got) AS locked,
    set_config('{LOCKED_KEYS}',
        CAST(coalesce(array_agg(l.ordering_key ORDER BY l.first)
            FILTER (WHERE l.got), '{{}}') AS text), true) AS keys,
    set_config('{LOCKED_KEY_LIMITS}',
        CAST(coalesce(array_agg(l.key_limit ORDER BY l.first)
            FILTER (WHERE l.got), '{{}}') AS text), true) AS key_limits,
    coalesce(sum(least(l.key_limit, :per_key)) FILTER (WHERE l.got), 0) AS capacity,
    coalesce(max(l.last) >= {limit}, false) AS full"""
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


#: How many jobs in line one step of :func:`walk_keys` reads, and how many steps it takes
#: at most per queue.
WALK_STEP_ROWS: Final = 64
WALK_STEPS: Final = 32


def walk_keys(table: Table, *, rows: int, queue_count: int, busy: bool = False) -> TextClause:
    """Lock more keys after :func:`lock_keys`, when a queue had ``rows`` jobs in line
    (``full``) but the keys it locked could not fill the claim: they were too few
    (``capacity`` under ``:scan``: one key's burst, or keys in line that other claims hold),
    or too busy (the keyed claim came back short, each key's jobs in progress filling its
    limit). The keys behind them would otherwise wait until those jobs have run, or those
    claims have ended.

    Per served queue, from the last of its first ``rows`` runnable keyed jobs in claim order
    on, it walks the keyed pending index :data:`WALK_STEP_ROWS` jobs a step (one range
    each). The keys of a step's jobs not seen yet (neither among those ``rows`` jobs nor
    locked already, nor seen in an earlier step) are locked in claim order as
    :func:`lock_keys` locks them (a try-lock: a key another claim holds is skipped, never
    waited for, and adds nothing), while the keys locked could start fewer than ``:scan``
    jobs with ``:capacity`` (a key counts for its job's ``key_limit``, at most
    ``:per_key``; the keys of a step past that cut are passed over). A step whose jobs all
    belong to keys seen is inside a run of them (a burst): the walk jumps from its last job
    to the last job of that key with the same ``(priority, run_at)`` (a descent of the key
    index, backwards), so that a burst enqueued in one transaction is passed in a step or
    two, whatever its size (another key's job inside that run is passed over too, for this
    claim). A queue's walk stops when the keys locked reach ``:scan``, after
    :data:`WALK_STEPS` steps (a run of one key's jobs enqueued one per transaction is
    passed a step at a time: up to ``WALK_STEPS * WALK_STEP_ROWS`` jobs), or at its last
    job. The keys locked, in claim order, go into the two settings: after the keys there
    (``:keep``), or instead of them (their jobs were claimed already). Returns one row: how
    many keys it locked, the two settings' values, and whether a queue's walk stopped
    because its keys could start ``:scan`` jobs (``locked, keys, key_limits, reached``:
    when they did not, the walk passed every key it could see).

    ``busy`` (the walk after a keyed claim came back short: keys in line are busy, and
    more may be behind them): each key found counts for the jobs it could start by its jobs
    in progress (running on a live lease, or waiting for a retry; counted up to its
    ``key_limit``, one range of the key index, read before the key's lock: a hint, the
    claim decides), and a key that could start none is neither locked nor counted, so that
    the walk goes on past busy keys to keys that can start a job. Without it a key counts
    for its ``key_limit`` (no read per key: a walk past a burst or past other claims' keys
    finds keys that are rarely busy).

    Parameters: ``:queue_name`` or ``:queue_names``, ``:scan``, ``:per_key``,
    ``:capacity``, ``:keep``.
    """
    t = qualified_name(table.name, table.schema)
    pending, running = JobStatus.PENDING.value, JobStatus.RUNNING.value
    served_by: BindParameter[Any]
    # The queues walked: those served that are not paused.
    if queue_count == 1:
        served = (
            "SELECT CAST(:queue_name AS text) AS name "
            f"WHERE NOT {paused_predicate(table, ':queue_name')}"
        )
        served_by = bindparam("queue_name", type_=Text)
    else:
        served = (
            "SELECT q.name FROM unnest(CAST(:queue_names AS text[])) AS q (name) "
            f"WHERE NOT {paused_predicate(table, 'q.name')}"
        )
        served_by = bindparam("queue_names", type_=ARRAY(Text))

    def runnable(queue: str) -> str:
        return f"""j.status = '{pending}' AND j.ordering_key IS NOT NULL
              AND j.queue = {queue} AND j.run_at <= statement_timestamp()"""

    # A key's room: the jobs it could start, at most :per_key. After a short claim, its
    # jobs in progress are counted (a hint, read before its lock: claim_keyed decides),
    # and a key with none is passed over; else its key_limit, as lock_keys counts it.
    room = "least(f.key_limit, :per_key)"
    if busy:
        room = f"""least(f.key_limit - (
                        SELECT CAST(count(*) AS integer) FROM (
                            SELECT FROM {t} AS j
                            WHERE {_after_new_jobs("f.ordering_key")}
                              AND CASE WHEN j.status = '{running}'
                                  THEN j.lease_expires_at > statement_timestamp()
                                  ELSE j.run_at > statement_timestamp() END
                            LIMIT f.key_limit
                        ) AS b
                    ), :per_key)"""
    locked_keys, locked_limits = _handed_over("text[]"), _handed_over("integer[]")
    sql = f"""WITH RECURSIVE held AS MATERIALIZED (
    SELECT coalesce({locked_keys}, '{{}}') AS keys, CAST(:capacity AS bigint) AS capacity
), walk AS (
    SELECT q.name AS queue, true AS cont, CAST(NULL AS text) AS ordering_key, 1 AS key_limit,
        e.priority, e.run_at, e.id, h.keys || e.keys AS keys, h.capacity, 0 AS steps
    FROM held AS h CROSS JOIN ({served}) AS q
    CROSS JOIN LATERAL (
        SELECT w.priority, w.run_at, w.id, array_agg(w.ordering_key) OVER () AS keys
        FROM (
            SELECT CAST(j.ordering_key AS text) AS ordering_key, j.priority, j.run_at, j.id
            FROM {t} AS j WHERE {runnable("q.name")}
            ORDER BY j.priority, j.run_at, j.id LIMIT {int(rows)}
        ) AS w
        ORDER BY w.priority DESC, w.run_at DESC, w.id DESC LIMIT 1
    ) AS e
    UNION ALL
    SELECT w.queue, o.cont, o.ordering_key, o.key_limit, o.priority, o.run_at, o.id, o.keys,
        o.capacity, w.steps + 1
    FROM walk AS w CROSS JOIN LATERAL (
        WITH a AS MATERIALIZED (
            SELECT CAST(j.ordering_key AS text) AS ordering_key,
                coalesce(j.key_limit, 1) AS key_limit, j.priority, j.run_at, j.id
            FROM {t} AS j
            WHERE {runnable("w.queue")}
              AND (j.priority, j.run_at, j.id) > (w.priority, w.run_at, w.id)
            ORDER BY j.priority, j.run_at, j.id LIMIT {WALK_STEP_ROWS}
        ), fresh AS MATERIALIZED (
            SELECT DISTINCT ON (a.ordering_key) a.* FROM a
            WHERE NOT EXISTS (SELECT FROM unnest(w.keys) AS s (key) WHERE s.key = a.ordering_key)
            ORDER BY a.ordering_key, a.priority, a.run_at, a.id
        ), tried AS MATERIALIZED (
            SELECT t.*, CASE WHEN t.room > 0 AND t.ahead < :scan
                THEN {_key_lock(table, "t.ordering_key")}
                ELSE false END AS got
            FROM (
                SELECT r.*, w.capacity + sum(r.room) OVER (
                    ORDER BY r.priority, r.run_at, r.id ROWS UNBOUNDED PRECEDING
                ) - r.room AS ahead
                FROM (SELECT f.*, {room} AS room FROM fresh AS f) AS r
            ) AS t
        ), z AS (
            SELECT a.* FROM a ORDER BY a.priority DESC, a.run_at DESC, a.id DESC LIMIT 1
        )
        SELECT false AS cont, t.ordering_key, t.key_limit, t.priority, t.run_at, t.id,
            CAST(NULL AS text[]) AS keys, CAST(NULL AS bigint) AS capacity
        FROM tried AS t WHERE t.got
        UNION ALL
        SELECT true, NULL, 1, z.priority, z.run_at,
            CASE WHEN EXISTS (SELECT FROM fresh) THEN z.id ELSE greatest(z.id, (
                SELECT j.id FROM {t} AS j
                WHERE j.ordering_key = z.ordering_key AND j.status = '{pending}'
                  AND j.attempts = 0 AND j.priority = z.priority AND j.run_at = z.run_at
                  AND j.queue = w.queue
                ORDER BY j.id DESC LIMIT 1
            )) END,
            w.keys || coalesce((SELECT array_agg(f.ordering_key) FROM fresh AS f), '{{}}'),
            w.capacity + coalesce((SELECT sum(t.room) FROM tried AS t WHERE t.got), 0)
        FROM z
    ) AS o
    WHERE w.cont AND w.capacity < :scan AND w.steps < {WALK_STEPS}
), l AS (
    -- A key locked in two queues' walks counts once, at its best job.
    SELECT DISTINCT ON (w.ordering_key) w.ordering_key, w.key_limit, w.priority, w.run_at, w.id
    FROM walk AS w WHERE NOT w.cont
    ORDER BY w.ordering_key, w.priority, w.run_at, w.id
)
SELECT count(l.ordering_key) AS locked,
    set_config('{LOCKED_KEYS}', CAST(
        CASE WHEN :keep THEN coalesce({locked_keys}, '{{}}') ELSE '{{}}' END
        || coalesce(array_agg(l.ordering_key ORDER BY l.priority, l.run_at, l.id), '{{}}')
        AS text), true) AS keys,
    set_config('{LOCKED_KEY_LIMITS}', CAST(
        CASE WHEN :keep THEN coalesce({locked_limits}, '{{}}') ELSE '{{}}' END
        || coalesce(array_agg(l.key_limit ORDER BY l.priority, l.run_at, l.id), '{{}}')
        AS text), true) AS key_limits,
    (SELECT coalesce(bool_or(w.capacity >= :scan), false) FROM walk AS w WHERE w.cont)
        AS reached
FROM l"""
    params = [
        served_by,
        bindparam("scan", type_=Integer),
        bindparam("per_key", type_=Integer),
        bindparam("capacity", type_=Integer),
        bindparam("keep", type_=Boolean),
    ]
    return text(sql).bindparams(*params)


def _rate_params() -> list[BindParameter[Any]]:
    # The parameters of a rated keyed claim: the queues with per-key rate limits.
    return [
        bindparam("rate_queues", type_=ARRAY(Text)),
        bindparam("rate_limits", type_=ARRAY(Integer)),
        bindparam("rate_windows", type_=ARRAY(Float)),
    ]


@json_text_on_asyncpg
def claim_keyed(
    table: Table, *, limited: bool = False, rated: bool = False, json_text: bool = False
) -> Update:
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
    does not serve (another queue, or a paused one) or cannot lock keeps its place: no job
    behind it is taken instead. The chosen jobs of all keys are claimed best first,
    ``:limit`` at most.

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

    ``rated`` (per-key rate limits, :class:`~sqla_jobs.RateLimit` ``per_key``): a key of a
    queue in ``:rate_queues`` (with its ``:rate_limits`` and ``:rate_windows``, seconds)
    starts at most what its window still allows, its limit less the starts its row of the
    rate table logged in the window (:func:`~sqla_jobs._queries.rates.log_key_starts`, which
    the caller runs after this statement; its key's lock makes the count exact, as for the
    ``key_limit``).

    Parameters: ``:queue_names`` (an array), ``:limit``, ``:per_key``, ``:lease_seconds``,
    ``:worker`` (and ``:queue_name``, ``:queue_slots``; ``:rate_queues``, ``:rate_limits``,
    ``:rate_windows``).
    """
    t = qualified_name(table.name, table.schema)
    pending, running = JobStatus.PENDING.value, JobStatus.RUNNING.value
    columns = (
        "j.ctid AS row, j.id, j.ordering_key, j.queue, j.status, j.attempts, j.priority, "
        "j.run_at, j.lease_expires_at, j.key_limit"
    )
    now = "statement_timestamp()"
    allowance = ""
    rate_cte = ""
    if rated:
        # Each member key's room in its rate limit's window (keys of queues without one: none).
        rate_cte = f""", allowed AS MATERIALIZED (
    SELECT k.queue, k.ordering_key, q.lim - coalesce((
        SELECT sum(u.c) FROM {rate_table_name(table)} AS x, unnest(x.starts, x.counts) AS u (s, c)
        WHERE x.queue = k.queue AND x.key = k.ordering_key
          AND u.s > {now} - make_interval(secs => q.win)
    ), 0) AS room
    FROM (SELECT DISTINCT m.queue, m.ordering_key FROM member AS m) AS k
    JOIN unnest(CAST(:rate_queues AS text[]), CAST(:rate_limits AS integer[]),
                CAST(:rate_windows AS float8[])) AS q (name, lim, win) ON q.name = k.queue
)"""
        allowance = """
      AND r.place <= coalesce((SELECT a.room FROM allowed AS a
                               WHERE a.queue = r.queue AND a.ordering_key = r.ordering_key),
                              r.place)"""
    chosen = (
        text(
            f"""WITH member AS MATERIALIZED (
    SELECT m.*
    FROM unnest(
        {_handed_over("text[]")},
        {_handed_over("integer[]")}
    ) AS k (ordering_key, reads)
    CROSS JOIN LATERAL (
        (SELECT {columns} FROM {t} AS j
         WHERE {_after_new_jobs("k.ordering_key")})
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
){rate_cte}, staged AS (
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
      AND NOT {paused_predicate(table, "r.queue")}{allowance}
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
            *(_rate_params() if rated else []),
        )
        .columns(column("id", BigInteger), column("row"))
        .cte("claimable")
    )
    return _start_attempts(table, chosen, by_address=True, json_text=json_text)


# -- the queries --------------------------------------------------------------------------


class _KeyScan(TypedDict):
    scan: int
    per_key: int


class _Queue(TypedDict, total=False):
    # The queue: ``queue_name`` for a statement built with ``queue_count=1``, else
    # ``queue_names``.
    queue_name: str
    queue_names: list[str]


class LockKeysParams(_KeyScan, _Queue, total=False):
    """:func:`lock_keys`'s parameters (a limited queue's also ``limit`` and
    ``queue_slots``)."""

    limit: int
    queue_slots: int


class WalkKeysParams(_KeyScan, _Queue):
    """:func:`walk_keys`'s parameters."""

    capacity: int
    keep: bool


class _ClaimKeyedRequired(TypedDict):
    queue_names: list[str]
    limit: int
    per_key: int
    lease_seconds: float
    worker: str


class ClaimKeyedParams(_ClaimKeyedRequired, total=False):
    """:func:`claim_keyed`'s parameters (a limited queue's also ``queue_name`` and
    ``queue_slots``; a rated claim's ``rate_queues``, ``rate_limits``, ``rate_windows``)."""

    queue_name: str
    queue_slots: int
    rate_queues: list[str]
    rate_limits: list[int]
    rate_windows: list[float]


LOCK_KEYS: Final = Query(lock_keys, LockKeysParams, LockKeysRow)
WALK_KEYS: Final = Query(walk_keys, WalkKeysParams, WalkKeysRow)
CLAIM_KEYED: Final = Query(claim_keyed, ClaimKeyedParams, ClaimRow)
