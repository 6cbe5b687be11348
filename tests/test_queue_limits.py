"""Per-queue concurrency limits in the claim: at most N running jobs of a limited queue,
counted over live attempts only (an expired lease frees its slot and its takeover must fit),
a lock-held attempt keeps its slot past its lease, claimers serialised by a try-lock that
skips and never waits, keyed jobs under both limits, and bad limits refused before SQL."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from in_process import enqueue
from models import EmailJob
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from worker_harness import wait_until

import sqla_jobs
from sqla_jobs import ClaimedJob, aio
from sqla_jobs.errors import ConfigurationError, InvalidJobError
from sqla_jobs.registry import Registry

LIMITS = {"limited": 2}


def claim(engine: sa.Engine, *, limit: int = 10, **options: Any) -> list[ClaimedJob]:
    options = {"queues": ["limited", "default"], "queue_limits": LIMITS, **options}
    with engine.begin() as connection:
        return sqla_jobs.claim(connection, EmailJob, limit=limit, **options)


def finish(engine: sa.Engine, *jobs: ClaimedJob) -> None:
    with engine.begin() as connection:
        assert sqla_jobs.complete_many(connection, list(jobs)) == []


def running(engine: sa.Engine, queue: str) -> int:
    """The queue's running jobs whose lease is live, by the database's clock."""
    with engine.connect() as connection:
        return int(
            connection.execute(
                sa.select(sa.func.count())
                .select_from(EmailJob)
                .where(
                    EmailJob.queue == queue,
                    EmailJob.status == "running",
                    EmailJob.lease_expires_at > sa.func.statement_timestamp(),
                )
            ).scalar_one()
        )


def leases_expired(engine: sa.Engine, *jobs: ClaimedJob) -> bool:
    with engine.connect() as connection:
        return bool(
            connection.execute(
                sa.select(
                    sa.func.bool_and(EmailJob.lease_expires_at <= sa.func.statement_timestamp())
                ).where(EmailJob.id.in_([job.id for job in jobs]))
            ).scalar_one()
        )


def test_a_queue_limit_caps_its_running_jobs_and_leaves_other_queues_alone(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, *(EmailJob(task=f"l{i}", queue="limited") for i in range(5)))
    enqueue(queue_engine, *(EmailJob(task=f"d{i}") for i in range(4)))
    first = claim(queue_engine)
    assert sorted(job.task for job in first) == ["d0", "d1", "d2", "d3", "l0", "l1"]
    assert claim(queue_engine) == []  # full
    finish(queue_engine, next(job for job in first if job.task == "l1"))
    assert [job.task for job in claim(queue_engine)] == ["l2"]
    assert running(queue_engine, "limited") == 2
    # A claim that does not pass the limits is not bound by them (declare them once, in
    # code every worker shares).
    assert len(claim(queue_engine, queue_limits=None)) == 2


def test_the_limited_queue_is_served_first_and_the_batch_filled_from_the_others(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, *(EmailJob(task=f"d{i}", priority=-10) for i in range(5)))
    enqueue(queue_engine, *(EmailJob(task=f"l{i}", queue="limited") for i in range(5)))
    jobs = claim(queue_engine, limit=3)
    # A busy unlimited queue does not starve the limited one.
    assert sorted(job.task for job in jobs) == ["d0", "l0", "l1"]


def test_an_expired_lease_frees_its_slot_and_its_takeover_fits_in_the_limit(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, *(EmailJob(task=f"l{i}", queue="limited") for i in range(3)))
    first = claim(queue_engine, lease=0.3)
    assert [job.task for job in first] == ["l0", "l1"]
    assert claim(queue_engine) == []  # live leases hold both slots
    wait_until(lambda: leases_expired(queue_engine, *first), timeout=10, message="leases end")
    again = claim(queue_engine)  # their worker died: the attempts are taken over first
    assert [(job.task, job.attempt) for job in again] == [("l0", 2), ("l1", 2)]
    assert claim(queue_engine) == []  # and the takeovers hold the slots: l2 waits
    with queue_engine.begin() as connection, pytest.raises(sqla_jobs.LeaseLostError):
        sqla_jobs.complete(connection, first[0])
    finish(queue_engine, *again)
    assert [job.task for job in claim(queue_engine)] == ["l2"]


def test_an_expired_lease_of_another_queue_does_not_count(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="other"))
    (other,) = claim(queue_engine, lease=0.2, queues=["default"])
    wait_until(lambda: leases_expired(queue_engine, other), timeout=10, message="lease ends")
    enqueue(queue_engine, *(EmailJob(task=f"l{i}", queue="limited") for i in range(3)))
    assert [job.task for job in claim(queue_engine, queues=["limited"])] == ["l0", "l1"]


def test_a_lock_held_attempt_keeps_its_slot_after_its_lease(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *(EmailJob(task=f"l{i}", queue="limited") for i in range(3)))
    with Session(queue_engine) as holder, holder.begin():
        held = sqla_jobs.claim(
            holder, EmailJob, queues="limited", limit=5, hold=True, lease=0.2, queue_limits=LIMITS
        )
        assert [job.task for job in held] == ["l0", "l1"]
        wait_until(lambda: leases_expired(queue_engine, *held), timeout=10, message="leases end")
        # The leases ran out, but the rows are locked: the attempts are still live.
        assert claim(queue_engine) == []
        sqla_jobs.complete(holder, held[0])
    # l0 done; l1's lock went with the transaction and its lease is over: taken over.
    assert [(job.task, job.attempt) for job in claim(queue_engine)] == [("l1", 2), ("l2", 1)]


def test_a_claim_skips_a_limited_queue_another_claim_is_locking(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, *(EmailJob(task=f"l{i}", queue="limited") for i in range(3)))
    enqueue(queue_engine, EmailJob(task="d0"))
    limits = {"limited": 3}
    with queue_engine.connect() as first:
        with first.begin():
            taken = sqla_jobs.claim(first, EmailJob, queues="limited", limit=2, queue_limits=limits)
            assert len(taken) == 2
            with queue_engine.begin() as second:
                # Waiting for the lock would fail here rather than hang the test.
                second.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
                # The queue is locked by the open claim: skipped, and the rest still served.
                jobs = sqla_jobs.claim(
                    second, EmailJob, queues=["limited", "default"], queue_limits=limits, limit=5
                )
                assert [job.task for job in jobs] == ["d0"]
        # Committed: the next claim sees the two running and takes the one slot left.
        assert [job.task for job in claim(queue_engine, queue_limits=limits)] == ["l2"]


def test_keyed_jobs_in_a_limited_queue_respect_both_limits(queue_engine: sa.Engine) -> None:
    enqueue(
        queue_engine,
        *(EmailJob(task=f"k{i}", queue="limited", ordering_key="k", key_limit=3) for i in range(4)),
        *(EmailJob(task=f"p{i}", queue="limited") for i in range(2)),
    )
    first = claim(queue_engine, keys=True, queue_limits={"limited": 2}, queues="limited")
    assert [job.task for job in first] == ["k0", "k1"]  # the queue's limit, under the key's
    assert claim(queue_engine, keys=True, queue_limits={"limited": 2}) == []
    wider = claim(queue_engine, keys=True, queue_limits={"limited": 10}, queues="limited")
    assert sorted(job.task for job in wider) == ["k2", "p0", "p1"]  # the key's limit: 3
    assert running(queue_engine, "limited") == 5


def test_a_keyed_claim_counts_its_queue_slots_with_its_keys(queue_engine: sa.Engine) -> None:
    jobs = (EmailJob(task=f"k{i}", queue="limited", ordering_key=f"k{i}") for i in range(4))
    enqueue(queue_engine, *jobs)
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(args[2])

    options: dict[str, Any] = {"keys": True, "queues": "limited", "limit": 5}
    sa.event.listen(queue_engine, "before_cursor_execute", record)
    try:
        first = claim(queue_engine, **options)
        claimed = list(seen)
        seen.clear()
        with queue_engine.connect() as full, full.begin():
            second = sqla_jobs.claim(full, EmailJob, queue_limits=LIMITS, **options)
            counted = list(seen)
            # While the full queue's claim is open, its keys are free for a claim that
            # does not limit the queue: the count locked none of them.
            with queue_engine.begin() as other:
                unlimited = sqla_jobs.claim(other, EmailJob, **options)
    finally:
        sa.event.remove(queue_engine, "before_cursor_execute", record)
    assert [job.task for job in first] == ["k0", "k1"]  # two free slots, of the four keys
    # The queue's lock, its free slots and its keys' locks; the keyed claim, which counts
    # the free slots again, exactly (the first count's snapshot is older than the lock).
    assert len(claimed) == 2
    assert "pg_try_advisory_xact_lock" in claimed[0]
    assert second == []
    assert len(counted) == 1  # full: the queue's lock and the count, and nothing else
    assert sorted(job.task for job in unlimited) == ["k2", "k3"]


def test_the_plain_claim_runs_the_same_sql_when_no_served_queue_is_limited(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, *(EmailJob(task=f"d{i}") for i in range(4)))
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(args[2])

    sa.event.listen(queue_engine, "before_cursor_execute", record)
    try:
        claim(queue_engine, limit=2, queues="default", queue_limits=None)
        plain = list(seen)
        seen.clear()
        claim(queue_engine, limit=2, queues="default", queue_limits={"limited": 3})
    finally:
        sa.event.remove(queue_engine, "before_cursor_execute", record)
    assert len(plain) == 1
    assert seen == plain


async def test_the_async_claim_takes_queue_limits(queue_async_engine: AsyncEngine) -> None:
    async with AsyncSession(queue_async_engine) as session, session.begin():
        session.add_all([EmailJob(task=f"l{i}", queue="limited") for i in range(3)])
    async with AsyncSession(queue_async_engine) as session, session.begin():
        jobs = await aio.claim(session, EmailJob, queues="limited", limit=5, queue_limits=LIMITS)
    assert [job.task for job in jobs] == ["l0", "l1"]


BAD_LIMITS: list[tuple[object, str]] = [
    ({"limited": 0}, r"must be in \[1, 1000000\], got 0"),
    ({"limited": -1}, r"must be in \[1, 1000000\]"),
    ({"limited": 1_000_001}, r"must be in \[1, 1000000\]"),
    ({"limited": True}, "must be an integer, not bool"),
    ({"limited": "3"}, "must be an integer, not str"),
    ({"limited": 1.5}, "must be an integer, not float"),
    ({"": 3}, "must not be empty"),
    ({"bad name": 3}, "malformed"),
    ({3: 3}, "must be a string"),
    ([("limited", 3)], "must be a mapping of queue names to limits, not list"),
    (3, "must be a mapping"),
    ({"limited"}, "must be a mapping"),
]


@pytest.mark.parametrize(("limits", "message"), BAD_LIMITS)
def test_bad_queue_limits_are_refused_before_any_sql(limits: object, message: str) -> None:
    # No session at all: the check runs before anything would be sent.
    with pytest.raises(InvalidJobError, match=message):
        sqla_jobs.claim(None, EmailJob, queue_limits=limits)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="queue_limits: .*" + message):
        Registry(EmailJob, queue_limits=limits)  # type: ignore[arg-type]


def test_the_registry_keeps_a_read_only_copy_of_its_queue_limits() -> None:
    limits = {"emails": 3}
    registry = Registry(EmailJob, queue_limits=limits)
    limits["emails"] = 100
    assert dict(registry.queue_limits) == {"emails": 3}
    with pytest.raises(TypeError):
        registry.queue_limits["emails"] = 4  # type: ignore[index]
    assert dict(Registry(EmailJob).queue_limits) == {}
