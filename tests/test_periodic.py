"""Periodic jobs: schedules, slots, and exactly one job per slot whoever asks."""

from __future__ import annotations

import logging
import re
import threading
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

from sqla_jobs import (
    ConfigurationError,
    InvalidJobError,
    JobContext,
    Registry,
    Schedule,
    ScheduleError,
    Worker,
)
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


def _recorded(engine: sa.Engine, task: str = "tick") -> datetime:
    with engine.connect() as connection:
        slot: datetime = connection.execute(
            sa.select(EmailJobSchedule.last_slot).where(EmailJobSchedule.name == task)
        ).scalar_one()
    return slot


def _runs(engine: sa.Engine) -> list[datetime]:
    with engine.connect() as connection:
        return list(connection.execute(sa.select(EmailJob.run_at).order_by(EmailJob.id)).scalars())


def _resets(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == "schedule_reset"]


def test_a_slot_recorded_by_a_clock_read_ahead_does_not_silence_the_schedule(
    queue_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    every = Schedule(every=60)
    start = datetime(2030, 1, 1, 10, 0, 30, tzinfo=UTC)
    caplog.set_level(logging.INFO, logger="sqla_jobs.periodic")
    with Session(queue_engine) as session:
        _due(session, every, start)  # recorded at 10:00
        # One read of a clock a day ahead wins its slot, 10:01 tomorrow, and enqueues it.
        ahead = _due(session, every, start + timedelta(days=1, seconds=40))
        assert ahead is not None
        assert not _resets(caplog)
        # The clock is right again (10:01:15 today): the slot recorded a day ahead is taken
        # for what it is, the schedule starts again at today's slot (recorded, not run:
        # it may have run before the clock went wrong), loudly.
        assert _due(session, every, start + timedelta(seconds=45)) is None
        (reset,) = _resets(caplog)
        assert reset.levelno == logging.WARNING
        assert (reset.task, reset.recorded_slot, reset.now, reset.slot) == (  # type: ignore[attr-defined]
            "tick",
            "2030-01-02T10:01:00+00:00",
            "2030-01-01T10:01:15+00:00",
            "2030-01-01T10:01:00+00:00",
        )
        assert _recorded(queue_engine) == datetime(2030, 1, 1, 10, 1, tzinfo=UTC)
        # The next slot runs, on time.
        won = _due(session, every, start + timedelta(seconds=91))
        assert won is not None
        assert won.inserted
        assert _due(session, every, start + timedelta(seconds=92)) is None  # once
        # When real time reaches the slot read ahead, its job (still pending) is the one:
        # that slot does not run twice.
        again = _due(session, every, start + timedelta(days=1, seconds=31))
        assert again is not None
        assert (again.inserted, again.id) == (False, ahead.id)
    assert _runs(queue_engine) == [
        datetime(2030, 1, 2, 10, 1, tzinfo=UTC),
        datetime(2030, 1, 1, 10, 2, tzinfo=UTC),
    ]
    assert len(_resets(caplog)) == 1


def test_a_clock_read_ahead_by_less_than_a_slot_or_a_minute_is_waited_out(
    queue_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A short step back of the clock (NTP) is waited out: the slots run while the clock was
    ahead do not run again, and nothing is reset."""
    caplog.set_level(logging.INFO, logger="sqla_jobs.periodic")
    per_second = Schedule(every=1)
    start = datetime(2030, 1, 1, 10, 0, 0, tzinfo=UTC)
    with Session(queue_engine) as session:
        _due(session, per_second, start, task="second")
        assert _due(session, per_second, start + timedelta(seconds=30), task="second")
        # The clock steps back 25 s: 30 s of recorded slot ahead, under a minute.
        for back in (5, 6, 29, 30):
            assert _due(session, per_second, start + timedelta(seconds=back), task="second") is None
        assert _recorded(queue_engine, "second") == start + timedelta(seconds=30)
        assert _due(session, per_second, start + timedelta(seconds=31), task="second")

        # A daily schedule whose clock read a day ahead recorded tomorrow's slot, which is
        # its next slot anyway: its job runs tomorrow, nothing is lost, nothing to reset.
        daily = Schedule(cron="0 3 * * *")
        day = datetime(2030, 1, 1, 5, 0, tzinfo=UTC)
        _due(session, daily, day, task="daily")
        assert _due(session, daily, day + timedelta(days=1), task="daily")
        assert _due(session, daily, day + timedelta(minutes=1), task="daily") is None
        assert _due(session, daily, day + timedelta(hours=22, seconds=1), task="daily") is None
        assert _recorded(queue_engine, "daily") == datetime(2030, 1, 2, 3, tzinfo=UTC)
    assert not _resets(caplog)
    assert _runs(queue_engine) == [
        start + timedelta(seconds=30),
        start + timedelta(seconds=31),
        datetime(2030, 1, 2, 3, tzinfo=UTC),
    ]


_NOW = datetime(2030, 1, 1, 10, 0, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"now": datetime(2030, 1, 1, 10)}, InvalidJobError, "now: must be a timezone-aware"),  # noqa: DTZ001
        ({"now": "2030-01-01T10:00:00Z"}, InvalidJobError, "now: must be a timezone-aware"),
        ({"now": datetime.max.replace(tzinfo=UTC)}, InvalidJobError, "now: is out of range"),
        ({"schedule": "* * * * *"}, ScheduleError, "must be a sqla_jobs.Schedule"),
        ({"task": ""}, InvalidJobError, "task"),
        ({"task": "tick\x00"}, InvalidJobError, "task"),
        ({"task": 7}, InvalidJobError, "task"),
        ({"job": {"bogus": 1}}, InvalidJobError, "job: takes"),
        ({"job": {"unique_key": "mine"}}, InvalidJobError, "not 'unique_key'"),
        ({"job": {"run_at": _NOW}}, InvalidJobError, "not 'run_at'"),
        ({"job": {"priority": "high"}}, InvalidJobError, "priority"),
        ({"job": {"queue": ""}}, InvalidJobError, "queue"),
        ({"job": [("queue", "q")]}, InvalidJobError, "job: must be a mapping"),
        ({"model": EmailJobSchedule}, ConfigurationError, "JobMixin"),
        ({"schedule_model": EmailJob}, ConfigurationError, "ScheduleMixin"),
    ],
)
def test_enqueue_due_refuses_bad_arguments_before_any_sql(
    queue_engine: sa.Engine, changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    good: dict[str, Any] = {
        "model": EmailJob,
        "schedule_model": EmailJobSchedule,
        "task": "tick",
        "schedule": Schedule(every=60),
        "now": _NOW,
        "job": {"queue": "reports", "priority": 5},
    }
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    with Session(queue_engine) as session:
        _due(session, Schedule(every=60), _NOW - timedelta(minutes=5))  # an existing row
        sa.event.listen(queue_engine, "before_cursor_execute", count)
        try:
            with pytest.raises(error, match=re.escape(message)):
                enqueue_due(session, **{**good, **changes})
        finally:
            sa.event.remove(queue_engine, "before_cursor_execute", count)
        assert statements == []
        with session.begin():  # the session is usable, nothing was written
            assert session.execute(sa.select(sa.func.count()).select_from(EmailJob)).scalar() == 0
        assert _recorded(queue_engine) == _NOW - timedelta(minutes=5, seconds=30)
    with Session(queue_engine) as session, session.begin():
        assert enqueue_due(session, **good)  # the same call with good arguments


def test_concurrent_tries_of_one_slot_queue_on_its_row_and_one_wins(
    queue_engine: sa.Engine,
) -> None:
    every = Schedule(every=60)
    start = datetime(2030, 1, 1, 10, 0, 30, tzinfo=UTC)
    with Session(queue_engine) as session:
        _due(session, every, start)
    results: list[Any] = []
    with Session(queue_engine) as first:
        first.begin()
        assert enqueue_due(
            first, EmailJob, EmailJobSchedule, task="tick", schedule=every, now=start + _MINUTE
        )

        def second() -> None:
            with Session(queue_engine) as session:
                results.append(_due(session, every, start + _MINUTE + timedelta(seconds=5)))

        thread = threading.Thread(target=second)
        thread.start()
        try:
            wait_until(
                lambda: _waiting_on_a_lock(queue_engine),
                timeout=20,
                message="the second try waits for the first one's row lock",
            )
        finally:
            first.commit()
            thread.join(20)
    assert results == [None]
    assert _runs(queue_engine) == [datetime(2030, 1, 1, 10, 1, tzinfo=UTC)]


_MINUTE = timedelta(minutes=1)


def _waiting_on_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as connection:
        waiting = connection.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar_one()
    return bool(waiting)


# -- workers --------------------------------------------------------------------------------


@pytest.fixture
def periodic_url(fresh_database: FreshDatabase) -> str:
    url = fresh_database("sqla_jobs_periodic")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    PeriodicBase.metadata.create_all(engine)
    engine.dispose()
    return url


def test_a_worker_whose_schedule_was_recorded_ahead_of_the_clock_keeps_scheduling(
    queue_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """What a read of a database clock a day ahead leaves behind (the schedule's row a day
    ahead, written here by SQL) does not silence the worker's scheduler: it resets the
    schedule, says so, and enqueues the next slots."""
    registry = Registry(EmailJob, schedule_model=EmailJobSchedule)

    @registry.task(queue="clock", schedule=Schedule(every=1))
    def clock(ctx: JobContext) -> None:
        pass

    with queue_engine.begin() as connection:
        connection.execute(
            sa.insert(EmailJobSchedule).values(
                name="clock", last_slot=sa.func.statement_timestamp() + timedelta(days=1)
            )
        )

    def due_jobs() -> int:
        with queue_engine.connect() as connection:
            count: int = connection.execute(
                sa.select(sa.func.count())
                .select_from(EmailJob)
                .where(EmailJob.task == "clock", EmailJob.run_at <= sa.func.statement_timestamp())
            ).scalar_one()
        return count

    caplog.set_level(logging.INFO, logger="sqla_jobs.periodic")
    # The worker serves another queue: the periodic jobs stay in the table to be counted.
    with Worker(registry, queue_engine, queues=["elsewhere"], concurrency=1, poll_interval=0.1):
        wait_until(due_jobs, timeout=30, message="the scheduler enqueued a slot due now")
    with queue_engine.connect() as connection:
        assert connection.execute(
            sa.select(EmailJobSchedule.last_slot <= sa.func.statement_timestamp())
        ).scalar_one()
    resets = _resets(caplog)
    assert resets
    assert resets[0].levelno == logging.WARNING
    assert resets[0].task == "clock"  # type: ignore[attr-defined]
    assert datetime.fromisoformat(resets[0].recorded_slot) > datetime.fromisoformat(  # type: ignore[attr-defined]
        resets[0].now  # type: ignore[attr-defined]
    ) + timedelta(hours=23)


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
