"""Fair shares across tenants (issue 24 item 2): each claim of a fairly shared queue serves its
tenants round robin (every tenant's first job before any tenant's second; ``weight`` jobs a
round), a process's claims go round the ring of tenants, priorities order jobs within a
tenant, expired leases come first, queue limits, ordering keys and lock-held claims still
hold, concurrent claimers take disjoint jobs, and bad input is refused before any SQL."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import advance_clock
from in_process import enqueue, running
from models import EmailJob, TenantJob
from no_sql import no_sql
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import ClaimedJob, FairShare, JobContext, Worker, aio
from sqla_jobs._queries import claiming
from sqla_jobs.errors import ConfigurationError, InvalidJobError
from sqla_jobs.registry import Registry

FAIR = {"default": FairShare("tenant")}


@pytest.fixture(autouse=True)
def _ring_from_its_start() -> Iterator[None]:
    """Each test's claims go round the tenants from the ring's start (the process keeps its
    place per table and queue, :data:`~sqla_jobs._queries.claiming.FAIR_RINGS`)."""
    claiming.FAIR_RINGS.clear()
    yield
    claiming.FAIR_RINGS.clear()


def jobs_of(tenant: str | None, count: int, **fields: Any) -> list[TenantJob]:
    return [TenantJob(task=f"{tenant}-{n}", tenant=tenant, **fields) for n in range(count)]


def claim(engine: sa.Engine, limit: int, **options: Any) -> list[ClaimedJob]:
    options = {"fair_shares": FAIR, **options}
    with engine.begin() as connection:
        return sqla_jobs.claim(connection, TenantJob, limit=limit, **options)


def tenants(engine: sa.Engine, jobs: list[ClaimedJob]) -> Counter[str | None]:
    """How many of ``jobs`` each tenant has."""
    with engine.connect() as connection:
        rows = connection.execute(
            sa.select(TenantJob.tenant).where(TenantJob.id.in_([job.id for job in jobs]))
        )
        return Counter(rows.scalars())


def first_claims(engine: sa.Engine) -> dict[str | None, int]:
    """Per tenant, the claim (1 for the first) that started its first job, from SQL: every
    job of one claim has the claim statement's time as its attempted_at."""
    ranked = (
        sa.select(
            TenantJob.tenant,
            sa.func.dense_rank().over(order_by=TenantJob.attempted_at).label("claim"),
        )
        .where(TenantJob.attempted_at.is_not(None))
        .subquery()
    )
    rows = sa.select(ranked.c.tenant, sa.func.min(ranked.c.claim)).group_by(ranked.c.tenant)
    with engine.connect() as connection:
        return {tenant: int(claim) for tenant, claim in connection.execute(rows)}


def test_every_tenant_s_first_job_comes_before_any_tenant_s_second(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, *jobs_of("big", 200))
    for small in "abcde":
        enqueue(queue_engine, *jobs_of(small, 3))
    for _ in range(3):
        assert tenants(queue_engine, claim(queue_engine, 6)) == dict.fromkeys("abcde", 1) | {
            "big": 1
        }
    # The small tenants have run out: the big one has the claims to itself.
    assert tenants(queue_engine, claim(queue_engine, 6)) == {"big": 6}
    # The plain claim, for contrast: the oldest jobs first, all the big tenant's.
    assert tenants(queue_engine, claim(queue_engine, 6, fair_shares=None)) == {"big": 6}


def test_behind_a_big_backlog_every_small_tenant_starts_within_two_claims(
    queue_engine: sa.Engine,
) -> None:
    """The issue's case, scaled down: one tenant's backlog enqueued first, then 50 tenants
    with 10 jobs each; claims of 50 in turn. From SQL: every small tenant's first job
    started in the first two claims (51 tenants, 50 a claim: one waits for the second)."""
    enqueue(queue_engine, *jobs_of("big", 2_000))
    smalls = [f"t{n:02d}" for n in range(50)]
    for small in smalls:
        enqueue(queue_engine, *jobs_of(small, 10))
    for _ in range(4):
        assert len(claim(queue_engine, 50)) == 50
    firsts = first_claims(queue_engine)
    assert max(firsts[small] for small in smalls) == 2
    assert firsts["big"] == 1


