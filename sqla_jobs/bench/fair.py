"""The ``fair`` section: fair shares (:class:`~sqla_jobs.FairShare`). The library's batched
claim + complete_many on a Core connection (as in :mod:`~sqla_jobs.bench.keys`), until the
queue is empty, with the plain claim and with ``fair_shares={queue: FairShare("tenant")}``,
on a bench-only model with a tenant column and its fair index (:class:`FairBenchJob`):

* ``fair.drain.plain`` and ``fair.drain.fair`` (its ratio to the plain one): one tenant's
  backlog of ``--jobs`` x 5 jobs, enqueued first, then :data:`_SMALL_TENANTS` tenants with
  :data:`_SMALL_JOBS` jobs each; jobs/s.
* ``fair.first_claims`` (the fair drain) and ``fair.first_claims.plain`` (the plain one,
  where the small tenants wait behind the backlog): how many claims it took until every
  small tenant's first job had started, read from the table afterwards
  (:func:`~sqla_jobs.bench.statements.first_claims`).
* ``fair.drain.many_tenants`` against ``fair.drain.many_tenants_plain``: :data:`_MANY_TENANTS`
  tenants with ``--jobs`` / :data:`_MANY_TENANTS` jobs each, so that every fair claim spans
  that many tenants: what the fair claim costs when it has work to do.

Each figure a run of each variant, side by side, the order rotating from run to run.
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.schema import JobMixin
from sqla_jobs.schema.fair import fair_index
from sqla_jobs.validation import FairShare

__all__ = ["FairBenchJob", "metadata", "run_fair"]

_QUEUE: Final = "bench_fair"
_TASK: Final = "bench_noop"
#: The small tenants of the backlog figure, and their jobs each.
_SMALL_TENANTS: Final = 50
_SMALL_JOBS: Final = 10
#: The backlog tenant's jobs, as a multiple of ``--jobs`` (100,000 at the default 20,000).
_BACKLOG_FACTOR: Final = 5
#: The tenants of the many-tenants figure.
_MANY_TENANTS: Final = 50
#: Tenant names: a prefix and a number in three digits (``small007``), so that the backlog
#: tenant (``backlog000``) sorts before the small ones and comes first in the fair ring.
_BACKLOG_PREFIX: Final = "backlog"
_BACKLOG: Final = f"{_BACKLOG_PREFIX}000"
_SMALL_PREFIX: Final = "small"
_MANY_PREFIX: Final = "tenant"


class _Base(DeclarativeBase):
    pass


class FairBenchJob(JobMixin, _Base):
    """The fair section's job model: the library's job table with a tenant column."""

    __tablename__ = "sqla_jobs_bench_fair_jobs"

    tenant: Mapped[str | None] = mapped_column(String(50))


#: Where the fair claim finds each tenant's jobs.
FAIR_INDEX: Final = fair_index(FairBenchJob, "tenant")
#: The model's tables (the job table and the pause table JobMixin adds beside it).
metadata: Final = _Base.metadata
_TABLE: Final[sa.Table] = FairBenchJob.__table__  # type: ignore[assignment]
_SHARES: Final = {_QUEUE: FairShare("tenant")}


def _fill(engine: sa.Engine, prefix: str, tenants: int, count: int) -> None:
    """``count`` no-op jobs in the section's queue, spread over ``tenants`` tenants named
    ``prefix`` and a number, in turn (:func:`~sqla_jobs.bench.statements.fill_tenants`)."""
    with engine.begin() as connection:
        connection.execute(
            bench_sql.fill_tenants(_TABLE, "tenant"),
            {
                "queue": _QUEUE,
                "task": _TASK,
                "count": count,
                "prefix": prefix,
                "tenants": tenants,
            },
        )


def _vacuum(engine: sa.Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text(bench_sql.vacuum_analyze(_TABLE)))


def _fill_backlog(engine: sa.Engine, backlog: int) -> int:
    """The backlog figure's jobs: ``backlog`` jobs of one tenant first, then
    :data:`_SMALL_TENANTS` tenants with :data:`_SMALL_JOBS` jobs each (their jobs in turn,
    so the first ``_SMALL_TENANTS`` behind the backlog are each tenant's first); vacuumed.
    How many jobs in all."""
    _fill(engine, _BACKLOG_PREFIX, 1, backlog)
    _fill(engine, _SMALL_PREFIX, _SMALL_TENANTS, _SMALL_TENANTS * _SMALL_JOBS)
    _vacuum(engine)
    return backlog + _SMALL_TENANTS * _SMALL_JOBS


def _fill_many(engine: sa.Engine, jobs: int) -> int:
    """The many-tenants figure's jobs: :data:`_MANY_TENANTS` tenants with ``jobs`` /
    ``_MANY_TENANTS`` jobs each (at least one), in turn; vacuumed. How many jobs in all."""
    count = _MANY_TENANTS * max(jobs // _MANY_TENANTS, 1)
    _fill(engine, _MANY_PREFIX, _MANY_TENANTS, count)
    _vacuum(engine)
    return count


def _clear(engine: sa.Engine) -> None:
    """Delete the section's queue and vacuum, for the next figure."""
    with engine.begin() as connection:
        connection.execute(bench_sql.delete_queue(_TABLE), {"queue": _QUEUE})
    _vacuum(engine)


def _drain(engine: sa.Engine, batch: int, count: int, *, fair: bool) -> float:
    """:func:`~sqla_jobs.bench.scratch.drain` of the section's queue, by fair claims
    (``fair``) or plain ones: jobs/s."""
    shares = _SHARES if fair else None
    return scratch.drain(engine, FairBenchJob, _QUEUE, batch, count, fair_shares=shares)


def _first_claims(engine: sa.Engine) -> int:
    """After the backlog figure's drain: the claim in which the last small tenant's first
    job started (:func:`~sqla_jobs.bench.statements.first_claims`)."""
    with engine.connect() as connection:
        last, tenants = connection.execute(
            bench_sql.first_claims(_TABLE, "tenant"), {"queue": _QUEUE, "backlog": _BACKLOG}
        ).one()
    if tenants != _SMALL_TENANTS or last is None:
        raise RuntimeError(f"found {tenants} small tenants of {_SMALL_TENANTS}")
    return int(last)


def run_fair(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """One run of each figure, side by side, on the model's tables, created here and dropped
    at the end; each run starts with another variant (the order rotates), so that neither
    is always first after the previous figure's clean-up."""
    metadata.create_all(engine)
    try:
        plain = results.metrics.get("fair.drain.plain")
        turn = (len(plain.runs) if plain is not None else 0) % 2
        variants = [("plain", False), ("fair", True)]
        for label, fair in variants[turn:] + variants[:turn]:
            count = _fill_backlog(engine, cfg.jobs * _BACKLOG_FACTOR)
            value = _drain(engine, cfg.batch, count, fair=fair)
            ceiling = "fair.drain.plain" if fair else None
            results.add(f"fair.drain.{label}", value, "jobs/s", ceiling).extra["jobs"] = count
            name = "fair.first_claims" if fair else "fair.first_claims.plain"
            first = results.add(name, _first_claims(engine), "claims")
            first.higher_is_better = False
            first.extra.update(tenants=_SMALL_TENANTS + 1, batch=cfg.batch)
            _clear(engine)
        many = [("many_tenants_plain", False), ("many_tenants", True)]
        for label, fair in many[turn:] + many[:turn]:
            count = _fill_many(engine, cfg.jobs)
            value = _drain(engine, cfg.batch, count, fair=fair)
            ceiling = "fair.drain.many_tenants_plain" if fair else None
            results.add(f"fair.drain.{label}", value, "jobs/s", ceiling).extra["jobs"] = count
            _clear(engine)
    finally:
        metadata.drop_all(engine)
    scratch.progress("fair")
