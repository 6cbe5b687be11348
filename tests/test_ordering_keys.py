"""Ordering keys and per-key limits in the claim: order, one at a time, retries keep their
place, a future job blocks nobody, crashed attempts free their key, and the plain claim
never takes a keyed job."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import advance_clock
from in_process import enqueue
from models import EmailJob
from sqlalchemy.orm import Session

import sqla_jobs
from sqla_jobs import ClaimedJob
from sqla_jobs.errors import InvalidJobError


def claim(
    engine: sa.Engine, *, limit: int = 10, keys: bool = True, **options: Any
) -> list[ClaimedJob]:
    with engine.begin() as connection:
        return sqla_jobs.claim(connection, EmailJob, limit=limit, keys=keys, **options)


def finish(engine: sa.Engine, *jobs: ClaimedJob) -> None:
    with engine.begin() as connection:
        assert sqla_jobs.complete_many(connection, list(jobs)) == []


def test_same_key_jobs_run_one_at_a_time_in_order(queue_engine: sa.Engine) -> None:
    ids = enqueue(
        queue_engine,
        EmailJob(task="a1", ordering_key="customer:1"),
        EmailJob(task="b1", ordering_key="customer:2"),
        EmailJob(task="a2", ordering_key="customer:1", priority=-5),
        EmailJob(task="a3", ordering_key="customer:1"),
        EmailJob(task="plain"),
    )
    first = claim(queue_engine)
    # One per key (the best of each: a2 has the higher priority), and the plain job.
    assert sorted(job.task for job in first) == ["a2", "b1", "plain"]
    assert claim(queue_engine) == []  # both keys busy
    finish(queue_engine, *first)
    assert [job.task for job in claim(queue_engine)] == ["a1"]
    assert len(ids) == 5


def test_the_plain_claim_never_takes_a_keyed_job(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="keyed", ordering_key="k"), EmailJob(task="plain"))
    assert [job.task for job in claim(queue_engine, keys=False)] == ["plain"]
    assert claim(queue_engine, keys=False) == []
    assert [job.task for job in claim(queue_engine)] == ["keyed"]


def test_a_future_job_does_not_block_a_runnable_one(queue_engine: sa.Engine) -> None:
    # procrastinate#1599: the later job of the key is runnable now, the earlier one is not.
    enqueue(
        queue_engine,
        EmailJob(
            task="later",
            ordering_key="k",
            priority=-10,
            run_at=sa.func.now() + sa.text("interval '1 hour'"),
        ),
        EmailJob(task="now", ordering_key="k"),
    )
    assert [job.task for job in claim(queue_engine)] == ["now"]


def test_a_job_waiting_for_its_retry_keeps_its_place(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="first", ordering_key="k"))
    enqueue(queue_engine, EmailJob(task="second", ordering_key="k"))
    (first,) = claim(queue_engine)
    with queue_engine.begin() as connection:
        outcome = sqla_jobs.fail(connection, first, "boom", delay=0.5)
    assert outcome.will_retry
    # "second" is runnable and first in (priority, run_at, id) order now, but waits.
    assert claim(queue_engine) == []
    advance_clock(queue_engine, EmailJob, 0.6)
    (again,) = claim(queue_engine)
    assert (again.task, again.attempt) == ("first", 2)
    finish(queue_engine, again)
    assert [job.task for job in claim(queue_engine)] == ["second"]


@pytest.mark.parametrize("how", ["succeeded", "dead", "cancelled"])
def test_the_next_job_starts_when_the_previous_one_finished(
    queue_engine: sa.Engine, how: str
) -> None:
    enqueue(queue_engine, EmailJob(task="first", ordering_key="k", max_attempts=1))
    (second_id,) = enqueue(queue_engine, EmailJob(task="second", ordering_key="k"))
    (first,) = claim(queue_engine)
    assert claim(queue_engine) == []
    with queue_engine.begin() as connection:
        if how == "succeeded":
            sqla_jobs.complete(connection, first)
        elif how == "dead":
            assert not sqla_jobs.fail(connection, first, "boom").will_retry
        else:  # a pending job of the key cancelled: the next one does not wait for it
            sqla_jobs.release(connection, [first])
            sqla_jobs.cancel(connection, EmailJob, first.id)
    assert [job.id for job in claim(queue_engine)] == [second_id]


def test_an_expired_attempt_frees_its_key_by_being_taken_over_first(
    queue_engine: sa.Engine,
) -> None:
    enqueue(queue_engine, EmailJob(task="first", ordering_key="k"))
    enqueue(queue_engine, EmailJob(task="second", ordering_key="k"))
    (first,) = claim(queue_engine, lease=30)
    assert claim(queue_engine) == []  # a live lease holds the key
    advance_clock(queue_engine, EmailJob, 31)  # its worker died: the lease runs out
    (again,) = claim(queue_engine)
    assert (again.id, again.attempt) == (first.id, 2)
    assert claim(queue_engine) == []
    with queue_engine.begin() as connection:
        with pytest.raises(sqla_jobs.LeaseLostError):
            sqla_jobs.complete(connection, first)
        sqla_jobs.complete(connection, again)
    assert [job.task for job in claim(queue_engine)] == ["second"]


def test_a_lock_held_attempt_keeps_its_key_after_its_lease(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="first", ordering_key="k"))
    enqueue(queue_engine, EmailJob(task="second", ordering_key="k"))
    with Session(queue_engine) as holder, holder.begin():
        (first,) = sqla_jobs.claim(holder, EmailJob, keys=True, hold=True, lease=0.2)
        time.sleep(0.3)  # the lease ran out, but the row lock is held: still in progress
        assert claim(queue_engine) == []
        sqla_jobs.complete(holder, first)
    assert [job.task for job in claim(queue_engine)] == ["second"]


def test_a_key_limit_lets_that_many_run_at_once_in_order(queue_engine: sa.Engine) -> None:
    enqueue(
        queue_engine, *(EmailJob(task=f"j{i}", ordering_key="k", key_limit=3) for i in range(5))
    )
    first = claim(queue_engine)
    assert [job.task for job in first] == ["j0", "j1", "j2"]
    assert claim(queue_engine) == []
    finish(queue_engine, first[1])
    assert [job.task for job in claim(queue_engine)] == ["j3"]


def test_a_job_of_another_queue_keeps_its_place(queue_engine: sa.Engine) -> None:
    enqueue(queue_engine, EmailJob(task="elsewhere", queue="other", ordering_key="k"))
    enqueue(queue_engine, EmailJob(task="here", ordering_key="k"))
    assert claim(queue_engine) == []  # "here" is behind a job that this claim does not serve
    assert [job.task for job in claim(queue_engine, queues=["other"])] == ["elsewhere"]


def test_enqueue_many_takes_keys(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.enqueue_many(
            session,
            EmailJob,
            [{"task": f"t{i}", "ordering_key": "k", "key_limit": 2} for i in range(3)],
        )
    assert [job.task for job in claim(queue_engine)] == ["t0", "t1"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("ordering_key", "", "must not be empty"),
        ("ordering_key", "k" * 201, "201 characters, the limit is 200"),
        ("ordering_key", 42, "must be a string"),
        ("ordering_key", "a\x00b", "NUL"),
        ("key_limit", 0, "must be in [1, 10000]"),
        ("key_limit", 10_001, "must be in [1, 10000]"),
        ("key_limit", True, "must be an integer"),
        ("key_limit", "3", "must be an integer"),
    ],
)
def test_bad_keys_and_limits_are_refused_before_any_sql(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(InvalidJobError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EmailJob(task="t", **{field: value})
    with pytest.raises(InvalidJobError, match=field):
        # No session, no engine: the check runs before anything is sent.
        sqla_jobs.enqueue_many(None, EmailJob, [{"task": "t", field: value}])  # type: ignore[arg-type]


def test_claim_refuses_a_keys_flag_that_is_not_a_bool(queue_engine: sa.Engine) -> None:
    with queue_engine.begin() as connection, pytest.raises(InvalidJobError, match="keys"):
        sqla_jobs.claim(connection, EmailJob, keys="yes")  # type: ignore[arg-type]


def test_the_registry_stamps_key_limits_and_refuses_keys_its_workers_would_not_claim() -> None:
    from sqla_jobs.errors import ConfigurationError
    from sqla_jobs.registry import JobContext, Registry

    plain = Registry(EmailJob)

    @plain.task
    def send(ctx: JobContext) -> None: ...

    assert not plain.ordering_keys
    with pytest.raises(ConfigurationError, match="ordering_keys=True"):
        send.job({}, ordering_key="customer:1")

    keyed = Registry(EmailJob)

    @keyed.task(key_limit=3)
    def sync(ctx: JobContext) -> None: ...

    assert keyed.ordering_keys  # implied by the key_limit
    job = sync.job({}, ordering_key="customer:1")
    assert (job.ordering_key, job.key_limit) == ("customer:1", 3)
    assert sync.job({}).key_limit is None  # no key, no limit
    assert Registry(EmailJob, ordering_keys=True).ordering_keys
    bad_limits: list[object] = [0, -1, "3", 1.5]
    for n, bad in enumerate(bad_limits):
        with pytest.raises(ConfigurationError, match="key_limit"):
            keyed.add(send.function, name=f"bad_{n}", key_limit=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ordering_keys"):
        Registry(EmailJob, ordering_keys="yes")  # type: ignore[arg-type]


def test_a_keyed_claim_over_several_queues(queue_engine: sa.Engine) -> None:
    enqueue(
        queue_engine,
        EmailJob(task="a1", queue="alpha", ordering_key="k1"),
        EmailJob(task="a2", queue="alpha", ordering_key="k1"),
        EmailJob(task="b1", queue="beta", ordering_key="k2"),
        EmailJob(task="b-plain", queue="beta"),
        EmailJob(task="c1", queue="gamma", ordering_key="k3"),
    )
    jobs = claim(queue_engine, queues=["alpha", "beta"])
    assert sorted(job.task for job in jobs) == ["a1", "b-plain", "b1"]
    with queue_engine.begin() as connection:
        held = sqla_jobs.claim(
            connection, EmailJob, queues=["alpha", "beta"], keys=True, hold=False
        )
    assert held == []


def test_keys_of_any_text_reach_the_claim_as_they_were_written(queue_engine: sa.Engine) -> None:
    # The keys the claim locked go to its second statement as a text[] literal in a
    # setting: quotes, commas, braces, backslashes, spaces, the word NULL and non-ASCII
    # text must come back exactly, or a key's jobs would not be found (or found twice).
    keys = ["a,b", 'q"uote', "{br}", "back\\slash", "NULL", " sp ace ", "ü€", "'"]
    first = enqueue(queue_engine, *(EmailJob(task="a", ordering_key=key) for key in keys))
    second = enqueue(queue_engine, *(EmailJob(task="b", ordering_key=key) for key in keys))
    claimed = claim(queue_engine, limit=50)
    assert sorted(job.id for job in claimed) == sorted(first)  # one per key: the first
    assert claim(queue_engine, limit=50) == []  # every key is busy
    finish(queue_engine, *claimed)
    assert sorted(job.id for job in claim(queue_engine, limit=50)) == sorted(second)


def test_a_burst_of_one_key_does_not_hide_the_keys_behind_it(queue_engine: sa.Engine) -> None:
    # One key's burst fills the claim's look-ahead (the first limit + KEY_SCAN_EXTRA keyed
    # jobs in claim order, rounded up to 16) with one key: the claim walks on past it, one
    # key at a time in claim order, until its keys could start limit + KEY_SCAN_EXTRA jobs.
    burst = enqueue(queue_engine, *(EmailJob(task="hot", ordering_key="hot") for _ in range(300)))
    others = enqueue(
        queue_engine, *(EmailJob(task="other", ordering_key=f"k{i}") for i in range(30))
    )
    first = claim(queue_engine, limit=20)
    assert sorted(job.id for job in first) == [burst[0], *others[:19]]
    second = claim(queue_engine, limit=20)  # the hot key is busy: the rest of the others
    assert sorted(job.id for job in second) == others[19:]
    assert claim(queue_engine, limit=20) == []
    finish(queue_engine, *(job for job in first if job.id == burst[0]))
    assert [job.id for job in claim(queue_engine, limit=20)] == [burst[1]]


def test_the_walk_past_bursts_keeps_claim_order_across_queues(queue_engine: sa.Engine) -> None:
    # Each served queue's look-ahead is walked on its own; the keys found, in all queues,
    # are locked in the order of their best job.
    hot = enqueue(
        queue_engine, *(EmailJob(task="h", queue="alpha", ordering_key="h1") for _ in range(100))
    )
    hot += enqueue(
        queue_engine, *(EmailJob(task="h", queue="beta", ordering_key="h2") for _ in range(100))
    )
    alpha = enqueue(
        queue_engine, *(EmailJob(task="a", queue="alpha", ordering_key=f"a{i}") for i in range(8))
    )
    beta = enqueue(
        queue_engine, *(EmailJob(task="b", queue="beta", ordering_key=f"b{i}") for i in range(8))
    )
    jobs = claim(queue_engine, queues=["alpha", "beta"], limit=40)
    assert sorted(job.id for job in jobs) == sorted([hot[0], hot[100], *alpha, *beta])
    # The hot keys are busy now; their queues' other jobs are all running: nothing left.
    assert claim(queue_engine, queues=["alpha", "beta"], limit=40) == []


def test_keys_behind_a_burst_and_busy_keys_are_found(queue_engine: sa.Engine) -> None:
    # A busy key's burst first in line, then forty busy keys, then free ones: the walk past
    # the burst locks busy keys (it counts none's jobs in progress), the claim comes back
    # short, and the walk after it passes them by to the free keys.
    burst = enqueue(queue_engine, *(EmailJob(task="hot", ordering_key="hot") for _ in range(200)))
    busy = enqueue(
        queue_engine, *(EmailJob(task="big", ordering_key=f"big{i % 40}") for i in range(80))
    )
    running = claim(queue_engine, limit=41)
    assert sorted(job.id for job in running) == sorted([burst[0], *busy[:40]])
    free = enqueue(queue_engine, *(EmailJob(task="free", ordering_key=f"f{i}") for i in range(10)))
    taken = claim(queue_engine, limit=10)
    assert sorted(job.id for job in taken) == free


def test_the_walk_past_a_burst_keeps_a_queue_limit_and_skips_held_keys(
    queue_engine: sa.Engine,
) -> None:
    # The keys the walk finds are try-locked like the others: one that another claim holds
    # is skipped, never waited for; and a limited queue's claim takes no more than its
    # free slots, whatever the walk found.
    burst = enqueue(queue_engine, *(EmailJob(task="hot", ordering_key="hot") for _ in range(200)))
    others = enqueue(
        queue_engine, *(EmailJob(task="other", ordering_key=f"k{i}") for i in range(10))
    )
    space = sqla_jobs._queries.key_lock_space(EmailJob.__table__)  # type: ignore[arg-type]
    with queue_engine.connect() as holder, holder.begin():
        holder.execute(
            sa.text("SELECT pg_advisory_xact_lock(:space, hashtext('k0'))"), {"space": space}
        )
        taken = claim(queue_engine, limit=20, queue_limits={"default": 4})
        assert sorted(job.id for job in taken) == [burst[0], *others[1:4]]
        rest = claim(queue_engine, limit=20)
        assert sorted(job.id for job in rest) == others[4:]
    assert [job.id for job in claim(queue_engine, limit=20)] == [others[0]]


@pytest.mark.parametrize("busy", [30, 100])
def test_busy_keys_in_line_do_not_hide_the_keys_behind_them(
    queue_engine: sa.Engine, busy: int
) -> None:
    # Thirty (or a hundred) keys with five jobs each, interleaved, all busy (one job of each
    # running): the first jobs in line are theirs, enough keys to fill a claim by count,
    # none of which can start a job, and more of them than the claim's window and a walk
    # that counted them as free could lock. The claim comes back short, walks on once past
    # them (counting each key's jobs in progress) to the keys behind, and claims from those.
    keys = (f"big{i % busy}" for i in range(5 * busy))
    enqueue(queue_engine, *(EmailJob(task="big", ordering_key=key) for key in keys))
    running = claim(queue_engine, limit=busy)
    assert len(running) == busy
    small = enqueue(
        queue_engine, *(EmailJob(task="small", ordering_key=f"small{i}") for i in range(20))
    )
    first = claim(queue_engine, limit=10)
    assert sorted(job.id for job in first) == small[:10]
    second = claim(queue_engine, limit=10, queue_limits={"default": busy + 15})
    assert sorted(job.id for job in second) == small[10:15]  # busy + 10 + 5 fill the limit
    finish(queue_engine, *running[:3])
    third = claim(queue_engine, limit=10)  # three big keys are free again, then the rest
    assert sorted(job.task for job in third) == ["big"] * 3 + ["small"] * 5


def test_a_burst_enqueued_one_job_at_a_time_is_walked_past_too(queue_engine: sa.Engine) -> None:
    # Each job its own transaction (its own run_at): no run to jump over, the walk reads
    # the burst a step at a time (up to WALK_STEPS * WALK_STEP_ROWS jobs per claim).
    burst = [enqueue(queue_engine, EmailJob(task="hot", ordering_key="hot"))[0] for _ in range(150)]
    others = enqueue(
        queue_engine, *(EmailJob(task="other", ordering_key=f"k{i}") for i in range(5))
    )
    assert sorted(job.id for job in claim(queue_engine, limit=10)) == [burst[0], *others]


def test_concurrent_claims_walk_past_the_keys_other_claims_hold(queue_engine: sa.Engine) -> None:
    # Four claims in open transactions at once, as four workers' claims overlap: the keys in
    # line are the first claim's (its locks last until it commits). The others walk on past
    # every key held (the lock statement's window, then the walk's steps, counting only the
    # keys they lock) and each fills its batch from keys of its own, instead of coming back
    # empty while hundreds of jobs wait.
    ids = enqueue(queue_engine, *(EmailJob(task="k", ordering_key=f"k{i}") for i in range(400)))
    with contextlib.ExitStack() as open_claims:
        batches = []
        for _ in range(4):
            connection = open_claims.enter_context(queue_engine.connect())
            open_claims.enter_context(connection.begin())
            batches.append(sqla_jobs.claim(connection, EmailJob, limit=20, keys=True))
    claimed = [job.id for batch in batches for job in batch]
    assert [len(batch) for batch in batches] == [20, 20, 20, 20]
    assert len(set(claimed)) == 80
    assert sorted(job.id for job in batches[0]) == ids[:20]  # the first, in claim order
    # Committed: every job claimed is running, once.
    assert len(claim(queue_engine, limit=400)) == 320
