"""What the rate limits hold back now (see :mod:`sqla_jobs.queue`)."""

from __future__ import annotations

from dataclasses import dataclass

from sqla_jobs._queries.rates import PRUNE_RATES, RATE_TABLE_EXISTS, RATE_USAGE
from sqla_jobs._queries.run import Executor, job_table_of
from sqla_jobs.queue._plumbing import _check_count
from sqla_jobs.schema import JobMixin

__all__ = ["MAX_PRUNE_LIMIT", "RateUsage", "prune_rates", "rate_usage"]

#: The most rows one :func:`prune_rates` deletes.
MAX_PRUNE_LIMIT = 1_000_000


@dataclass(frozen=True, slots=True)
class RateUsage:
    """A rate-limited queue's window now, as the claims logged it in the rate table:
    ``limit`` starts per ``window_seconds`` (the last claim's :class:`~sqla_jobs.RateLimit`);
    ``started``, the attempts its window holds now (None for a limit per key); ``keys``, the
    ordering keys with starts in their windows, and ``full_keys``, those whose windows are
    full (a per-key limit). ``full``: no job of the queue (or of a full key) may start now."""

    queue: str
    limit: int
    window_seconds: float
    started: int | None
    keys: int = 0
    full_keys: int = 0

    @property
    def full(self) -> bool:
        return self.started is not None and self.started >= self.limit


def rate_usage(session: Executor, model: type[JobMixin]) -> list[RateUsage]:
    """Each rate-limited queue of ``model``'s jobs with its window now (database time), by
    name; none when the table has no rate table (:func:`sqla_jobs.migrations.create_rate_table`)
    or no claim has logged a start yet. Two reads (the catalog, then the rate table, whole:
    a row per rate-limited queue, and per key of a per-key limit), in the caller's
    transaction; no lock."""
    table = job_table_of(model)
    (exists,) = RATE_TABLE_EXISTS.rows(session, table, {})
    if not exists.exists:
        return []
    return [
        RateUsage(
            queue=row.queue,
            limit=row.rate_limit,
            window_seconds=float(row.window_seconds),
            started=row.started,
            keys=row.keys,
            full_keys=row.full_keys,
        )
        for row in RATE_USAGE.rows(session, table, {})
    ]


def prune_rates(session: Executor, model: type[JobMixin], *, limit: int = 10_000) -> int:
    """Delete up to ``limit`` rows of ``model``'s rate table whose windows hold no start (a
    limit per key keeps a row for every key it saw; idle ones go); return how many. Rows a
    claim holds are skipped; a key's next claim makes its row again. 0 without a rate table.
    ``sqla-jobs prune`` runs it after the jobs. In the caller's transaction."""
    table = job_table_of(model)
    _check_count("limit", limit, MAX_PRUNE_LIMIT)
    (exists,) = RATE_TABLE_EXISTS.rows(session, table, {})
    if not exists.exists:
        return 0
    return PRUNE_RATES.result(session, table, {"limit": limit}).rowcount
