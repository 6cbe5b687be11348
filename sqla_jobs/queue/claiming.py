"""Claiming jobs: lease mode, lock-held mode, ordering keys and queue limits (see
:mod:`sqla_jobs.queue`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import Table

from sqla_jobs import validation
from sqla_jobs._queries.claiming import claim_rows
from sqla_jobs._queries.outcomes import LOCK, OWN_COLUMNS
from sqla_jobs._queries.rows import (
    CLAIM_ID,
    CLAIM_JOB_FIELDS,
    CLAIM_ORDER,
    CLAIM_STATUS,
    ClaimRow,
    LockRow,
)
from sqla_jobs._queries.run import Executor, job_table_of
from sqla_jobs.errors import (
    ConfigurationError,
    InvalidJobError,
    JobNotFoundError,
)
from sqla_jobs.holding import first_step_engine
from sqla_jobs.queue._plumbing import (
    DEFAULT_LEASE,
    MAX_CLAIM_LIMIT,
    ClaimedJob,
    _check_count,
    _check_queues,
    _claim_order_with_unreadable,
    _fence_params,
    _fenced,
    _one_model,
    _own_columns,
    _seconds,
    default_worker_name,
)
from sqla_jobs.schema import (
    DEFAULT_QUEUE,
    JobMixin,
    JobStatus,
)
from sqla_jobs.validation import FairShare, RateLimit

logger = logging.getLogger(__name__)


# -- claim ------------------------------------------------------------------------------


def claim(
    session: Executor,
    model: type[JobMixin],
    *,
    queues: str | Iterable[str] = DEFAULT_QUEUE,
    limit: int = 1,
    lease: timedelta | float = DEFAULT_LEASE,
    worker: str | None = None,
    hold: bool = False,
    keys: bool = False,
    queue_limits: Mapping[str, int] | None = None,
    rate_limits: Mapping[str, RateLimit] | None = None,
    fair_shares: Mapping[str, FairShare] | None = None,
) -> list[ClaimedJob]:
    """Claim up to ``limit`` runnable jobs and start an attempt on each.

    Runnable means pending with ``run_at`` no later than the database's clock, or running
    with an expired lease (its worker crashed or stalled). Jobs are taken in
    ``(priority, run_at, id)`` order, with ``FOR UPDATE SKIP LOCKED``, in one statement:
    concurrent claimers get disjoint jobs and skip, never wait for, jobs another worker
    holds. Each claimed job's ``attempts`` grows by one; that number is the attempt's fence.
    The statement reads up to ``limit`` candidates per queue, so its cost grows with the
    number of queues and ``limit``, not with the backlog; with several queues, the
    candidates that did not make the batch stay locked until the transaction ends (keep it
    short). See :func:`sqla_jobs._queries.claim`.

    **Lease mode** (``hold=False``, the default). The claim runs in the caller's transaction
    and is durable once the caller commits. Each job is then ``running`` with a lease that
    ends ``lease`` after the claim, in database time; :func:`heartbeat` extends it. When the
    lease ends before the attempt does, the next claim takes the job over as a new attempt
    and every later transition by the old attempt raises :class:`LeaseLostError`. A job
    whose lease ran out on its last attempt is made ``dead`` by the claim that finds it.

    **Lock-held mode** (``hold=True``). The attempt is first counted in a short transaction
    of its own on a separate connection from the session's engine, and committed, so that a
    worker that dies mid-job still uses up an attempt (a job that kills its worker every time
    ends dead). The rows are then locked with ``SELECT ... FOR UPDATE`` in the caller's
    transaction and stay locked until it ends. Complete the jobs in that same transaction
    and the handler's own writes commit together with the completion, or not at all. If the
    worker dies, its locks go with its connection and the jobs come back once ``lease`` has
    passed; while the caller's transaction lives, no other claim can take them, however
    long the handler runs. Claim data committed by others only: the separate connection
    does not see the caller's uncommitted rows.

    **Ordering keys** (``keys=True``). Jobs with an ``ordering_key`` are claimed only with
    ``keys=True`` (a plain claim never takes one, so it cannot break a key's order). Then
    the claim first takes keyed jobs, key by key: a job starts only when fewer than its
    ``key_limit`` (default 1) jobs of its key are in progress (running on a live lease or
    held by a lock-held worker, or waiting for a retry), and only after the key's jobs that
    come before it (expired attempts first, then due retries, then new jobs in ``(priority,
    run_at, id)`` order; a job whose ``run_at`` is still ahead blocks nobody). Claimers are
    serialised per key by transaction-scoped advisory try-locks
    (:func:`sqla_jobs._queries.lock_keys`), taken in a statement before the claim's, so
    that the claim sees whatever the key's previous claimer committed; a key another claim
    is locking is skipped, not waited for. When the keys of the jobs first in line cannot
    fill the batch (one key's burst, keys whose jobs in progress fill their limits, or keys
    that overlapping claims hold), the claim looks further along the line
    (:func:`sqla_jobs._queries.walk_keys`); when the keyed claim still comes back short,
    it looks once more, past the keys that are busy too, and claims from the keys found.
    The keyed jobs' batch is filled up with plain jobs. Three statements instead of one
    (two when no key is free; two or four more when it looks further), in the same
    transaction, and the key locks last until it ends: keep it short.

    **Queue limits** (``queue_limits={"emails": 3}``). At most that many jobs of a limited
    queue run at once, across all claimers that pass the same limits (declare them once,
    in code every worker shares: :class:`~sqla_jobs.registry.Registry` ``queue_limits``).
    Only live attempts count: running on a lease that has not ended in database time, or
    held by a lock-held worker; a crashed worker's attempt frees its slot when its lease
    ends, and taking it over is a new claim that must fit in the limit. Per limited queue
    served, the claim takes a transaction-scoped advisory try-lock
    (:func:`sqla_jobs._queries.lock_queues`; a queue another claim holds is skipped this
    round, never waited for), then claims at most the queue's free slots from it with a
    claim statement that counts its live attempts
    (:func:`~sqla_jobs._queries.limited_count`), keyed jobs included (``keys=True``:
    they respect both limits; the keyed claim's first statement takes the queue's lock with
    its keys). Limited queues are served first, then the others fill the rest of ``limit``
    with the plain claim, which is unchanged (the same statement as without limits; a
    claim with no limited queue among ``queues`` runs exactly as before). The queue locks
    last until the transaction ends: keep it short.

    **Rate limits** (``rate_limits={"api": RateLimit(50)}``: 50 a second). In any window of
    its length, at most the limit's number of attempts of that queue start (each at its
    claim's statement time, its ``attempted_at``), across all claimers that pass the same
    limits (declare them once: :class:`~sqla_jobs.registry.Registry` ``rate_limits``). Per
    rate-limited queue served, the claim takes a transaction-scoped advisory try-lock (a
    queue another claim is rating is skipped this round), reads what the queue's window
    still allows from the table's rate table
    (:func:`~sqla_jobs.schema.rates.rate_table`, made by
    :func:`~sqla_jobs.migrations.create_rate_table`), claims at most that, and logs what it
    started there: three more statements in the caller's transaction
    (:mod:`sqla_jobs._queries.rates`). Rate-limited queues are served first; queue limits
    and ordering keys apply within them too. A limit ``per_key`` is each ordering key's:
    the keyed claim (``keys=True``) starts at most what the key's own window allows, under
    the key's lock, and logs its starts per key after each keyed claim statement; the
    queue's jobs without a key are not limited.

    **Fair shares** (``fair_shares={"emails": FairShare("tenant_id")}``). The queue's jobs
    without an ordering key are shared over its tenants, the values of a column of the
    model (:class:`~sqla_jobs.FairShare`): the claim takes round by round, each tenant's
    next job (or ``weight`` of them) in each round, so that one tenant's backlog cannot
    keep another's jobs waiting. Two statements
    (:mod:`sqla_jobs._queries.fair`): the queue's tenants in turn (a loose scan of the fair
    index, :func:`~sqla_jobs.schema.fair.fair_index`, which the model needs: at most
    ``limit`` tenants a claim, from where the process's previous fair claim of the
    queue stopped), then the claim from them. Queue and rate limits apply as to any queue;
    keyed jobs are claimed before, by their keys.

    **Paused queues** (:func:`~sqla_jobs.pause_queue`) are skipped by every form above: the
    claim statements read the table's pause table themselves, so a queue paused (or
    resumed) in a committed transaction is honoured by the next claim of every worker.

    Returns the claimed jobs, possibly none. Raises :class:`InvalidJobError` for bad
    arguments, before any SQL runs.
    """
    return claim_waiting(
        session,
        model,
        queues=queues,
        limit=limit,
        lease=lease,
        worker=worker,
        hold=hold,
        keys=keys,
        queue_limits=queue_limits,
        rate_limits=rate_limits,
        fair_shares=fair_shares,
    )[0]


def claim_waiting(
    session: Executor,
    model: type[JobMixin],
    *,
    queues: str | Iterable[str] = DEFAULT_QUEUE,
    limit: int = 1,
    lease: timedelta | float = DEFAULT_LEASE,
    worker: str | None = None,
    hold: bool = False,
    keys: bool = False,
    queue_limits: Mapping[str, int] | None = None,
    rate_limits: Mapping[str, RateLimit] | None = None,
    fair_shares: Mapping[str, FairShare] | None = None,
) -> tuple[list[ClaimedJob], float | None]:
    """:func:`claim`, and when a rate-limited queue was held back, the seconds after which it
    may allow more (:class:`~sqla_jobs._queries.claiming.ClaimedRows`), else None: how long
    a worker whose claim came back short need wait for it."""
    table = job_table_of(model)
    queue_names = _check_queues(queues)
    _check_count("limit", limit, MAX_CLAIM_LIMIT)
    lease_seconds = _seconds("lease", lease)
    worker = validation.check_name("worker", worker or default_worker_name())
    if not isinstance(keys, bool):
        raise InvalidJobError("keys", f"must be True or False, not {keys!r}")
    limited: dict[str, int] = {}
    if queue_limits is not None:
        limits = validation.check_queue_limits("queue_limits", queue_limits)
        limited = {name: limits[name] for name in queue_names if name in limits}
    rated: dict[str, tuple[int, float]] = {}
    key_rated: dict[str, tuple[int, float]] = {}
    if rate_limits is not None:
        rates = validation.check_rate_limits("rate_limits", rate_limits)
        for name in queue_names:
            if name in rates:
                rate = rates[name]
                (key_rated if rate.per_key else rated)[name] = (rate.limit, rate.seconds)
    fair = check_fair_columns(table, fair_shares) if fair_shares is not None else None
    claiming = functools.partial(
        claim_rows,
        table=table,
        queue_names=queue_names,
        limit=limit,
        lease_seconds=lease_seconds,
        worker=worker,
        keys=keys,
        limited=limited,
        rated=rated,
        key_rated=key_rated,
        fair=fair,
    )
    if hold:
        engine = first_step_engine(session, model, call="claim(hold=True)", step="the attempt")
        with engine.begin() as connection:
            rows, wait = claiming(connection)
    else:
        rows, wait = claiming(session)
    running = JobStatus.RUNNING.value
    # The hot path. The rows (ClaimRow) are sorted in (priority, run_at, id) order by a
    # C-level key, and each job is built by tuple.__new__ (ClaimedJob's own __new__ is a
    # Python-level call around it) as the model, the row's id, and the rest of the row after
    # its status: ClaimedJob's fields are ClaimRow's in that shape (tests/test_query_rows.py).
    new = tuple.__new__
    try:
        ordered = sorted(rows, key=CLAIM_ORDER)
    except TypeError:  # a run_at came back None: a row Python cannot read (rare; see admit)
        ordered = sorted(rows, key=_claim_order_with_unreadable)
    job_id, status, rest = CLAIM_ID, CLAIM_STATUS, CLAIM_JOB_FIELDS
    jobs: list[ClaimedJob] = [
        new(ClaimedJob, (model, row[job_id], *row[rest]))
        for row in ordered
        if row[status] == running
    ]
    if len(jobs) < len(rows):
        _log_exhausted(rows, running)
    if hold and jobs:
        return lock(session, jobs), wait
    return jobs, wait


def check_fair_columns(table: Table, fair_shares: object) -> dict[str, FairShare]:
    """``fair_shares`` checked (:func:`~sqla_jobs.validation.check_fair_shares`), each
    column against the job table: one of the model's own, not one the queue's claims read
    otherwise (:class:`~sqla_jobs.errors.InvalidJobError`). No SQL."""
    shares = validation.check_fair_shares("fair_shares", fair_shares)
    for name, share in shares.items():
        if share.column not in table.c:
            raise InvalidJobError(
                "fair_shares",
                f"queue {name!r} shares by column {share.column!r}, which {table.name} has not",
            )
        if share.column in _NOT_TENANTS:
            raise InvalidJobError(
                "fair_shares",
                f"queue {name!r} cannot share by {share.column!r}: a tenant is a column of "
                "the model's own (jobs with an ordering key keep their keys' order and "
                "key_limit, claimed before the fair share)",
            )
    return shares


#: The job table's columns that no fair share may use as its tenant.
_NOT_TENANTS: Final = frozenset(JobMixin.__annotations__)


def _log_exhausted(rows: Sequence[Any], running: str) -> None:
    # Jobs the claim made dead: their last attempt's lease ran out (its worker died). Logged
    # here, by whoever claimed, so that alerting on errors hears of a crash-looping job.
    for row in map(ClaimRow._make, rows):
        if row.status == running:
            continue
        job_id, status, queue, task = row.id, row.status, row.queue, row.task
        attempt, maximum = row.attempts, row.max_attempts
        if status == JobStatus.CANCELLED.value:
            logger.info(
                "job %d (%s) is cancelled: attempt %d lost its lease after its cancel was "
                "requested, and is not run again",
                job_id,
                task,
                attempt,
                extra={
                    "action": "job_cancelled",
                    "job_id": job_id,
                    "task": task,
                    "queue": queue,
                    "attempt": attempt,
                },
            )
            continue
        logger.error(
            "job %d (%s) is dead: attempt %d of %d lost its lease (its worker stopped or "
            "crashed mid-job) and no attempt is left",
            job_id,
            task,
            attempt,
            maximum,
            extra={
                "action": "attempts_exhausted",
                "job_id": job_id,
                "task": task,
                "queue": queue,
                "attempt": attempt,
            },
        )


def lock(session: Executor, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """Lock the rows of these attempts until the caller's transaction ends.

    Returns the jobs whose attempt is still current (fenced); the others were taken over
    after their lease ran out and must not be run. Used by lock-held claims, and by workers
    that count the attempt on one connection and then hold the rows.
    """
    return lock_started(session, jobs)[0]


def job_columns(job: ClaimedJob, session: Executor | None = None) -> dict[str, Any]:
    """The values of the job model's own columns (those not declared by
    :class:`~sqla_jobs.JobMixin`, such as an ``order_id``) in the job's row, by column name:
    one query by primary key, in ``session``'s transaction. A model without columns of its
    own gives ``{}`` without any query (and needs no session)."""
    table = job_table_of(job.model)
    own = _own_columns(table)
    if not own:
        return {}
    if session is None:
        raise ConfigurationError("job_columns needs a session to read the job row with")
    row = OWN_COLUMNS.result(session, table, {"job_id": job.id}).first()
    if row is None:
        raise JobNotFoundError(f"{job.model.__name__} has no job {job.id}")
    return dict(row._mapping)


def lock_one(session: Executor, job: ClaimedJob) -> float | None:
    """:func:`lock` for one attempt, for a worker that must later be able to end the
    transaction holding the lock: returns that transaction's start (epoch seconds), or None
    when the attempt was taken over (nothing is locked then)."""
    return lock_started(session, [job])[1]


def lock_started(
    session: Executor, jobs: Sequence[ClaimedJob]
) -> tuple[list[ClaimedJob], float | None]:
    """:func:`lock`, returning also what a worker needs to end the transaction holding the
    locks later: the jobs locked (the others were taken over) and that transaction's start
    (epoch seconds; None if none was locked). One statement, on the driver's fast path where
    there is one (:func:`fetch`)."""
    if not jobs:
        return [], None
    rows = LOCK.tuples(session, job_table_of(_one_model(jobs)), _fence_params(jobs))
    kept = _fenced(rows)
    return [job for job in jobs if (job.id, job.attempt) in kept], (
        float(LockRow._make(rows[0]).xact_start) if rows else None
    )
