"""What the rate limits hold back now, and how deep the tenants of the fairly shared queues
are (see :mod:`sqla_jobs.queue`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from sqla_jobs._queries.fair import TENANT_DEPTHS
from sqla_jobs._queries.rates import PRUNE_RATES, RATE_TABLE_EXISTS, RATE_USAGE
from sqla_jobs._queries.run import Executor, job_table_of
from sqla_jobs.queue._plumbing import _check_count
from sqla_jobs.queue.claiming import check_fair_columns
from sqla_jobs.schema import JobMixin
from sqla_jobs.validation import FairShare, check_fair_shares

__all__ = [
    "DEFAULT_TOP_TENANTS",
    "MAX_PRUNE_LIMIT",
    "MAX_TOP_TENANTS",
    "NO_TENANT",
    "RateUsage",
    "TenantDepths",
    "checked_fair_shares",
    "prune_rates",
    "rate_usage",
    "tenant_depths",
    "tenant_text",
]

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


# -- fair shares: how deep each tenant is -----------------------------------------------------

#: How many of a queue's deepest tenants :func:`tenant_depths` lists by default, and at most.
DEFAULT_TOP_TENANTS: Final = 10
MAX_TOP_TENANTS: Final = 1_000
#: How a tenant reads where it is shown (``sqla-jobs status``, the metrics' ``tenant``
#: label, the dashboard) when its column is NULL: the jobs without a tenant.
NO_TENANT: Final = "(none)"
#: The longest a tenant reads where it is shown, in characters (:func:`tenant_text`).
MAX_TENANT_TEXT: Final = 100


@dataclass(frozen=True, slots=True)
class TenantDepths:
    """A fairly shared queue's tenants now (:class:`~sqla_jobs.FairShare`), as its claims
    see them: ``column``, the job model's column it is shared by; ``tenants``, how many
    values of it (the jobs whose column is NULL count as one tenant) have pending jobs
    without an ordering key, due or not; ``pending``, how many such jobs they have in all;
    ``deepest``, the tenants with the most of them as ``(tenant, pending)`` pairs, most
    first (a tie in the column's order, NULL first), each tenant as the column's type reads
    (a ``str``, an ``int``, a ``UUID``; None: the jobs without one)."""

    queue: str
    column: str
    tenants: int
    pending: int
    deepest: tuple[tuple[Any, int], ...] = ()

    @property
    def deepest_pending(self) -> int | None:
        """The deepest tenant's pending jobs (None when no tenant has any)."""
        return self.deepest[0][1] if self.deepest else None


def tenant_depths(
    session: Executor,
    model: type[JobMixin],
    fair_shares: Mapping[str, FairShare] | None,
    *,
    top: int = DEFAULT_TOP_TENANTS,
) -> list[TenantDepths]:
    """Each fairly shared queue of ``fair_shares`` (queue names to
    :class:`~sqla_jobs.FairShare`: a registry's :attr:`~sqla_jobs.Registry.fair_shares`)
    with its tenants now (:class:`TenantDepths`: how many have pending jobs, how many jobs
    in all, and the ``top`` deepest), by name; a queue without a pending job is listed too,
    with none. None or an empty mapping: none, and no SQL.

    One read per queue of the model's fair index of the column
    (:func:`~sqla_jobs.schema.fair.fair_index`; an index-only scan where the visibility map
    allows, so its cost grows with the queue's pending jobs, never with the history), in
    the caller's transaction; no lock. Without the index it still answers, reading the
    queue's pending rows from the table. Bad input raises
    :class:`~sqla_jobs.errors.InvalidJobError` before any SQL: ``fair_shares`` not a mapping
    of queue names to ``FairShare``, a column ``model`` has not or one of the job table's
    own, ``top`` not an integer in [1, :data:`MAX_TOP_TENANTS`]."""
    table = job_table_of(model)
    _check_count("top", top, MAX_TOP_TENANTS)
    shares = checked_fair_shares(model, fair_shares)
    found: list[TenantDepths] = []
    for name, share in shares.items():
        rows = TENANT_DEPTHS.rows(
            session, table, {"queue_name": name, "top": top}, column=share.column
        )
        found.append(
            TenantDepths(
                queue=name,
                column=share.column,
                tenants=rows[0].tenants,
                pending=rows[0].pending,
                deepest=tuple(
                    (row.tenant, row.tenant_pending)
                    for row in rows
                    if row.tenant_pending is not None
                ),
            )
        )
    return found


def checked_fair_shares(model: type[JobMixin], fair_shares: object) -> dict[str, FairShare]:
    """``fair_shares`` as :func:`tenant_depths` checks them, by queue name: a mapping of
    queue names to :class:`~sqla_jobs.FairShare` (None: none), each column one of
    ``model``'s own (:func:`~sqla_jobs.queue.claiming.check_fair_columns`); else
    :class:`~sqla_jobs.errors.InvalidJobError`. ``model`` is looked at only when some queue
    is shared. No SQL."""
    shares = check_fair_shares("fair_shares", fair_shares)
    if not shares:
        return shares
    return check_fair_columns(job_table_of(model), shares)


def tenant_text(tenant: object) -> str:
    """``tenant`` (a value of :attr:`TenantDepths.deepest`) as text where it is shown:
    :data:`NO_TENANT` for None, else ``str(tenant)``, cut to :data:`MAX_TENANT_TEXT`
    characters (the cut ones end in ``...``)."""
    if tenant is None:
        return NO_TENANT
    text = str(tenant)
    return text if len(text) <= MAX_TENANT_TEXT else text[: MAX_TENANT_TEXT - 3] + "..."
