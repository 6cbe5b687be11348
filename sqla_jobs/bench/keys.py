"""The ``keys`` section: ordering keys and limits. The library's batched claim +
complete_many of ``--jobs`` plain jobs (``keys.claim.plain``), beside the same with
``keys=True`` on plain jobs, on keyed jobs over 1,000 keys with ``key_limit`` 1 and 3, and
with a queue limit (``queue_limits``, as large as the batch, so that it costs its statements
without holding a claim back) on plain jobs and on keyed jobs with ``key_limit`` 3 (ratios
to the plain claim); keyed claims behind a burst of 10,000 jobs of one busy key
(``keys.claim.behind_burst``: each claim walks past the burst); and keyed claims from
:data:`_CLAIMERS` threads at once, each on its own connection, beside plain claims the same
way (``keys.claim.keyed_concurrent`` against ``keys.claim.plain_concurrent``: overlapping
claims find the keys in line held by each other and walk past them). Each on a Core
connection, the path the worker's claims and completions take (an ORM ``Session`` sends
every statement through SQLAlchemy's ``execute``, which costs the keyed claim's extra
statements more than the statements themselves)."""

from __future__ import annotations

import threading
import time
from typing import Final

import sqlalchemy as sa

from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.bench.tasks import LEASE_SECONDS, Q_KEYS
from sqla_jobs.models import Job
from sqla_jobs.queue import claim, complete_many

__all__ = ["run_keys"]

#: Distinct ordering keys of the section's keyed jobs.
_KEYS: Final = 1_000
#: The burst figure: one key's jobs first in line, then this many keys with a job each.
_BURST: Final = 10_000
_BEHIND: Final = 2_000
#: The concurrent figures' claimers (threads, a connection each), as several workers' claims.
_CLAIMERS: Final = 4


def _cycle(
    connection: sa.Connection, batch: int, *, keys: bool, queue_limits: dict[str, int] | None
) -> tuple[int, int]:
    """One claim of ``batch`` of the keyed queue and the complete_many of what it took
    (:func:`~sqla_jobs.bench.scratch.claim_cycle`), as the worker's fetch loop and outcome
    writer run them (the statements' driver path, :func:`sqla_jobs.queue._plumbing._rows`):
    how many jobs were claimed, and how many of them completed."""
    return scratch.claim_cycle(connection, Job, Q_KEYS, batch, keys=keys, queue_limits=queue_limits)


def _claim_throughput(
    engine: sa.Engine, batch: int, count: int, *, keys: bool, queue_limited: bool
) -> float:
    """The library's batched claim + complete_many (:func:`_cycle`), in this process, on one
    connection, until a claim comes back empty: jobs/s (all ``count`` must be done)."""
    queue_limits = {Q_KEYS: batch} if queue_limited else None
    return scratch.drain(engine, Job, Q_KEYS, batch, count, keys=keys, queue_limits=queue_limits)


def _concurrent_throughput(engine: sa.Engine, batch: int, count: int, *, keys: bool) -> float:
    """Claims of ``batch`` + complete_many (:func:`_cycle`) from :data:`_CLAIMERS` threads at
    once, each in a loop on its own connection, until ``count`` jobs are done in all:
    jobs/s. A thread whose claim comes back empty (its keys held by the others) claims again
    at once."""
    done = 0
    guard = threading.Lock()
    failures: list[BaseException] = []
    deadline = time.monotonic() + 600

    def claimer() -> None:
        nonlocal done
        try:
            with engine.connect() as connection:
                while time.monotonic() < deadline:
                    _, completed = _cycle(connection, batch, keys=keys, queue_limits=None)
                    with guard:
                        done += completed
                        if done >= count:
                            return
        except BaseException as exc:  # reported by the caller, in its thread
            failures.append(exc)

    threads = [threading.Thread(target=claimer) for _ in range(_CLAIMERS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise failures[0]
    if done != count:
        raise RuntimeError(f"claimed and completed {done} of {count} jobs")
    return done / elapsed


def _burst_throughput(engine: sa.Engine, batch: int) -> float:
    """Claims of ``batch`` keyed jobs + complete_many behind a burst: ``_BURST`` jobs of one
    key first in line, whose first job runs all along (so every claim must look past the
    burst: :func:`sqla_jobs._queries.walk_keys`), then ``_BEHIND`` keys with one job each;
    jobs/s until those are claimed and completed."""
    with engine.begin() as connection:
        connection.execute(
            bench_sql.fill_burst(scratch.TABLE),
            {
                "queue": Q_KEYS,
                "task": "bench_noop",
                "count": _BURST + _BEHIND,
                "burst": _BURST,
                "key_limit": 1,
            },
        )
    scratch.vacuum(engine)
    with engine.begin() as connection:
        (hot,) = claim(connection, Job, queues=Q_KEYS, limit=1, lease=LEASE_SECONDS, keys=True)
    rate = _claim_throughput(engine, batch, _BEHIND, keys=True, queue_limited=False)
    with engine.begin() as connection:
        complete_many(connection, [hot])
    return rate


def _fill(engine: sa.Engine, count: int, key_limit: int | None) -> None:
    """``count`` no-op jobs in the section's queue: plain (``key_limit`` None), or keyed over
    :data:`_KEYS` keys with that limit; then vacuumed."""
    if key_limit is None:
        scratch.fill(engine, Q_KEYS, "bench_noop", count)
    else:
        with engine.begin() as connection:
            connection.execute(
                bench_sql.fill_keyed(scratch.TABLE),
                {
                    "queue": Q_KEYS,
                    "task": "bench_noop",
                    "count": count,
                    "keys": _KEYS,
                    "key_limit": key_limit,
                },
            )
    scratch.vacuum(engine)


def _clear(engine: sa.Engine) -> None:
    """Delete the section's queue and vacuum, for the next figure."""
    with engine.begin() as connection:
        connection.execute(bench_sql.delete_queue(scratch.TABLE), {"queue": Q_KEYS})
    scratch.vacuum(engine)


def run_keys(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """One run of each figure, side by side; each run starts with another of them (the
    order rotates), so that none is always first after the previous run's clean-up."""
    variants: list[tuple[str, int | None, bool, bool]] = [
        ("plain", None, False, False),
        ("plain_keys_on", None, True, False),
        ("keyed", 1, True, False),
        ("keyed_limit3", 3, True, False),
        ("queue_limit", None, False, True),
        ("keyed_limit3_queue_limit", 3, True, True),
    ]
    plain = results.metrics.get("keys.claim.plain")
    turn = (len(plain.runs) if plain is not None else 0) % len(variants)
    for label, key_limit, keys, queue_limited in variants[turn:] + variants[:turn]:
        _fill(engine, cfg.jobs, key_limit)
        value = _claim_throughput(
            engine, cfg.batch, cfg.jobs, keys=keys, queue_limited=queue_limited
        )
        ceiling = None if label == "plain" else "keys.claim.plain"
        results.add(f"keys.claim.{label}", value, "jobs/s", ceiling)
        _clear(engine)
    value = _burst_throughput(engine, cfg.batch)
    results.add("keys.claim.behind_burst", value, "jobs/s", "keys.claim.plain")
    _clear(engine)
    for label, keyed in (("plain_concurrent", False), ("keyed_concurrent", True)):
        _fill(engine, cfg.jobs, 1 if keyed else None)
        value = _concurrent_throughput(engine, cfg.batch, cfg.jobs, keys=keyed)
        ceiling = "keys.claim.plain_concurrent" if keyed else None
        results.add(f"keys.claim.{label}", value, "jobs/s", ceiling)
        _clear(engine)
    scratch.progress("keys")