def test_the_plain_claim_leaves_the_small_tenants_behind_the_backlog(
    queue_engine: sa.Engine,
) -> None:
    """The same case without fair shares, to show what the fair claim changes."""
    enqueue(queue_engine, *jobs_of("big", 200))
    enqueue(queue_engine, *jobs_of("small", 10))
    for _ in range(4):
        assert tenants(queue_engine, claim(queue_engine, 50, fair_shares=None)) == {"big": 50}


def test_while_one_tenant_has_the_queue_a_new_tenant_waits_at_most_fair_alone(
    queue_engine: sa.Engine,
) -> None:
    """With one due tenant, the ring is not looked at again for FAIR_ALONE seconds (plain
    claims, which take the same jobs); a tenant arriving meanwhile has its turn after that."""
    enqueue(queue_engine, *jobs_of("big", 50))
    assert tenants(queue_engine, claim(queue_engine, 2)) == {"big": 2}
    enqueue(queue_engine, *jobs_of("new", 3))
    time.sleep(claiming.FAIR_ALONE)
    assert tenants(queue_engine, claim(queue_engine, 2)) == {"big": 1, "new": 1}


def test_a_claim_that_comes_back_short_ends_the_tenant_s_time_alone(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, *jobs_of("big", 2))
    assert tenants(queue_engine, claim(queue_engine, 2)) == {"big": 2}  # alone, and full
    assert claim(queue_engine, 2) == []  # short: the next claim looks at the ring again
    enqueue(queue_engine, *jobs_of("big", 5), *jobs_of("new", 2))
    assert tenants(queue_engine, claim(queue_engine, 2)) == {"big": 1, "new": 1}


def test_with_more_tenants_than_a_claim_the_claims_go_round_the_ring(
    queue_engine: sa.Engine,
) -> None:
    names = [f"t{n:02d}" for n in range(30)]
    for name in names:
        enqueue(queue_engine, *jobs_of(name, 3))
    seen: Counter[str | None] = Counter()
    for _ in range(3):
        got = tenants(queue_engine, claim(queue_engine, 10))
        assert sum(got.values()) == 10
        assert set(got.values()) == {1}
        seen.update(got)
    assert seen == dict.fromkeys(names, 1)  # each once, none twice before all had a turn
    # And on, round the ring again: a claim of one takes the next tenant in turn.
    assert tenants(queue_engine, claim(queue_engine, 1)) == {"t00": 1}
    assert tenants(queue_engine, claim(queue_engine, 1)) == {"t01": 1}


def test_a_tenant_of_weight_three_has_three_jobs_a_round(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs_of("heavy", 20), *jobs_of("light", 20), *jobs_of("other", 20))
    weighted = {"default": FairShare("tenant", weights={"heavy": 3})}
    for _ in range(3):
        got = tenants(queue_engine, claim(queue_engine, 5, fair_shares=weighted))
        assert got == {"heavy": 3, "light": 1, "other": 1}


def test_priorities_order_the_jobs_within_a_tenant(queue_engine: sa.Engine) -> None:
    enqueue(
        queue_engine,
        *(TenantJob(task=f"a{p}", tenant="a", priority=p) for p in (5, 0, 3)),
        *(TenantJob(task=f"b{p}", tenant="b", priority=p) for p in (9, 1)),
    )
    order = [sorted(job.task for job in claim(queue_engine, 2)) for _ in range(3)]
    assert order == [["a0", "b1"], ["a3", "b9"], ["a5"]]


def test_jobs_without_a_tenant_are_one_tenant_of_the_ring(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs_of(None, 5), *jobs_of("x", 5), *jobs_of("y", 5))
    for _ in range(2):
        assert tenants(queue_engine, claim(queue_engine, 3)) == {None: 1, "x": 1, "y": 1}
    # Round the ring one at a time: the NULL tenant has its turn like the others.
    one_by_one = [next(iter(tenants(queue_engine, claim(queue_engine, 1)))) for _ in range(4)]
    assert one_by_one == [None, "x", "y", None]


