"""Periodic jobs: a task's schedule, and enqueueing its due slot exactly once.

A task declared with a :class:`Schedule` (``registry.task(schedule=Schedule(cron=...))``)
has *slots*: the times its cron expression or interval names. Every worker's scheduler
(:mod:`sqla_jobs.worker.scheduler`) looks, by the database's clock, for the latest slot that
is due, and calls :func:`enqueue_due`; there is no leader to elect. Exactly one call
succeeds per slot, because the slot is won in the database:

* the task's row in the schedule table (:class:`~sqla_jobs.schema.ScheduleMixin`) is
  locked and moves to the slot if its ``last_slot < :slot``
  (:func:`sqla_jobs._queries.schedule_advance`), in the transaction that enqueues the
  slot's job. Concurrent schedulers queue on that row's lock and compare with the
  committed row, so one wins and the others change nothing. The row only moves forward
  (but for the reset below, after a clock that was ahead), and it outlives the job: a
  slot never runs twice, even after its job finished and was pruned or moved out of the
  job table;
* the job carries the unique key ``periodic:<task>@<slot>`` (pending and running), so that
  nothing else can enqueue a second job for the slot while the first is in flight.

After downtime, only the latest missed slot runs: slots are never replayed, the scheduler
always asks for the latest due one. ``max_delay`` skips even that one when it is found
more than ``max_delay`` after its time. A schedule seen for the first time starts with its
next slot (the current one is recorded, not run).

A recorded slot can only be later than the database's clock if an earlier read of that
clock was ahead (a clock stepped forward then back by NTP, a failover to a server whose
clock was ahead): left alone, the schedule would stay silent until real time caught up
with it. So a recorded slot later than the schedule's next slot, and more than
:data:`CLOCK_TOLERANCE` ahead of the clock, is taken for such a mark and the schedule
starts again from the clock's latest slot (recorded, not run: like a new schedule, since
the schedule cannot know whether that slot ran before the clock went wrong), with a
warning (``schedule_reset``). Within that tolerance the schedule waits: a short step back
of the clock leaves the slots it already ran alone, which therefore never run twice.
That rule lives in :func:`enqueue_due` (the horizon it computes); the statement
(:func:`sqla_jobs._queries.schedule_advance`) only compares.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Final, cast
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from sqlalchemy import Table
from sqlalchemy.orm import Session

from sqla_jobs import validation
from sqla_jobs._queries.run import job_table_of
from sqla_jobs._queries.schedules import (
    SCHEDULE_ADVANCE,
    SCHEDULE_CREATE,
    ScheduleParams,
    database_clock,
)
from sqla_jobs.errors import ConfigurationError, InvalidJobError, ScheduleError
from sqla_jobs.queue import MAX_UNIQUE_KEY_LENGTH, Enqueued, enqueue_unique_many
from sqla_jobs.schema import JobMixin, ScheduleMixin

__all__ = ["Schedule", "enqueue_due", "slot_key"]

logger = logging.getLogger(__name__)

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=timezone.utc)
_AHEAD: Final = timedelta(minutes=1)
#: The shortest interval: a slot per second.
MIN_INTERVAL: Final = timedelta(seconds=1)
#: How far ahead of the database's clock a schedule's recorded slot may be (when it is not
#: later than the schedule's next slot either) before it is taken for the mark of a clock
#: read that was ahead and the schedule starts again from now (see the module docstring).
CLOCK_TOLERANCE: Final = timedelta(minutes=1)
#: The fields of ``job`` that :func:`enqueue_due` takes (the schedule sets the others).
_JOB_OPTIONS: Final = validation.JOB_FIELDS - {"task", "args", "run_at"}
#: A cron expression's fields: cronsim would read a sixth as seconds (first), and other
#: counts are refused by it with a less helpful message.
_CRON_FIELDS: Final = ("minute", "hour", "day-of-month", "month", "day-of-week")


@dataclass(frozen=True)
class Schedule:
    """When a periodic task runs: a ``cron`` expression in ``timezone``, or a fixed interval.

    ``cron``
        Five fields, ``minute hour day-of-month month day-of-week`` (parsed by
        `cronsim <https://pypi.org/project/cronsim/>`_: ranges, steps, names, ``L``,
        ``#``; a sixth field, for seconds, is refused), evaluated in ``timezone`` (an
        IANA name, default ``"UTC"``), daylight saving time included: ``"0 3 * * *"``
        with ``timezone="Europe/Paris"`` is 03:00 Paris time all year round.
    ``every``
        A fixed interval (a ``timedelta`` or seconds, whole seconds, at least 1): slots at
        every multiple of it since the Unix epoch (UTC), so that every worker computes the
        same slots. For wall-clock times use ``cron``.
    ``args``
        The arguments of every job the schedule enqueues (default ``{}``).
    ``max_delay``
        ``None`` (default): after downtime, the latest missed slot runs, however late.
        A duration: a slot found more than that after its time is skipped.

    Bad input raises :class:`~sqla_jobs.errors.ScheduleError` here, when the task is
    declared, before any SQL runs.
    """

    cron: str | None = None
    every: timedelta | float | None = None
    timezone: str = "UTC"
    args: dict[str, Any] = field(default_factory=dict)
    max_delay: timedelta | float | None = None

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every is None):
            raise ScheduleError("a schedule takes either cron or every, not both or neither")
        if not isinstance(self.timezone, str):
            raise ScheduleError(f"timezone must be an IANA name, not {self.timezone!r}")
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ScheduleError(f"unknown timezone {self.timezone!r}") from None
        object.__setattr__(self, "_zone", zone)
        if self.cron is not None:
            if not isinstance(self.cron, str):
                raise ScheduleError(f"cron must be a string, not {self.cron!r}")
            if len(self.cron.split()) != len(_CRON_FIELDS):
                raise ScheduleError(
                    f"bad cron expression {self.cron!r}: five fields are expected "
                    f"({' '.join(_CRON_FIELDS)}), not {len(self.cron.split())} "
                    "(no seconds field)"
                )
            try:
                CronSim(self.cron, datetime.now(zone))
            except CronSimError as exc:
                raise ScheduleError(f"bad cron expression {self.cron!r}: {exc}") from None
        else:
            every = _duration("every", cast("timedelta | float", self.every))
            if every < MIN_INTERVAL or every % timedelta(seconds=1):
                raise ScheduleError(f"every must be whole seconds, at least 1, not {every}")
            object.__setattr__(self, "every", every)
        if self.max_delay is not None:
            object.__setattr__(self, "max_delay", _duration("max_delay", self.max_delay))
        try:
            validation.check_args("args", self.args)
        except InvalidJobError as exc:
            raise ScheduleError(f"args: {exc.reason}") from None
        object.__setattr__(self, "args", dict(self.args))

    def latest_slot(self, now: datetime) -> datetime:
        """The latest slot at or before ``now`` (an aware datetime), in UTC."""
        if self.every is not None:
            every = cast(timedelta, self.every)
            return _EPOCH + ((now - _EPOCH) // every) * every
        zone: ZoneInfo = self.__dict__["_zone"]
        # Reverse iteration from a minute on, so that a slot exactly at now counts: CronSim
        # releases differ in how they round the start of a reverse iteration and whether
        # they return it (2.6 and 2.8 do not agree), so the first slot not after now is the
        # answer, whichever way.
        local = (now + _AHEAD).astimezone(zone)
        for slot in CronSim(cast(str, self.cron), local, reverse=True):
            if slot <= now:
                return slot.astimezone(timezone.utc)
        raise ScheduleError(f"{self!r} has no slot before {now.isoformat()}")

    def next_slot(self, now: datetime) -> datetime:
        """The first slot after ``now`` (an aware datetime), in UTC."""
        if self.every is not None:
            return self.latest_slot(now) + cast(timedelta, self.every)
        zone: ZoneInfo = self.__dict__["_zone"]
        slot: datetime = next(CronSim(cast(str, self.cron), now.astimezone(zone)))
        return slot.astimezone(timezone.utc)

    def __repr__(self) -> str:
        when = (
            f"cron={self.cron!r} timezone={self.timezone!r}"
            if self.cron
            else (f"every={cast(timedelta, self.every).total_seconds():g}s")
        )
        return f"<Schedule {when}>"


def _duration(name: str, value: timedelta | float) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise ScheduleError(f"{name} must be a timedelta or seconds, not {value!r}")
    try:
        return validation.check_duration(name, value)
    except InvalidJobError as exc:
        raise ScheduleError(f"{name} {exc.reason}") from None


def slot_key(task: str, slot: datetime) -> str:
    """The unique key of a periodic task's job for ``slot``: ``periodic:<task>@<slot UTC>``.

    A task name of up to 200 characters makes a key longer than an explicit unique key may
    be; such a task's key uses a hash of its name instead.
    """
    stamp = slot.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    key = f"periodic:{task}@{stamp}"
    if len(key) > MAX_UNIQUE_KEY_LENGTH:
        key = f"periodic:{hashlib.sha256(task.encode()).hexdigest()}@{stamp}"
    return key


def enqueue_due(
    session: Session,
    model: type[JobMixin],
    schedule_model: type[ScheduleMixin],
    *,
    task: str,
    schedule: Schedule,
    now: datetime,
    job: Mapping[str, Any] | None = None,
) -> Enqueued | None:
    """Enqueue the job of ``task``'s latest slot due at ``now`` (the database's clock), if
    this transaction wins the slot; return it, or None.

    None when the slot was already won (by another worker, or an earlier call), when the
    schedule is new (its row is created at this slot, which does not run), when the slot
    is later than ``schedule.max_delay`` (recorded, skipped), or when the recorded slot was
    the mark of a clock read that was ahead (recorded at this slot, which does not run:
    see the module's docstring). ``job`` holds the job's other values (``queue``,
    ``priority``, ``max_attempts``, ``ordering_key``, ``key_limit``). Runs in the caller's
    transaction, never commits: the slot is won if, and only if, the caller commits. See
    the module's docstring for why exactly one transaction wins each slot.

    Bad arguments raise before any SQL runs: a :class:`~sqla_jobs.errors.ConfigurationError`
    for a model without its mixin, a :class:`~sqla_jobs.errors.ScheduleError` for a
    ``schedule`` that is not a :class:`Schedule`, an
    :class:`~sqla_jobs.errors.InvalidJobError` for the others.
    """
    job_table_of(model)
    table = _schedule_table(schedule_model)
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"schedule must be a sqla_jobs.Schedule, not {schedule!r}")
    now = _aware("now", now)
    try:
        slot = schedule.latest_slot(now)
        # The one home of the rule: a recorded slot past this is a clock read that was
        # ahead, not a slot won (see the module's docstring).
        horizon = max(schedule.next_slot(now), now + CLOCK_TOLERANCE)
    except OverflowError:
        raise InvalidJobError("now", f"is out of range: {now.isoformat()}") from None
    values = _job_values(model, task, schedule, slot, job)
    params: ScheduleParams = {"schedule_name": task, "slot": slot, "horizon": horizon}
    if SCHEDULE_CREATE.one(session, table, params) is not None:
        logger.info(
            "periodic task %s: schedule started at slot %s, the next slot runs",
            task,
            slot.isoformat(),
            extra={"action": "schedule_started", "task": task, "slot": slot.isoformat()},
        )
        return None
    moved = SCHEDULE_ADVANCE.one(session, table, params)
    if moved is None:
        return None
    recorded = moved.recorded
    if recorded > slot:
        logger.warning(
            "periodic task %s: its recorded slot %s is ahead of the database's clock (%s), "
            "left by a clock read that was ahead; the schedule starts again at slot %s "
            "(not run), the next slot runs",
            task,
            recorded.isoformat(),
            now.isoformat(),
            slot.isoformat(),
            extra={
                "action": "schedule_reset",
                "task": task,
                "recorded_slot": recorded.isoformat(),
                "now": now.isoformat(),
                "slot": slot.isoformat(),
            },
        )
        return None
    late = now - slot
    if schedule.max_delay is not None and late > cast(timedelta, schedule.max_delay):
        logger.warning(
            "periodic task %s: slot %s skipped, found %.1f s late (max_delay)",
            task,
            slot.isoformat(),
            late.total_seconds(),
            extra={"action": "slot_skipped", "task": task, "slot": slot.isoformat()},
        )
        return None
    (result,) = enqueue_unique_many(session, model, [values])
    logger.info(
        "periodic task %s: slot %s enqueued as job %d",
        task,
        slot.isoformat(),
        result.id,
        extra={
            "action": "slot_enqueued",
            "task": task,
            "slot": slot.isoformat(),
            "job_id": result.id,
        },
    )
    return result


def _aware(field: str, value: object) -> datetime:
    if not isinstance(value, datetime) or value.utcoffset() is None:
        raise InvalidJobError(field, f"must be a timezone-aware datetime, not {value!r}")
    return value


def _job_values(
    model: type[JobMixin],
    task: str,
    schedule: Schedule,
    slot: datetime,
    job: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The values of the slot's job, checked (before the schedule's row is touched, so
    that bad input leaves nothing half written)."""
    if job is not None and not isinstance(job, Mapping):
        raise InvalidJobError("job", f"must be a mapping of job options, not {job!r}")
    values: dict[str, Any] = {}
    for name, value in (job or {}).items():
        if name not in _JOB_OPTIONS:
            raise InvalidJobError("job", f"takes {', '.join(sorted(_JOB_OPTIONS))}, not {name!r}")
        values[name] = validation.check_field(name, value, max_args_bytes=model.max_args_bytes)
    values["task"] = validation.check_name("task", task)
    validation.check_field("args", schedule.args, max_args_bytes=model.max_args_bytes)
    return {
        **values,
        "args": schedule.args,
        "run_at": slot,
        "unique_key": slot_key(task, slot),
    }


def database_now(session: Session) -> datetime:
    """The database's clock (``statement_timestamp()``)."""
    return database_clock(session)


def _schedule_table(model: object) -> Table:
    if not (isinstance(model, type) and issubclass(model, ScheduleMixin)):
        raise ConfigurationError(f"{model!r} is not a mapped class that mixes in ScheduleMixin")
    return cast(Table, model.__table__)  # type: ignore[attr-defined]
