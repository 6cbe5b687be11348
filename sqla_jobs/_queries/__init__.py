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

The builders live in seven modules, all re-exported here: :mod:`.enqueueing` (enqueue,
unique and debounced enqueue, periodic slots), :mod:`.claims` (the plain claim, the limited
claim of queue limits), :mod:`.rates` (the rate table of rate limits), :mod:`.fair` (the
fair claim of fair shares: the tenants in turn, the claim, their depths), :mod:`.keyed` (the
keyed claim of ordering keys: lock, walk, claim), :mod:`.outcomes` (what an attempt and a job
become: lock, complete, fail, heartbeat, release, retry, cancel, delete) and :mod:`.admin`
(status, pruning, vacuum, statistics, a replica's lag, the worker's runtime). What they share
(status literals, the database's clock, the fence of an attempt) is in :mod:`._sql`.
"""

from __future__ import annotations

from sqla_jobs._queries.admin import (
    WORKER_SETTINGS,
    backend_transaction,
    dead_jobs,
    dead_rows,
    listen,
    oldest_xmin,
    ping,
    prune,
    queue_stats,
    replica_lag,
    reset_setting,
    set_setting,
    statement_timeout,
    status_of,
    table_layout,
    table_stats,
    table_valued_activity,
    terminate_transactions,
    transaction_isolation,
    vacuum,
    wakeup_trigger_exists,
)
from sqla_jobs._queries.claims import (
    claim,
    limited_count,
    lock_queues,
    queue_lock_space,
)
from sqla_jobs._queries.enqueueing import (
    CONTEXT_COLUMNS,
    CONTROL_COLUMNS,
    CONTROL_INPUTS,
    ENQUEUE_COLUMNS,
    MANAGED_COLUMNS,
    ORDERING_COLUMNS,
    UNIQUE_COLUMNS,
    database_now,
    enqueue_columns,
    enqueue_debounced,
    enqueue_many,
    enqueue_unique,
    schedule_advance,
    schedule_create,
)
from sqla_jobs._queries.fair import claim_fair, fair_tenants, tenant_depths
from sqla_jobs._queries.keyed import (
    LOCKED_KEY_LIMITS,
    LOCKED_KEYS,
    WALK_STEP_ROWS,
    WALK_STEPS,
    claim_keyed,
    key_lock_space,
    lock_keys,
    walk_keys,
)
from sqla_jobs._queries.outcomes import (
    CANCEL_PAYLOAD_PREFIX,
    cancel,
    cancel_attempts,
    cancel_requests,
    complete,
    complete_and_delete,
    complete_held,
    delete_job,
    fail,
    heartbeat,
    lock,
    own_columns,
    release,
    request_cancel,
    retry,
    store_results,
)
from sqla_jobs._queries.rates import (
    lock_rates,
    log_key_starts,
    log_starts,
    rate_allowances,
    rate_lock_space,
)

__all__ = [
    "CANCEL_PAYLOAD_PREFIX",
    "CONTEXT_COLUMNS",
    "CONTROL_COLUMNS",
    "CONTROL_INPUTS",
    "ENQUEUE_COLUMNS",
    "LOCKED_KEYS",
    "LOCKED_KEY_LIMITS",
    "MANAGED_COLUMNS",
    "ORDERING_COLUMNS",
    "UNIQUE_COLUMNS",
    "WALK_STEPS",
    "WALK_STEP_ROWS",
    "WORKER_SETTINGS",
    "backend_transaction",
    "cancel",
    "cancel_attempts",
    "cancel_requests",
    "claim",
    "claim_fair",
    "claim_keyed",
    "complete",
    "complete_and_delete",
    "complete_held",
    "database_now",
    "dead_jobs",
    "dead_rows",
    "delete_job",
    "enqueue_columns",
    "enqueue_debounced",
    "enqueue_many",
    "enqueue_unique",
    "fail",
    "fair_tenants",
    "heartbeat",
    "key_lock_space",
    "limited_count",
    "listen",
    "lock",
    "lock_keys",
    "lock_queues",
    "lock_rates",
    "log_key_starts",
    "log_starts",
    "oldest_xmin",
    "own_columns",
    "ping",
    "prune",
    "queue_lock_space",
    "queue_stats",
    "rate_allowances",
    "rate_lock_space",
    "release",
    "replica_lag",
    "request_cancel",
    "reset_setting",
    "retry",
    "schedule_advance",
    "schedule_create",
    "set_setting",
    "statement_timeout",
    "status_of",
    "store_results",
    "table_layout",
    "table_stats",
    "table_valued_activity",
    "tenant_depths",
    "terminate_transactions",
    "transaction_isolation",
    "vacuum",
    "wakeup_trigger_exists",
    "walk_keys",
]
