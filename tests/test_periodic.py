"""Periodic jobs: schedules, slots, and exactly one job per slot whoever asks."""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from models import EmailJob, EmailJobSchedule
from periodic_tasks import Base as PeriodicBase
from periodic_tasks import Run
from sqlalchemy.orm import Session
from worker_harness import Workers, wait_until

from sqla_jobs import ConfigurationError, Registry, Schedule, ScheduleError
from sqla_jobs.periodic import enqueue_due, slot_key

UTC = timezone.utc


# -- schedules ------------------------------------------------------------------------------


def test_an_interval_has_slots_at_its_multiples_since_the_epoch() -> None:
    every = Schedule(every=timedelta(minutes=15))
    now = datetime(2030, 1, 1, 10, 44, 59, 999999, tzinfo=UTC)
    assert every.latest_slot(now) == datetime(2030, 1, 1, 10, 30, tzinfo=UTC)
    assert every.next_slot(now) == datetime(2030, 1, 1, 10, 45, tzinfo=UTC)
    on_slot = datetime(2030, 1, 1, 10, 45, tzinfo=UTC)
    assert every.latest_slot(on_slot) == on_slot
    assert Schedule(every=1).latest_slot(now) == now.replace(microsecond=0)


def test_a_cron_schedule_follows_its_timezone_through_daylight_saving() -> None:
    paris = Schedule(cron="0 3 * * *", timezone="Europe/Paris")
    winter = datetime(2030, 1, 15, 12, tzinfo=UTC)
    summer = datetime(2030, 7, 15, 12, tzinfo=UTC)
    assert paris.latest_slot(winter) == datetime(2030, 1, 15, 2, tzinfo=UTC)  # UTC+1
    assert paris.latest_slot(summer) == datetime(2030, 7, 15, 1, tzinfo=UTC)  # UTC+2
    assert paris.next_slot(summer) == datetime(2030, 7, 16, 1, tzinfo=UTC)
    exact = datetime(2030, 7, 15, 1, tzinfo=UTC)
    assert paris.latest_slot(exact) == exact  # a slot exactly now is due
    assert paris.latest_slot(exact.astimezone(UTC)).tzinfo == UTC


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "either cron or every"),
        ({"cron": "* * * * *", "every": 60}, "either cron or every"),
        ({"cron": "61 * * * *"}, "bad cron expression '61 * * * *'"),
        ({"cron": "* * *"}, "bad cron expression"),
        # cronsim reads six fields as seconds first: a every-10-seconds schedule, not what
        # the five-field docs promise.
        ({"cron": "*/10 * * * * *"}, "five fields are expected"),
        ({"cron": "0 30 3 * * *"}, "five fields are expected (minute hour day-of-month"),
        ({"cron": 5}, "cron must be a string"),
        ({"cron": "0 3 * * *", "timezone": "Mars/Olympus"}, "unknown timezone 'Mars/Olympus'"),
        ({"cron": "0 3 * * *", "timezone": "../etc/passwd"}, "unknown timezone"),
        ({"cron": "0 3 * * *", "timezone": None}, "timezone must be an IANA name"),
        ({"every": 0}, "every must be positive"),
        ({"every": -1}, "every must be positive"),
        ({"every": 1.5}, "whole seconds"),
        ({"every": 0.5}, "at least 1"),
        ({"every": "60"}, "timedelta or seconds"),
        ({"every": 60, "max_delay": 0}, "max_delay must be positive"),
        ({"every": 60, "args": {"x": float("nan")}}, "args"),
        ({"every": 60, "args": [1]}, "args"),
    ],
)
def test_bad_schedules_are_refused_when_declared(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        Schedule(**options)


def test_a_periodic_task_needs_a_schedule_table(queue_engine: sa.Engine) -> None:
    def noop(ctx: object) -> None:
        pass

    # ScheduleError, as documented; a ConfigurationError too, for except clauses written
    # for it.
    with pytest.raises(ScheduleError, match="schedule_model"):
        Registry(EmailJob).add(noop, schedule=Schedule(every=60))
    assert issubclass(ScheduleError, ConfigurationError)
    with pytest.raises(ScheduleError, match=r"sqla_jobs\.Schedule"):
        Registry(EmailJob, schedule_model=EmailJobSchedule).add(noop, schedule="* * * * *")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ScheduleMixin"):
        Registry(EmailJob, schedule_model=EmailJob)  # type: ignore[arg-type]
    registry = Registry(EmailJob, schedule_model=EmailJobSchedule)
    task = registry.add(noop, schedule=Schedule(every=60))
    assert registry.periodic_tasks == [task]
    assert task.schedule == Schedule(every=60)
    from sqla_jobs.models import JobSchedule

    assert Registry().schedule_model is JobSchedule


# -- slots ----------------------------------------------------------------------------------


def _due(session: Session, schedule: Schedule, now: datetime, task: str = "tick") -> Any:
    with session.begin():
        return enqueue_due(
            session, EmailJob, EmailJobSchedule, task=task, schedule=schedule, now=now
        )


def test_each_slot_is_enqueued_once_and_a_new_schedule_starts_with_its_next_slot(
    queue_engine: sa.Engine,
) -> None:
    every = Schedule(every=60, args={"a": 1})
    start = datetime(2030, 1, 1, 10, 0, 30, tzinfo=UTC)
    with Session(queue_engine) as session:
        assert _due(session, every, start) is None  # new: the 10:00 slot is only recorded
        assert _due(session, every, start + timedelta(seconds=20)) is None
        won = _due(session, every, start + timedelta(seconds=40))  # 10:01
        assert won is not None
        assert won.inserted
        assert _due(session, every, start + timedelta(seconds=50)) is None  # 10:01 again
        job = session.get(EmailJob, won.id)
        assert job is not None
        assert (job.task, job.args, job.run_at) == ("tick", {"a": 1}, start + timedelta(seconds=30))
        assert (
            job.unique_key == slot_key("tick", job.run_at) == "periodic:tick@2030-01-01T10:01:00Z"
        )
        # The job finishing, and leaving the table, does not free its slot.
        session.delete(job)
        session.commit()
        assert _due(session, every, start + timedelta(seconds=55)) is None
        # After downtime, only the latest missed slot runs.
        late = _due(session, every, start + timedelta(hours=5, seconds=1))
        assert late is not None
        assert late.inserted
        assert _due(session, every, start + timedelta(hours=5, seconds=2)) is None
        runs = session.execute(sa.select(EmailJob.run_at).order_by(EmailJob.id)).scalars()
        assert list(runs) == [datetime(2030, 1, 1, 15, 0, tzinfo=UTC)]
        session.commit()
        # A clock read that goes backwards never re-enqueues an earlier slot.
        assert _due(session, every, start + timedelta(minutes=2)) is None


def test_max_delay_skips_a_slot_found_too_late(queue_engine: sa.Engine) -> None:
    strict = Schedule(every=60, max_delay=5)
    start = datetime(2030, 1, 1, 10, 0, 30, tzinfo=UTC)
    with Session(queue_engine) as session:
        _due(session, strict, start)
        assert _due(session, strict, start + timedelta(seconds=36)) is None  # 10:01, 6 s late
        assert _due(session, strict, start + timedelta(seconds=92)) is not None  # 10:02, 2 s
        count = session.execute(sa.select(sa.func.count()).select_from(EmailJob)).scalar()
        assert count == 1
        session.commit()


def test_a_rolled_back_win_leaves_the_slot_to_the_next_try(queue_engine: sa.Engine) -> None:
    every = Schedule(every=60)
    start = datetime(2030, 1, 1, 10, 0, 30, tzinfo=UTC)
    with Session(queue_engine) as session:
        _due(session, every, start)
        session.begin()
        assert enqueue_due(
            session,
            EmailJob,
            EmailJobSchedule,
            task="tick",
            schedule=every,
            now=start + timedelta(minutes=1),
        )
        session.rollback()
        assert _due(session, every, start + timedelta(minutes=1)) is not None


# -- workers --------------------------------------------------------------------------------


@pytest.fixture
def periodic_url(fresh_database: FreshDatabase) -> str:
    url = fresh_database("sqla_jobs_periodic")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    PeriodicBase.metadata.create_all(engine)
    engine.dispose()
    return url


@pytest.mark.slow
def test_three_workers_run_a_per_second_schedule_once_per_slot(
    periodic_url: str, tmp_path: Path
) -> None:
    slots = 20
    engine = sa.create_engine(periodic_url, poolclass=sa.NullPool)
    pool = Workers(periodic_url, tmp_path)
    try:
        started = [
            pool.start(queues="periodic", concurrency=2, target="periodic_tasks:registry")
            for _ in range(3)
        ]

        def runs() -> list[datetime]:
            with Session(engine) as session:
                return list(session.execute(sa.select(Run.slot)).scalars())

        wait_until(
            lambda: len(set(runs())) >= slots,
            timeout=120,
            message=f"{slots} slots ran",
            interval=0.2,
        )
        for process in started:
            process.send(15)  # SIGTERM: a graceful stop
        for process in started:
            assert process.wait(30) == 0
        seen = runs()
        counts = Counter(seen)
        assert len(counts) >= slots
        assert max(counts.values()) == 1, [s for s, n in counts.items() if n > 1]
        assert all(slot.microsecond == 0 for slot in seen)
        with Session(engine) as session:
            # Every job succeeded (and was deleted): no slot has a job left behind, and the
            # schedule's row is at the latest slot that ran.
            from periodic_tasks import PeriodicJob, PeriodicSchedule

            left = session.execute(sa.select(PeriodicJob.run_at)).scalars().all()
            assert not set(left) & set(seen)
            last = session.execute(sa.select(PeriodicSchedule.last_slot)).scalar_one()
            assert last == max([*seen, *left])
        winners = {
            line
            for p in started
            for line in p.log_text().splitlines()
            if "slot_enqueued" in line or "enqueued as job" in line
        }
        assert winners  # the slots were won by the workers' schedulers
    finally:
        pool.close()
        engine.dispose()