def test_a_tenant_with_nothing_due_is_passed_and_the_claim_still_fills(
    queue_engine: sa.Engine,
) -> None:
    with Session(queue_engine) as session:
        later = session.execute(sa.select(sa.func.now() + timedelta(hours=1))).scalar_one()
    enqueue(queue_engine, *jobs_of("a-later", 30, run_at=later))
    enqueue(queue_engine, *jobs_of("b", 5), *jobs_of("c", 5))
    assert tenants(queue_engine, claim(queue_engine, 2)) == {"b": 1, "c": 1}
    advance_clock(queue_engine, TenantJob, 2 * 3600)
    assert tenants(queue_engine, claim(queue_engine, 3)) == {"a-later": 1, "b": 1, "c": 1}


def test_an_expired_lease_is_taken_over_first(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs_of("a", 3), *jobs_of("b", 3))
    (crashed,) = claim(queue_engine, 1, fair_shares=None)
    advance_clock(queue_engine, TenantJob, 3600)  # its lease runs out
    taken = claim(queue_engine, 3)
    assert [(job.id, job.attempt) for job in taken if job.id == crashed.id] == [(crashed.id, 2)]
    assert tenants(queue_engine, taken) == {"a": 2, "b": 1}


def test_a_paused_fair_queue_is_not_claimed(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs_of("a", 3), *jobs_of("b", 3))
    with queue_engine.begin() as connection:
        sqla_jobs.pause_queue(connection, TenantJob, "default")
    assert claim(queue_engine, 4) == []
    with queue_engine.begin() as connection:
        sqla_jobs.resume_queue(connection, TenantJob, "default")
    assert tenants(queue_engine, claim(queue_engine, 4)) == {"a": 2, "b": 2}


def test_a_queue_limit_holds_within_a_fair_share(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *jobs_of("a", 10), *jobs_of("b", 10), *jobs_of("c", 10))
    first = claim(queue_engine, 10, queue_limits={"default": 4})
    assert len(first) == 4
    assert set(tenants(queue_engine, first)) == {"a", "b", "c"}
    assert claim(queue_engine, 10, queue_limits={"default": 4}) == []
    with queue_engine.begin() as connection:
        assert sqla_jobs.complete_many(connection, first[:2]) == []
    assert len(claim(queue_engine, 10, queue_limits={"default": 4})) == 2


def test_keyed_jobs_keep_their_keys_and_fill_before_the_fair_share(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, *jobs_of("a", 4, ordering_key="k"), *jobs_of("b", 4), *jobs_of("c", 4))
    got = claim(queue_engine, 5, keys=True)
    # The key's one job (key_limit 1), then the others shared: two rounds of b and c.
    assert sorted(job.task for job in got) == ["a-0", "b-0", "b-1", "c-0", "c-1"]


@pytest.mark.parametrize("hold", [False, True])
def test_lock_held_and_lease_mode_claims_share_alike(queue_engine: sa.Engine, hold: bool) -> None:
    enqueue(queue_engine, *jobs_of("a", 5), *jobs_of("b", 5), *jobs_of("c", 5))
    with Session(queue_engine) as session, session.begin():
        got = sqla_jobs.claim(session, TenantJob, limit=6, hold=hold, fair_shares=FAIR)
        assert tenants(queue_engine, got) == {"a": 2, "b": 2, "c": 2}
        assert sqla_jobs.complete_many(session, got) == []


