"""Rate limits: the statements on a job table's rate table
(:func:`~sqla_jobs.schema.rates.rate_table`); see :mod:`sqla_jobs._queries`.

A claim that serves a rate-limited queue runs three of its own around its claim statements,
in the claim's transaction, in this order (:func:`~sqla_jobs._queries.claiming.claim_rows`):
:func:`lock_rates` (one claimer per queue at a time), :func:`rate_allowances` (how many the
window still allows), and after the claim :func:`log_starts` (what it started). The order
is part of the rule, which :func:`log_starts` states.
"""

from __future__ import annotations

from typing import Final, NamedTuple, TypedDict

from sqlalchemy import BigInteger, Float, Integer, Table, Text, TextClause, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY

from sqla_jobs._queries.claims import LockedQueueRow, QueueNamesParams, _lock_space
from sqla_jobs._queries.run import NoParams, Query
from sqla_jobs.ddl import qualified_name
from sqla_jobs.schema.rates import rate_table_name

__all__ = [
    "LOCK_RATES",
    "LOG_KEY_STARTS",
    "LOG_STARTS",
    "PRUNE_RATES",
    "RATE_ALLOWANCES",
    "RATE_TABLE_EXISTS",
    "RATE_USAGE",
    "AllowanceRow",
    "ExistsRow",
    "LogKeyStartsParams",
    "LogStartsParams",
    "RateParams",
    "RateUsageRow",
    "lock_rates",
    "log_key_starts",
    "log_starts",
    "prune_rates",
    "rate_allowances",
    "rate_lock_space",
    "rate_table_exists",
    "rate_usage",
]


_rates = rate_table_name


def rate_lock_space(table: Table) -> int:
    """The first half of every rate lock's id for this table (``<qualified name>#rates``):
    apart from the queue limits' locks, so that a queue with both takes both."""
    return _lock_space(qualified_name(table.name, table.schema) + "#rates")


def lock_rates(table: Table) -> TextClause:
    """Lock the rate-limited queues of ``:queue_names`` for this transaction; returns the
    names locked, in the order given: ``pg_try_advisory_xact_lock(<rate lock space>,
    hashtext(queue))``, so a queue another claim is rating is skipped this round, never
    waited for. A statement of its own, before :func:`rate_allowances`: that one then
    starts after the lock was granted, and sees the starts the queue's previous holder
    committed. Reads no table. Parameter: ``:queue_names`` (an array)."""
    return text(
        f"""SELECT q.name
FROM unnest(CAST(:queue_names AS text[])) WITH ORDINALITY AS q (name, n)
WHERE pg_try_advisory_xact_lock({rate_lock_space(table)}, hashtext(q.name))
ORDER BY q.n"""
    ).bindparams(bindparam("queue_names", type_=ARRAY(Text)))


def rate_allowances(table: Table) -> TextClause:
    """For each queue of ``:queue_names`` (with its ``:limits`` and ``:windows``, in
    seconds; arrays of the same length), how many attempts its window still allows now
    (``allowance``: its limit less the attempts its row logged in the last window, by the
    database's clock) and in how many seconds the oldest of those leaves the window
    (``free_in``, NULL when none is logged). The queues' rate locks must be held
    (:func:`lock_rates`). Reads each queue's row of the rate table by its primary key."""
    return text(
        f"""SELECT q.name,
    greatest(0, q.lim - coalesce(w.used, 0))::integer AS allowance,
    date_part('epoch', w.oldest + make_interval(secs => q.win) - statement_timestamp())
        AS free_in
FROM unnest(CAST(:queue_names AS text[]), CAST(:limits AS integer[]),
            CAST(:windows AS float8[])) WITH ORDINALITY AS q (name, lim, win, n)
LEFT JOIN LATERAL (
    SELECT sum(u.c)::integer AS used, min(u.s) AS oldest
    FROM {_rates(table)} AS r, unnest(r.starts, r.counts) AS u (s, c)
    WHERE r.queue = q.name AND r.key = ''
      AND u.s > statement_timestamp() - make_interval(secs => q.win)
) AS w ON true
ORDER BY q.n"""
    ).bindparams(
        bindparam("queue_names", type_=ARRAY(Text)),
        bindparam("limits", type_=ARRAY(Integer)),
        bindparam("windows", type_=ARRAY(Float)),
    )


