"""Fair shares across tenants (:class:`~sqla_jobs.FairShare`): :func:`fair_tenants` and
:func:`claim_fair`, the two statements of one fair claim in the order they run, and
:func:`tenant_depths`, what the gauges show of a fairly shared queue; see
:mod:`sqla_jobs._queries`.

A tenant is a value of a column of the user's job model (``FairShare("tenant_id")``); the
statements read the queue's pending jobs without an ordering key through the fair index
:func:`~sqla_jobs.schema.fair.fair_index` ``(queue, <column>, priority, run_at, id) WHERE status =
'pending' AND ordering_key IS NULL``, which the application declares beside its model.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import BigInteger, Integer, Table, Text, TextClause, Update, bindparam, text
from sqlalchemy import column as result_column
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY

from sqla_jobs._queries.claims import _limited_params, _start_attempts, limited_count
from sqla_jobs._queries.rows import ClaimRow
from sqla_jobs._queries.run import Query, json_text_on_asyncpg
from sqla_jobs.ddl import qualified_name
from sqla_jobs.schema import JobStatus
from sqla_jobs.schema.pauses import paused_predicate

_DIALECT: Final = postgresql.dialect()  # type: ignore[no-untyped-call]


def _tenant_column(table: Table, name: str) -> tuple[str, str]:
    """The tenant column ``name`` of ``table`` as SQL: its quoted name and its type."""
    found = table.c[name]
    return _DIALECT.identifier_preparer.quote(name), str(found.type.compile(dialect=_DIALECT))


def _plain_pending() -> str:
    # A queue's pending jobs without an ordering key (the fair index's rows for the queue).
    pending = JobStatus.PENDING.value
    return f"j.status = '{pending}' AND j.ordering_key IS NULL AND j.queue = :queue_name"


#: How many of a tenant's first jobs in claim order :func:`fair_tenants` looks at to tell
#: whether it has one due: a tenant whose first this many are all scheduled later is passed
#: over until one of them is due, even if a job of a lower priority behind them is.
DUE_LOOKAHEAD: Final = 16


def fair_tenants(table: Table, *, column: str) -> TextClause:
    """The tenants a fair claim of the queue ``:queue_name`` serves, in turn: the values of
    ``column`` among its pending jobs without an ordering key, each with whether it has a
    job due (``tenant, due``), in the order of a ring that the claims of a process go round
    (:data:`~sqla_jobs._queries.claiming.FAIR_RINGS` keeps its place): NULL first (the jobs
    without a tenant, one tenant of their own), then the values in the column's order.

    Where it starts: after the tenant the previous claim served last, ``:after`` (``:mode``
    2; 1: that was the NULL tenant; 0: no claim yet, from the ring's start), and round the
    ring from there, at most once. It stops when ``:most`` tenants with a job due are
    found, or after ``:cap`` tenants in all, or where it started; on a paused queue, at once.

    A loose index scan of the fair index: one descent per tenant (the next value past the
    last one, ``ORDER BY <column>, priority, run_at, id LIMIT 1``: the tenant's first job in
    claim order, which says whether it is due), and for a tenant whose first job is not due,
    one read of its next :data:`DUE_LOOKAHEAD` entries. So its cost grows with the tenants
    it passes, not with their jobs. Reads, locks nothing: a tenant whose jobs another claim
    takes meanwhile gives the claim nothing.

    Parameters: ``:queue_name``, ``:after`` (of the column's type), ``:mode``, ``:most``,
    ``:cap``.
    """
    t = qualified_name(table.name, table.schema)
    c, kind = _tenant_column(table, column)
    plain = _plain_pending()
    now = "statement_timestamp()"
    after = f"CAST(:after AS {kind})"
    # A paused queue's scan stops at its first step (a one-time filter: it names the queue).
    active = f"NOT {paused_predicate(table, ':queue_name')}"

    def value(condition: str, phase: str) -> str:
        # The first job of the next tenant with a value, in claim order, past ``condition``.
        return f"""(SELECT j.{c} AS tenant, j.run_at <= {now} AS due, {phase} AS phase
         FROM {t} AS j
         WHERE {condition} AND {plain} AND j.{c} IS NOT NULL
         ORDER BY j.{c}, j.priority, j.run_at, j.id LIMIT 1)"""

    def untenanted(condition: str) -> str:
        # The NULL tenant, when jobs without one are pending.
        def jobs(due: str) -> str:
            return f"EXISTS (SELECT FROM {t} AS j WHERE {plain} AND j.{c} IS NULL{due})"

        return f"""(SELECT CAST(NULL AS {kind}), {jobs(f" AND j.run_at <= {now}")}, 2
         WHERE {condition} AND {jobs("")})"""

    def runnable(row: str) -> str:
        # 1 when the tenant has a job due: its first one, or one of its next few.
        return f"""CASE WHEN {row}.due THEN 1 WHEN {row}.phase = 2 THEN 0
            WHEN EXISTS (
                SELECT FROM (
                    SELECT j.run_at FROM {t} AS j
                    WHERE {plain} AND j.{c} = {row}.tenant
                    ORDER BY j.{c}, j.priority, j.run_at, j.id LIMIT {DUE_LOOKAHEAD}
                ) AS f
                WHERE f.run_at <= {now}
            ) THEN 1 ELSE 0 END"""

    sql = f"""WITH RECURSIVE scan (tenant, phase, n, found, runnable) AS (
    SELECT b.tenant, b.phase, 1, b.runnable, b.runnable FROM (
        SELECT s.tenant, s.phase, {runnable("s")} AS runnable FROM (
            {value(f":mode = 2 AND {active} AND j.{c} > {after}", "1")}
            UNION ALL
            {value(f":mode = 1 AND {active}", "1")}
            UNION ALL
            {untenanted(f":mode <> 1 AND {active}")}
            UNION ALL
            {value(f":mode <> 1 AND {active}", "3")}
            LIMIT 1
        ) AS s
    ) AS b
    UNION ALL
    SELECT x.tenant, x.phase, s.n + 1, s.found + x.runnable, x.runnable
    FROM scan AS s CROSS JOIN LATERAL (
        SELECT y.tenant, y.phase, {runnable("y")} AS runnable FROM (
            {value(f"s.phase <> 2 AND j.{c} > s.tenant", "s.phase")}
            UNION ALL
            {untenanted("s.phase = 1")}
            UNION ALL
            {value("s.phase < 3 AND :mode <> 1", "3")}
            LIMIT 1
        ) AS y
    ) AS x
    WHERE s.found < :most AND s.n < :cap
      AND NOT coalesce(x.phase = 3 AND :mode = 2 AND x.tenant > {after}, false)
)
SELECT s.tenant, s.runnable = 1 AS due FROM scan AS s ORDER BY s.n"""
    return text(sql).bindparams(
        bindparam("queue_name", type_=Text),
        bindparam("after", type_=table.c[column].type),
        bindparam("mode", type_=Integer),
        bindparam("most", type_=Integer),
        bindparam("cap", type_=Integer),
    )


def _tenant_read(table: Table, c: str, *, match: str, after: str = "", limit: str) -> str:
    """One tenant's next runnable jobs in ``(priority, run_at, id)`` order, ``limit`` at
    most, locked ``FOR UPDATE SKIP LOCKED`` as they are read (a subquery per form of the
    tenant: ``match`` is the column's condition)."""
    t = qualified_name(table.name, table.schema)
    return f"""SELECT j.id, j.priority, j.run_at FROM {t} AS j
            WHERE {_plain_pending()} AND {match}
              AND j.run_at <= statement_timestamp(){after}
            ORDER BY j.{c}, j.priority, j.run_at, j.id LIMIT {limit}
            FOR UPDATE OF j SKIP LOCKED"""


def _tenant_reads(table: Table, c: str, tenant: str, *, after: str = "", limit: str) -> str:
    # A tenant's read: its value's (an index range), or, for the NULL tenant, the jobs whose
    # column is NULL (the other branch: a one-time filter on the tenant, so one of the two
    # runs).
    # Written as a range, not ``= tenant``: an equality would make the column a constant of
    # the read's order, which the pending index (queue, priority, run_at, id) then also
    # gives; on statistics taken when one tenant had every job, PostgreSQL picked it and
    # filtered that tenant's whole backlog for each other tenant (tests/test_fair_plan.py).
    value = _tenant_read(
        table, c, match=f"j.{c} >= {tenant} AND j.{c} <= {tenant}", after=after, limit=limit
    )
    null = _tenant_read(
        table, c, match=f"{tenant} IS NULL AND j.{c} IS NULL", after=after, limit=limit
    )
    return f"""SELECT a.* FROM ({value}) AS a
        UNION ALL
        SELECT b.* FROM ({null}) AS b"""


@json_text_on_asyncpg
def claim_fair(
    table: Table, *, column: str, limited: bool = False, json_text: bool = False
) -> Update:
    """Claim up to ``:limit`` jobs of the queue ``:queue_name`` shared fairly over the
    tenants in ``:tenants`` (:func:`fair_tenants`'s, in turn, with their ``:weights``), and
    start an attempt on each, as :func:`~sqla_jobs._queries.claim` does.

    The rule: a tenant of weight ``w`` has ``w`` jobs in each round; the claim takes round
    by round (within a round, tenant by tenant in ``:tenants``'s order) until it has
    ``:limit``. So every tenant's first job comes before any tenant's second, and a tenant
    with 100,000 jobs in line takes no more of a claim than one with ten, unless the others
    have run out. Within a tenant, jobs go in ``(priority, run_at, id)`` order. Expired
    leases of the queue (jobs without an ordering key; their workers died) come first, as
    in the plain claim, whoever their tenant.

    How: each tenant reads its share of ``:limit`` (by weight, rounded up) from the fair
    index, locking ``FOR UPDATE SKIP LOCKED`` as it reads; when the tenants that had fewer
    jobs than their share left the claim short, the tenants that filled theirs read on past
    their last job, each its share (by weight) of what is missing. Rows read but not
    claimed stay locked until the transaction ends (at most one per tenant and round
    short of the shares: keep it short, as every claim).

    ``limited``: a limited queue (``:queue_slots``, its lock held), as for
    :func:`~sqla_jobs._queries.claim`.

    Parameters: ``:queue_name``, ``:tenants`` (an array of the column's type), ``:weights``
    (``integer[]``), ``:limit``, ``:lease_seconds``, ``:worker`` (and ``:queue_slots``).
    """
    t = qualified_name(table.name, table.schema)
    c, kind = _tenant_column(table, column)
    running = JobStatus.RUNNING.value
    now = "statement_timestamp()"
    paused = paused_predicate(table, ":queue_name")
    share = "(:limit * k.weight + k.total - 1) / k.total"
    first = _tenant_reads(table, c, "k.tenant", limit=share)
    more = _tenant_reads(
        table,
        c,
        "f.tenant",
        after="\n              AND (j.priority, j.run_at, j.id) > (f.priority, f.run_at, f.id)",
        limit="greatest(0, (w.wanted * f.weight + w.total - 1) / w.total)",
    )
    cut = limited_count(table) if limited else ":limit"
    chosen = (
        text(
            f"""WITH k AS MATERIALIZED (
    SELECT k.tenant, k.weight, k.n, sum(k.weight) OVER () AS total
    FROM unnest(CAST(:tenants AS {kind}[]), CAST(:weights AS integer[]))
        WITH ORDINALITY AS k (tenant, weight, n)
    WHERE NOT {paused}
), first AS MATERIALIZED (
    SELECT k.n, k.tenant, k.weight, {share} AS share, r.*
    FROM k CROSS JOIN LATERAL (
        SELECT f.id, f.priority, f.run_at,
            row_number() OVER (ORDER BY f.priority, f.run_at, f.id) AS rank
        FROM ({first}) AS f
    ) AS r
), filled AS MATERIALIZED (
    -- Each tenant that had its whole share: its last job read.
    SELECT f.* FROM first AS f WHERE f.rank = f.share
), more AS MATERIALIZED (
    SELECT f.n, f.weight, r.id, r.priority, r.run_at, f.rank + r.rank AS rank
    FROM filled AS f
    CROSS JOIN (
        SELECT :limit - (SELECT count(*) FROM first) AS wanted,
            (SELECT sum(g.weight) FROM filled AS g) AS total
    ) AS w
    CROSS JOIN LATERAL (
        SELECT m.id, m.priority, m.run_at,
            row_number() OVER (ORDER BY m.priority, m.run_at, m.id) AS rank
        FROM ({more}) AS m
    ) AS r
), expired AS MATERIALIZED (
    SELECT j.id, j.priority, j.run_at FROM {t} AS j
    WHERE j.status = '{running}' AND j.queue = :queue_name AND j.lease_expires_at <= {now}
      AND j.run_at <= {now} AND j.ordering_key IS NULL AND NOT {paused}
    ORDER BY j.lease_expires_at LIMIT :limit
    FOR UPDATE OF j SKIP LOCKED
)
SELECT c.id FROM (
    SELECT e.id, 0 AS round, 0 AS n, e.priority, e.run_at FROM expired AS e
    UNION ALL
    SELECT f.id, (f.rank + f.weight - 1) / f.weight, f.n, f.priority, f.run_at FROM first AS f
    UNION ALL
    SELECT m.id, (m.rank + m.weight - 1) / m.weight, m.n, m.priority, m.run_at FROM more AS m
) AS c
ORDER BY c.round, c.n, c.priority, c.run_at, c.id
LIMIT {cut}"""
        )
        .bindparams(
            bindparam("tenants", type_=ARRAY(table.c[column].type)),
            bindparam("weights", type_=ARRAY(Integer)),
            *(_limited_params() if limited else [bindparam("limit", type_=Integer)]),
            *([] if limited else [bindparam("queue_name", type_=Text)]),
        )
        .columns(result_column("id", BigInteger))
        .cte("claimable")
    )
    return _start_attempts(table, chosen, listed=True, json_text=json_text)


# -- the queries --------------------------------------------------------------------------


class FairTenantsParams(TypedDict):
    """:func:`fair_tenants`'s parameters."""

    queue_name: str
    after: Any
    mode: int
    most: int
    cap: int


class _ClaimFairRequired(TypedDict):
    queue_name: str
    tenants: list[Any]
    weights: list[int]
    limit: int
    lease_seconds: float
    worker: str


class ClaimFairParams(_ClaimFairRequired, total=False):
    """:func:`claim_fair`'s parameters (a limited queue's also ``queue_slots``)."""

    queue_slots: int


class TenantRow(NamedTuple):
    """A tenant :func:`fair_tenants` passed (NULL: the jobs without one), and whether it has a
    job due."""

    tenant: Any
    due: bool


FAIR_TENANTS: Final = Query(fair_tenants, FairTenantsParams, TenantRow)
CLAIM_FAIR: Final = Query(claim_fair, ClaimFairParams, ClaimRow)


# -- how deep each tenant is (the gauges of a fairly shared queue) -----------------------------


def tenant_depths(table: Table, *, column: str) -> TextClause:
    """How deep the tenants of the queue ``:queue_name`` are: its pending jobs without an
    ordering key (due or not) by the value of ``column``, the jobs whose column is NULL one
    tenant of their own (as in the fair claim). One row per tenant among the ``:top``
    deepest, most jobs first (a tie in the column's order, NULL first): ``tenant`` and its
    ``tenant_pending``, each row with ``tenants``, how many tenants have such jobs, and
    ``pending``, how many jobs they have in all; when none has, one row of totals, its
    ``tenant`` and ``tenant_pending`` NULL.

    One read of the fair index (``queue, <column>, ...``, its predicate repeated with
    literal values so that it applies to a generic plan too): an index-only scan where the
    visibility map allows, grouped in the index's order, so its cost grows with the queue's
    pending jobs and never with the history. Takes no lock.

    Parameters: ``:queue_name``, ``:top``.
    """
    t = qualified_name(table.name, table.schema)
    c, _ = _tenant_column(table, column)
    sql = f"""WITH g AS MATERIALIZED (
    SELECT j.{c} AS tenant, count(*) AS pending
    FROM {t} AS j
    WHERE {_plain_pending()}
    GROUP BY j.{c}
)
SELECT a.tenants, a.pending, d.tenant, d.pending AS tenant_pending
FROM (
    SELECT count(*)::integer AS tenants, coalesce(sum(g.pending), 0)::bigint AS pending
    FROM g
) AS a
LEFT JOIN LATERAL (
    SELECT g.tenant, g.pending FROM g
    ORDER BY g.pending DESC, g.tenant NULLS FIRST
    LIMIT :top
) AS d ON true
ORDER BY d.pending DESC, d.tenant NULLS FIRST"""
    return text(sql).bindparams(
        bindparam("queue_name", type_=Text), bindparam("top", type_=Integer)
    )


class TenantDepthsParams(TypedDict):
    """:func:`tenant_depths`'s parameters."""

    queue_name: str
    top: int


class TenantDepthRow(NamedTuple):
    """One of the deepest tenants of :func:`tenant_depths` (``tenant`` as the column's type
    reads; NULL: the jobs without one), with the queue's totals; with no tenant at all, the
    totals alone (``tenant_pending`` None)."""

    tenants: int
    pending: int
    tenant: Any
    tenant_pending: int | None


TENANT_DEPTHS: Final = Query(tenant_depths, TenantDepthsParams, TenantDepthRow)
