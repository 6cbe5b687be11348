"""One claim, statement by statement: which claim statements run, in which order, with which
parameters (see :func:`sqla_jobs.queue.claim` for what a claim does).

A claim is one statement (:data:`~sqla_jobs._queries.claims.CLAIM`) unless it serves
ordering keys or limited queues. Then its statements hand state to each other inside the
caller's transaction (the keys :func:`~sqla_jobs._queries.keyed.lock_keys` locked, in
:data:`~sqla_jobs._queries.keyed.LOCKED_KEYS`, are the ones the keyed claim claims from;
a limited queue's lock is taken before the statement that counts its free slots starts), so
their order is part of their SQL's contract, and it lives here, beside them, not with the
argument checks above the layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from sqlalchemy import Table

from sqla_jobs._queries.claims import CLAIM, LOCK_QUEUES, ClaimParams
from sqla_jobs._queries.fair import CLAIM_FAIR, FAIR_TENANTS, ClaimFairParams, FairTenantsParams
from sqla_jobs._queries.keyed import (
    CLAIM_KEYED,
    LOCK_KEYS,
    WALK_KEYS,
    ClaimKeyedParams,
    LockKeysParams,
    WalkKeysParams,
)
from sqla_jobs._queries.rates import (
    LOCK_RATES,
    LOG_KEY_STARTS,
    LOG_STARTS,
    RATE_ALLOWANCES,
    LogKeyStartsParams,
    LogStartsParams,
)
from sqla_jobs._queries.rows import ClaimRow, LockKeysRow, WalkKeysRow
from sqla_jobs._queries.run import Executor
from sqla_jobs.schema import JobStatus
from sqla_jobs.validation import FairShare

__all__ = [
    "KEY_CLAIM_MAX",
    "KEY_SCAN_EXTRA",
    "RATE_RETRY",
    "ClaimedRows",
    "claim_rows",
    "key_lock_params",
]

#: How many keyed jobs per queue (and keys in all) a keyed claim of ``limit`` jobs looks at,
#: beyond ``limit``: a few keys in line may be busy (their jobs in progress fill their
#: limits), so it looks a little further. Each key looked at costs the claim two reads of the
#: key index, so the margin is small: more busy keys than that make the claim come back
#: short, and then it walks on past them (:func:`~sqla_jobs._queries.walk_keys`) once.
KEY_SCAN_EXTRA: Final = 4
#: The most jobs of one key a keyed claim starts (a key whose ``key_limit`` is higher gets
#: the rest in the next claims): each costs the claim a read of the job's row.
KEY_CLAIM_MAX: Final = 16
#: How soon (seconds) a rate-limited queue that another claim was rating may be tried again:
#: that claim holds the queue's rate lock for one short transaction.
RATE_RETRY: Final = 0.01
#: How soon, as a fraction of its window, a keyed claim with per-key rate limits that came
#: back short looks again: its keys' windows free one start at a time.
KEY_RATE_POLL: Final = 0.02

_ID: Final = ClaimRow._fields.index("id")
_STATUS: Final = ClaimRow._fields.index("status")
_RUNNING: Final = JobStatus.RUNNING.value


class ClaimedRows(NamedTuple):
    """What one claim got: its ``rows``, and ``wait``: when it held a rate-limited queue back
    (its window full, or another claim rating it at that moment), the seconds after which
    that queue may allow more (None otherwise)."""

    rows: list[Any]
    wait: float | None


def claim_rows(
    executor: Executor,
    table: Table,
    *,
    queue_names: list[str],
    limit: int,
    lease_seconds: float,
    worker: str,
    keys: bool,
    limited: dict[str, int],
    rated: dict[str, tuple[int, float]] | None = None,
    key_rated: dict[str, tuple[int, float]] | None = None,
    fair: dict[str, FairShare] | None = None,
) -> ClaimedRows:
    """The rows of one claim (:class:`~sqla_jobs._queries.rows.ClaimRow`'s columns, as
    tuples): the rate-limited queues' first (``rated``: queue name to its limit and window
    in seconds), each up to what its window allows, then the limited queues', each up to its
    free slots (``limited``: queue name to limit), then the other queues' up to ``limit``;
    keyed jobs first in each (``keys``), then plain ones. Arguments checked by the caller.

    A rate-limited queue is claimed from under its rate lock, after reading its allowance,
    and what the claim started is logged after it (:mod:`sqla_jobs._queries.rates`, whose
    :func:`~sqla_jobs._queries.rates.log_starts` states the rule); a queue another claim is
    rating is skipped this round. ``key_rated`` (queue name to limit and window): each
    ordering key of the queue has its own window, counted by the keyed claim under the key's
    lock and logged after it (:func:`~sqla_jobs._queries.rates.log_key_starts`). ``fair``
    (queue name to its :class:`~sqla_jobs.FairShare`): the queue's jobs without a key are
    claimed by the fair claim (:func:`_claim_fair`) instead of the plain one."""
    rows: list[Any] = []
    wait: float | None = None
    rated_here = [name for name in queue_names if rated and name in rated]
    if rated and rated_here:
        locked = [row[0] for row in LOCK_RATES.tuples(executor, table, {"queue_names": rated_here})]
        if len(locked) < len(rated_here):
            wait = RATE_RETRY  # another claim is rating a queue: it is done in a moment
        allowances = (
            RATE_ALLOWANCES.rows(
                executor,
                table,
                {
                    "queue_names": locked,
                    "limits": [rated[name][0] for name in locked],
                    "windows": [rated[name][1] for name in locked],
                },
            )
            if locked
            else []
        )
        for allowed in allowances:
            name, allowance = allowed.name, allowed.allowance
            got: list[Any] = []
            if allowance > 0 and len(rows) < limit:
                got = claim_rows(
                    executor,
                    table,
                    queue_names=[name],
                    limit=min(limit - len(rows), allowance),
                    lease_seconds=lease_seconds,
                    worker=worker,
                    keys=keys,
                    limited={name: limited[name]} if name in limited else {},
                    key_rated=key_rated,
                    fair=fair,
                ).rows
                started = sum(1 for row in got if row[_STATUS] == _RUNNING)
                if started:
                    log: LogStartsParams = {
                        "queue_name": name,
                        "started": started,
                        "rate_limit": rated[name][0],
                        "window": rated[name][1],
                    }
                    LOG_STARTS.result(executor, table, log)
                rows.extend(got)
            if len(got) >= allowance:
                # Its window is full: it allows more once its oldest start leaves it (this
                # claim's, a window from now, when it logged none before).
                oldest = allowed.free_in
                free_in = rated[name][1] if oldest is None else max(oldest, 0.0)
                wait = free_in if wait is None else min(wait, free_in)
        queue_names = [name for name in queue_names if name not in rated]
        if not queue_names or len(rows) >= limit:
            return ClaimedRows(rows, wait)
        limit -= len(rows)
    keyed_rates = _KeyRates.of(key_rated, queue_names) if keys else None
    got = _claim_limited(
        executor, table, queue_names, limit, lease_seconds, worker, keys, limited, key_rated, fair
    )
    rows.extend(got)
    if keyed_rates is not None and len(got) < limit:
        # Keys held back by their windows free as their starts age: look again soon (a
        # fraction of the shortest window), not at the next poll.
        soon = max(KEY_RATE_POLL * min(keyed_rates.windows), RATE_RETRY)
        wait = soon if wait is None else min(wait, soon)
    if fair and got and len(got) < limit and any(name in fair for name in queue_names):
        # A fair claim comes back short when tenants had fewer jobs than their shares, while
        # others may have more: look again at once (an empty claim waits as any other).
        wait = 0.0
    return ClaimedRows(rows, wait)


@dataclass(frozen=True)
class _KeyRates:
    """The per-key rate limits of the queues a keyed claim serves: the rated keyed claim's
    parameters (:func:`~sqla_jobs._queries.claim_keyed` ``rated``)."""

    queues: list[str]
    limits: list[int]
    windows: list[float]

    @classmethod
    def of(
        cls, key_rated: dict[str, tuple[int, float]] | None, queue_names: list[str]
    ) -> _KeyRates | None:
        """The limits of ``key_rated`` (queue name to limit and window) that a claim of
        ``queue_names`` serves; None when it serves none."""
        served = [name for name in queue_names if name in (key_rated or {})]
        if not key_rated or not served:
            return None
        return cls(
            served, [key_rated[name][0] for name in served], [key_rated[name][1] for name in served]
        )


def _claim_limited(
    executor: Executor,
    table: Table,
    queue_names: list[str],
    limit: int,
    lease_seconds: float,
    worker: str,
    keys: bool,
    limited: dict[str, int],
    key_rated: dict[str, tuple[int, float]] | None = None,
    fair: dict[str, FairShare] | None = None,
) -> list[Any]:
    # The limited queues' rows first, each up to its free slots, then the others'.
    params: ClaimParams = {"limit": limit, "lease_seconds": lease_seconds, "worker": worker}
    if not limited:
        return _claim_from(
            executor, table, params, queue_names, keys, key_rated=key_rated, fair=fair
        )
    rows: list[Any] = []
    # A keyed claim takes each queue's lock with its keys; a plain one all of them at once.
    served = list(limited)
    if not keys:
        locked = LOCK_QUEUES.tuples(executor, table, {"queue_names": served})
        served = [row[0] for row in locked]
    for name in served:
        if len(rows) < limit:
            room = params | {"limit": limit - len(rows), "queue_slots": limited[name]}
            rows.extend(
                _claim_from(
                    executor,
                    table,
                    room,
                    [name],
                    keys,
                    limited=True,
                    key_rated=key_rated,
                    fair=fair,
                )
            )
    others = [name for name in queue_names if name not in limited]
    if others and len(rows) < limit:
        rest = params | {"limit": limit - len(rows)}
        rows.extend(
            _claim_from(executor, table, rest, others, keys, key_rated=key_rated, fair=fair)
        )
    return rows


def key_lock_params(queue_names: list[str], limit: int) -> tuple[LockKeysParams, dict[str, Any]]:
    """:func:`~sqla_jobs._queries.lock_keys`'s parameters for a keyed claim of ``limit``
    jobs, and its build options: the rows it reads per queue, ``limit + KEY_SCAN_EXTRA``
    rounded up (part of the SQL text, so that the statement is planned once, see
    :func:`~sqla_jobs._queries.lock_keys`; rounded to a multiple of 16, or of an eighth of
    the next power of two past 128, so that a worker's varying claim sizes make a few
    statements, 8 per doubling at most, and each reads at most an eighth more rows than it
    needs), and the queue count (1, or 2 for several)."""
    scan = limit + KEY_SCAN_EXTRA
    params: LockKeysParams = {"scan": scan, "per_key": min(limit, KEY_CLAIM_MAX)}
    _set_queues(params, queue_names)
    step = max(16, (1 << (scan - 1).bit_length()) // 8)
    rows = -(-scan // step) * step
    return params, {"rows": rows, "queue_count": min(len(queue_names), 2)}


def _set_queues(params: ClaimParams | LockKeysParams | WalkKeysParams, names: list[str]) -> None:
    # The claim statements' queue: a scalar for one (statements built with queue_count=1),
    # else an array.
    if len(names) == 1:
        params["queue_name"] = names[0]
    else:
        params["queue_names"] = names


def _claim_from(
    executor: Executor,
    table: Table,
    params: ClaimParams,
    queue_names: list[str],
    keys: bool,
    limited: bool = False,
    key_rated: dict[str, tuple[int, float]] | None = None,
    fair: dict[str, FairShare] | None = None,
) -> list[Any]:
    """The rows of a claim from ``queue_names``: keyed jobs first (``keys``), then plain
    ones up to the limit (:func:`_claim_plain`: fairly, for the queues in ``fair``).
    ``limited``: one queue with a concurrency limit (``params["queue_slots"]``), whose lock
    this transaction holds (a plain claim), or takes with its keys (a keyed claim: nothing
    if another claim holds it); each claim statement counts the free slots
    (:func:`~sqla_jobs._queries.limited_count`). ``key_rated``: per-key rate limits, kept
    by each keyed claim statement and logged after it (:func:`_claim_keyed`)."""
    params = params.copy()
    params.pop("queue_name", None)
    params.pop("queue_names", None)
    _set_queues(params, queue_names)
    if not keys:
        return _claim_plain(executor, table, params, queue_names, limited, fair)
    limit = params["limit"]
    serving = _KeyRates.of(key_rated, queue_names)
    lock_params, lock_options = key_lock_params(queue_names, limit)
    if limited:
        lock_params |= {"limit": limit, "queue_slots": params["queue_slots"]}
        lock_options["limited"] = True
    # The keys locked go from the first statement to the claim inside the transaction
    # (lock_keys): of its one row, only the count, the jobs its keys could start, whether a
    # queue had more in line, and a limited queue's free slots are read here.
    (row,) = LOCK_KEYS.tuples(executor, table, lock_params, **lock_options)
    locked = LockKeysRow(*row)  # its free slots only when limited
    count, capacity, full = locked.locked, locked.capacity, locked.full
    if limited:
        # The queue's free slots, a hint (the claims count exactly): none, or its lock is
        # another claim's (NULL; then no key was locked either); fewer than the limit, and
        # the claims ask for no more.
        limit = min(limit, locked.free or 0)
        if limit <= 0:
            return []
    keyed: ClaimKeyedParams = {
        "queue_names": queue_names,
        "limit": limit,
        "per_key": lock_params["per_key"],
        "lease_seconds": params["lease_seconds"],
        "worker": params["worker"],
    }
    if limited:
        keyed |= {"queue_name": queue_names[0], "queue_slots": params["queue_slots"]}
    walk: WalkKeysParams = {
        "scan": lock_params["scan"],
        "per_key": lock_params["per_key"],
        "capacity": 0,
        "keep": True,
    }
    _set_queues(walk, queue_names)
    walk_options = {"rows": lock_options["rows"], "queue_count": lock_options["queue_count"]}
    walked = full and capacity < walk["scan"]
    further = full  # whether keys that could start a job may wait further along the line
    if walked:
        # The jobs in line belonged to too few keys (a burst of one): look further, and
        # claim from these keys and those together.
        walk |= {"capacity": capacity, "keep": True}
        (row,) = WALK_KEYS.tuples(executor, table, walk, **walk_options)
        found = WalkKeysRow._make(row)
        count += found.locked
        further = found.reached  # it stopped at enough keys, not at the end of what it sees
    rows: list[Any] = []
    if count:
        rows.extend(_claim_keyed(executor, table, keyed, limited, serving))
    if further and len(rows) < limit:
        # The keys locked were busy (their jobs in progress fill their limits): look
        # further once, past the keys that are busy too, and claim from the keys found alone.
        walk |= {"capacity": len(rows), "keep": False}
        busy = walk_options | {"busy": True}
        (row,) = WALK_KEYS.tuples(executor, table, walk, **busy)
        if WalkKeysRow._make(row).locked:
            # (A limited queue's free slots are counted anew: what this claim took counts.)
            more = keyed | {"limit": limit - len(rows)}
            rows.extend(_claim_keyed(executor, table, more, limited, serving))
    if len(rows) < limit:
        rest = params | {"limit": limit - len(rows)}
        rows.extend(_claim_plain(executor, table, rest, queue_names, limited, fair))
    return rows


def _claim_plain(
    executor: Executor,
    table: Table,
    params: ClaimParams,
    queue_names: list[str],
    limited: bool,
    fair: dict[str, FairShare] | None,
) -> list[Any]:
    """The jobs without a key of ``queue_names``, up to ``params["limit"]``: the fair queues'
    first, each by its fair claim (:func:`_claim_fair`), then the others' with one plain
    claim statement (:data:`~sqla_jobs._queries.claims.CLAIM`; the only statement when none
    is fair). ``params`` name the queues already (:func:`_set_queues`)."""
    options = {"queue_count": min(len(queue_names), 2), "limited": limited}
    shared = [name for name in queue_names if name in fair] if fair else None
    if not shared:
        return list(CLAIM.tuples(executor, table, params, **options))
    rows: list[Any] = []
    limit = params["limit"]
    for name in shared:
        if fair and len(rows) < limit:
            rows.extend(_claim_fair(executor, table, params, name, fair[name], limited))
    others = [name for name in queue_names if name not in shared]
    if others and len(rows) < limit:
        rest = params | {"limit": limit - len(rows)}
        rest.pop("queue_name", None)
        rest.pop("queue_names", None)
        _set_queues(rest, others)
        options["queue_count"] = min(len(others), 2)
        rows.extend(CLAIM.tuples(executor, table, rest, **options))
    return rows


@dataclass
class Ring:
    """Where a fair queue's ring of tenants (:func:`~sqla_jobs._queries.fair_tenants`) was
    left off in this process: ``mode`` and ``after``, the last tenant its latest fair claim
    served or passed (mode 2; mode 1: the NULL tenant; 0: none yet), where the next one
    starts; and ``alone_until`` (the process's monotonic clock), until when its claims are
    plain ones (:data:`FAIR_ALONE`)."""

    mode: int = 0
    after: Any = None
    alone_until: float = 0.0


#: The rings of the fair queues, per job table, queue and tenant column. One per process,
#: shared by its claimers (threads, connections, pooled or not), so that they go round the
#: tenants together; each process goes round on its own.
FAIR_RINGS: Final[dict[tuple[Table, str, str], Ring]] = {}
#: How many tenants with no job due one fair claim passes at most, beyond those it serves.
FAIR_PASS: Final = 64
#: How long (seconds) the fair claims of a queue whose ring held one due tenant are plain
#: claims without looking at the ring again, as long as that tenant fills them: while one
#: tenant has the queue to itself, the ring costs a statement per claim and changes
#: nothing. A tenant whose jobs arrive meanwhile has its first turn at most this much later;
#: a claim that comes back short (the tenant has run out) ends it at once. (A bound kept by the
#: process's monotonic clock: it is a cache's, not a schedule; no job's time is compared
#: with it.)
FAIR_ALONE: Final = 0.1


def _claim_fair(
    executor: Executor,
    table: Table,
    params: ClaimParams,
    name: str,
    share: FairShare,
    limited: bool,
) -> list[Any]:
    """A fair claim of the queue ``name`` (:mod:`sqla_jobs._queries.fair`): the tenants with
    a job due, in turn round the ring from where the process's previous fair claim of the
    queue stopped (its :class:`Ring`, :data:`FAIR_RINGS`), as many as fit in ``limit`` by
    their weights (each then has its whole first round in the claim, as far as it has
    jobs); then the claim from them. The ring moves on past the tenants served and those
    passed before them (no job due), never past a tenant found but left for the next
    claim: with more tenants than fit in one claim, every one has its turn."""
    limit = params["limit"]
    options = {"column": share.column}
    ring = FAIR_RINGS.setdefault((table, name, share.column), Ring())
    if ring.alone_until > time.monotonic():
        alone = _claim_one_queue(executor, table, params, name, limited)
        if len(alone) < limit:
            ring.alone_until = 0.0  # the tenant ran short: the next claim looks at the ring
        return alone
    scan: FairTenantsParams = {
        "queue_name": name,
        "after": ring.after,
        "mode": ring.mode,
        "most": limit,
        "cap": limit + FAIR_PASS,
    }
    rows = FAIR_TENANTS.tuples(executor, table, scan, **options)
    tenants: list[Any] = []
    weights: list[int] = []
    passed = spent = 0
    for tenant, due in rows:
        if due:
            weight = share.weight(tenant)
            if tenants and spent + weight > limit:
                break
            tenants.append(tenant)
            weights.append(weight)
            spent += weight
        passed += 1
    if passed:
        last = rows[passed - 1][0]
        ring.mode, ring.after = (1, None) if last is None else (2, last)
    whole = len(rows) < scan["cap"] and sum(1 for row in rows if row[1]) < limit
    if whole and len(tenants) < 2:
        # The ring holds one tenant with a job due, or none: the plain claim takes the same
        # jobs (in claim order, the expired leases too) with one statement, planned faster;
        # and so do the next claims for a moment (FAIR_ALONE).
        got = _claim_one_queue(executor, table, params, name, limited)
        ring.alone_until = time.monotonic() + FAIR_ALONE if len(got) == limit else 0.0
        return got
    claim: ClaimFairParams = {
        "queue_name": name,
        "tenants": tenants,
        "weights": weights,
        "limit": limit,
        "lease_seconds": params["lease_seconds"],
        "worker": params["worker"],
    }
    if limited:
        claim["queue_slots"] = params["queue_slots"]
    return list(CLAIM_FAIR.tuples(executor, table, claim, limited=limited, **options))


def _claim_one_queue(
    executor: Executor, table: Table, params: ClaimParams, name: str, limited: bool
) -> list[Any]:
    # The plain claim statement on the one queue ``name``.
    one: ClaimParams = {
        "limit": params["limit"],
        "lease_seconds": params["lease_seconds"],
        "worker": params["worker"],
        "queue_name": name,
    }
    if limited:
        one["queue_slots"] = params["queue_slots"]
    return list(CLAIM.tuples(executor, table, one, queue_count=1, limited=limited))


def _claim_keyed(
    executor: Executor,
    table: Table,
    params: ClaimKeyedParams,
    limited: bool,
    rates: _KeyRates | None,
) -> list[Any]:
    """One keyed claim statement; with per-key rate limits (``rates``), the rated one, and
    then its starts logged per key before anything else of the claim runs (the rule of
    :func:`~sqla_jobs._queries.rates.log_key_starts`)."""
    if rates is None:
        return list(CLAIM_KEYED.tuples(executor, table, params, limited=limited))
    rated: ClaimKeyedParams = params | {
        "rate_queues": rates.queues,
        "rate_limits": rates.limits,
        "rate_windows": rates.windows,
    }
    rows = list(CLAIM_KEYED.tuples(executor, table, rated, limited=limited, rated=True))
    started = [row[_ID] for row in rows if row[_STATUS] == _RUNNING]
    if started:
        log: LogKeyStartsParams = {
            "job_ids": started,
            "rate_queues": rates.queues,
            "rate_limits": rates.limits,
            "rate_windows": rates.windows,
        }
        LOG_KEY_STARTS.result(executor, table, log)
    return rows