# The upsert of a logged row (``AS r``) that both logs share: the new row's limit and window
# (``excluded``) replace the old, its start is appended, and what left its window is dropped.
_APPEND_AND_PRUNE: Final = """ON CONFLICT (queue, key) DO UPDATE SET
    rate_limit = excluded.rate_limit, window_seconds = excluded.window_seconds,
    (starts, counts) = (
    SELECT coalesce(array_agg(u.s ORDER BY u.s), '{}'),
           coalesce(array_agg(u.c ORDER BY u.s), '{}')
    FROM unnest(r.starts || excluded.starts, r.counts || excluded.counts) AS u (s, c)
    WHERE u.s > statement_timestamp() - make_interval(secs => excluded.window_seconds)
)"""


def log_starts(table: Table) -> TextClause:
    """Log that this claim started ``:started`` attempts of the rate-limited queue
    ``:queue_name``, at this statement's time, and drop what left the window of
    ``:window`` seconds: the queue's row of the rate table, made on its first use.

    The rule a rate limit holds: in any window of its length, the attempts started (each at
    its claim's ``statement_timestamp()``, its ``attempted_at``) number at most its limit.
    It holds because claimers of a queue take turns (:func:`lock_rates`), each one's
    :func:`rate_allowances` starts after the previous one committed its log, and a log entry
    is never earlier than the starts it counts (this statement runs after the claim's):
    so the last claimer to start attempts in any window counted every other start in it,
    and started no more than the limit left. An entry is dropped only once it is a window
    old by a later claimer's clock, when no later claimer would have counted it.
    """
    return text(
        f"""INSERT INTO {_rates(table)} AS r
    (queue, key, starts, counts, rate_limit, window_seconds)
VALUES (:queue_name, '', ARRAY[statement_timestamp()], ARRAY[CAST(:started AS integer)],
        CAST(:rate_limit AS integer), CAST(:window AS float8))
{_APPEND_AND_PRUNE}"""
    ).bindparams(
        bindparam("queue_name", type_=Text),
        bindparam("started", type_=Integer),
        bindparam("rate_limit", type_=Integer),
        bindparam("window", type_=Float),
    )


def log_key_starts(table: Table) -> TextClause:
    """Log the attempts a keyed claim with per-key rate limits started (the jobs
    ``:job_ids``), per queue and ordering key, for the queues of ``:rate_queues`` (with their
    windows, ``:rate_windows``, seconds), at this statement's time, and drop what left each
    key's window: the key's row of the rate table, made on its first use.

    The rule of :func:`log_starts`, per key: the key's lock (taken before the keyed claim,
    :func:`~sqla_jobs._queries.lock_keys`) makes its claimers take turns, the keyed claim
    (:func:`~sqla_jobs._queries.claim_keyed` ``rated``) counts the key's window after that
    lock was granted, and this statement runs after it, before the claim commits (and
    before another keyed claim of the same transaction). Reads the jobs by primary key."""
    t = qualified_name(table.name, table.schema)
    return text(
        f"""INSERT INTO {_rates(table)} AS r
    (queue, key, starts, counts, rate_limit, window_seconds)
SELECT j.queue, j.ordering_key, ARRAY[statement_timestamp()], ARRAY[count(*)::integer],
    min(q.lim), min(q.win)
FROM {t} AS j
JOIN unnest(CAST(:rate_queues AS text[]), CAST(:rate_limits AS integer[]),
            CAST(:rate_windows AS float8[])) AS q (name, lim, win) ON q.name = j.queue
WHERE j.id = ANY (CAST(:job_ids AS bigint[])) AND j.ordering_key IS NOT NULL
GROUP BY j.queue, j.ordering_key
ORDER BY j.queue, j.ordering_key
{_APPEND_AND_PRUNE}"""
    ).bindparams(
        bindparam("job_ids", type_=ARRAY(BigInteger)),
        bindparam("rate_queues", type_=ARRAY(Text)),
        bindparam("rate_limits", type_=ARRAY(Integer)),
        bindparam("rate_windows", type_=ARRAY(Float)),
    )


