"""A periodic task for the scheduler tests: imported by real worker processes
(``periodic_tasks:registry``).

The job rows are deleted when they succeed (``delete_on_success``), so that nothing of a
finished slot is left in the job table: a slot that ran once must still never run again.
Each run records its slot in ``periodic_runs`` through the claim's session (lock mode), so
a run is recorded if and only if its job completed.
"""

from __future__ import annotations

import os
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import JobMixin, Schedule, ScheduleMixin
from sqla_jobs.registry import JobContext, Registry


class Base(DeclarativeBase):
    pass


class PeriodicJob(JobMixin, Base):
    __tablename__ = "periodic_jobs"
    delete_on_success = True


class PeriodicSchedule(ScheduleMixin, Base):
    __tablename__ = "periodic_schedules"


class Run(Base):
    __tablename__ = "periodic_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int]
    slot: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))
    pid: Mapped[int]


registry = Registry(PeriodicJob, schedule_model=PeriodicSchedule)


@registry.task(queue="periodic", mode="lock", schedule=Schedule(every=1, args={"kind": "tick"}))
def tick(ctx: JobContext) -> None:
    assert ctx.args == {"kind": "tick"}
    ctx.session.add(Run(job_id=ctx.id, slot=ctx.job.run_at, pid=os.getpid()))