def test_concurrent_fair_claimers_take_disjoint_jobs_and_drain_the_queue(
    queue_engine: sa.Engine,
) -> None:
    for n in range(20):
        enqueue(queue_engine, *jobs_of(f"t{n:02d}", 50))
    claimed: list[int] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def claimer() -> None:
        try:
            with queue_engine.connect() as connection:
                while True:
                    with connection.begin():
                        got = sqla_jobs.claim(connection, TenantJob, limit=7, fair_shares=FAIR)
                    if not got:
                        return
                    with connection.begin():
                        assert sqla_jobs.complete_many(connection, got) == []
                    with guard:
                        claimed.extend(job.id for job in got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claimer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert not any(thread.is_alive() for thread in threads)
    assert len(claimed) == len(set(claimed)) == 1_000
    with queue_engine.connect() as connection:
        statuses = connection.execute(
            sa.select(TenantJob.status, TenantJob.attempts, sa.func.count()).group_by(
                TenantJob.status, TenantJob.attempts
            )
        ).all()
    assert [tuple(row) for row in statuses] == [("succeeded", 1, 1_000)]


def test_a_worker_of_a_registry_with_fair_shares_runs_every_tenant_s_jobs(
    queue_engine: sa.Engine,
) -> None:
    registry = Registry(TenantJob, fair_shares=FAIR)
    ran: list[int] = []
    guard = threading.Lock()

    @registry.task(name="noop")
    def noop(ctx: JobContext) -> None:
        with guard:
            ran.append(ctx.id)

    enqueue(queue_engine, *(TenantJob(task="noop", tenant=f"t{n % 7}") for n in range(70)))
    with running(registry, queue_engine, concurrency=4):
        wait_until(lambda: len(ran) == 70, timeout=60, message="the 70 jobs to run")
    assert len(set(ran)) == 70
    assert registry.fair_shares == FAIR


async def test_the_async_claim_shares_alike(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        session.add_all([*jobs_of("a", 4), *jobs_of("b", 4)])
    async with AsyncSession(queue_async_engine) as session, session.begin():
        got = await aio.claim(session, TenantJob, limit=4, fair_shares=FAIR)
        rows = await session.execute(
            sa.select(TenantJob.tenant).where(TenantJob.id.in_([job.id for job in got]))
        )
        assert Counter(rows.scalars()) == {"a": 2, "b": 2}


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: FairShare(3), "FairShare.column must be a column name"),  # type: ignore[arg-type]
        (lambda: FairShare("tenant id"), "FairShare.column must be a column name"),
        (lambda: FairShare("tenant", weights=[("a", 2)]), "must be a mapping"),  # type: ignore[arg-type]
        (lambda: FairShare("tenant", weights={"a": 0}), r"weight of 'a' must be in \[1, 1000\]"),
        (lambda: FairShare("tenant", weights={"a": 2.5}), "weight of 'a' must be an integer"),  # type: ignore[dict-item]
        (lambda: FairShare("tenant", weights={"a": True}), "weight of 'a' must be an integer"),
        (lambda: Registry(TenantJob, fair_shares={"q": 3}), "fair_shares: .* must be a FairShare"),  # type: ignore[dict-item]
        (lambda: Registry(TenantJob, fair_shares={"": FairShare("tenant")}), "fair_shares"),
    ],
)
def test_bad_fair_shares_are_refused(make: Any, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        make()


def test_weights_are_copied_and_read_only() -> None:
    weights = {"a": 2}
    share = FairShare("tenant", weights=weights)
    weights["a"] = 5
    assert share.weight("a") == 2
    assert share.weight("b") == 1
    with pytest.raises(TypeError):
        share.weights["a"] = 3  # type: ignore[index]


@pytest.mark.parametrize(
    ("fair_shares", "says"),
    [
        ({"default": FairShare("nope")}, "shares by column 'nope', which tenant_jobs has not"),
        ({"default": FairShare("ordering_key")}, "cannot share by 'ordering_key'"),
        ({"default": FairShare("priority")}, "cannot share by 'priority'"),
        ({"default": "tenant"}, "must be a FairShare"),
        ([("default", FairShare("tenant"))], "must be a mapping"),
    ],
)
def test_a_claim_with_bad_fair_shares_runs_no_sql(
    queue_engine: sa.Engine, fair_shares: Any, says: str
) -> None:
    enqueue(queue_engine, *jobs_of("a", 2))
    with (
        Session(queue_engine) as session,
        no_sql(queue_engine),
        pytest.raises(InvalidJobError, match=says),
    ):
        sqla_jobs.claim(session, TenantJob, fair_shares=fair_shares)
    with queue_engine.connect() as connection:  # nothing claimed, nothing half written
        counts = connection.execute(
            sa.select(TenantJob.status, sa.func.count()).group_by(TenantJob.status)
        ).all()
    assert [tuple(row) for row in counts] == [("pending", 2)]


def test_a_worker_with_fair_shares_needs_the_column_and_its_fair_index(
    queue_engine: sa.Engine,
) -> None:
    without_index = Registry(EmailJob, fair_shares={"default": FairShare("order_id")})
    with pytest.raises(
        ConfigurationError,
        match=r"no fair index 'email_jobs_fair_order_id_idx'.*create_fair_index\('email_jobs'",
    ):
        Worker(without_index, queue_engine).run()
    # A registry given its model checks the column at once.
    with pytest.raises(ConfigurationError, match=r"fair_shares: .* column 'customer'"):
        Registry(TenantJob, fair_shares={"default": FairShare("customer")})