def rate_usage(table: Table) -> TextClause:
    """Each rate-limited queue's window now, from the rate table: ``queue``, ``limit`` and
    ``window_seconds`` (as the last claim that logged there had them), ``started`` (the
    attempts its queue-wide window holds now, by the database's clock; NULL for a per-key
    limit), ``keys`` (the ordering keys with starts in their windows) and ``full_keys`` (those
    whose windows are full: their jobs wait). One row per queue; reads the whole rate table
    (a row per rate-limited queue, and per key of a per-key limit)."""
    return text(
        f"""SELECT r.queue, max(r.rate_limit) AS rate_limit,
    max(r.window_seconds) AS window_seconds,
    sum(w.started) FILTER (WHERE r.key = '')::integer AS started,
    count(*) FILTER (WHERE r.key <> '' AND w.started > 0)::integer AS keys,
    count(*) FILTER (WHERE r.key <> '' AND w.started >= r.rate_limit)::integer AS full_keys
FROM {_rates(table)} AS r
CROSS JOIN LATERAL (
    SELECT coalesce(sum(u.c), 0) AS started
    FROM unnest(r.starts, r.counts) AS u (s, c)
    WHERE u.s > statement_timestamp() - make_interval(secs => r.window_seconds)
) AS w
WHERE r.rate_limit IS NOT NULL
GROUP BY r.queue
ORDER BY r.queue"""
    )


def prune_rates(table: Table) -> TextClause:
    """Delete up to ``:limit`` rows of the rate table whose windows hold no start (an idle
    queue's, or an ordering key's that has not started a job for a window): a limit per key
    leaves a row per key it ever saw. Rows another transaction holds (a claim logging) are
    skipped. Safe beside claims: a row goes only once everything in it is out of its window,
    which no later claim would count, and a claim's log makes it again."""
    return text(
        f"""DELETE FROM {_rates(table)} AS r
WHERE r.ctid IN (
    SELECT x.ctid FROM {_rates(table)} AS x
    WHERE NOT EXISTS (
        SELECT FROM unnest(x.starts) AS s
        WHERE s > statement_timestamp() - make_interval(secs => coalesce(x.window_seconds, 0))
    )
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)"""
    ).bindparams(bindparam("limit", type_=Integer))


class PruneRatesParams(TypedDict):
    limit: int


def rate_table_exists(table: Table) -> TextClause:
    """Whether ``table`` has its rate table (optional: made where rate limits are used).
    ``to_regclass`` takes no lock. The name is bound into the statement."""
    return text("SELECT to_regclass(:rate_table) IS NOT NULL AS exists").bindparams(
        bindparam("rate_table", _rates(table), type_=Text)
    )


class ExistsRow(NamedTuple):
    exists: bool


class RateUsageRow(NamedTuple):
    """A rate-limited queue's window now (:func:`rate_usage`)."""

    queue: str
    rate_limit: int
    window_seconds: float
    started: int | None
    keys: int
    full_keys: int


class LogKeyStartsParams(TypedDict):
    job_ids: list[int]
    rate_queues: list[str]
    rate_limits: list[int]
    rate_windows: list[float]


class RateParams(TypedDict):
    """The rate-limited queues, their limits and windows (seconds), in one order."""

    queue_names: list[str]
    limits: list[int]
    windows: list[float]


class AllowanceRow(NamedTuple):
    """A queue of :func:`rate_allowances`."""

    name: str
    allowance: int
    free_in: float | None


class LogStartsParams(TypedDict):
    queue_name: str
    started: int
    rate_limit: int
    window: float


LOCK_RATES: Final = Query(lock_rates, QueueNamesParams, LockedQueueRow)
RATE_ALLOWANCES: Final = Query(rate_allowances, RateParams, AllowanceRow)
LOG_STARTS: Final[Query[LogStartsParams, tuple[()]]] = Query(log_starts, LogStartsParams)
RATE_USAGE: Final = Query(rate_usage, NoParams, RateUsageRow)
RATE_TABLE_EXISTS: Final = Query(rate_table_exists, NoParams, ExistsRow)
PRUNE_RATES: Final[Query[PruneRatesParams, tuple[()]]] = Query(prune_rates, PruneRatesParams)
LOG_KEY_STARTS: Final[Query[LogKeyStartsParams, tuple[()]]] = Query(
    log_key_starts, LogKeyStartsParams
)
