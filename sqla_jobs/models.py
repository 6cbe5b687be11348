"""Ready-made job and result models, for applications that need no table of their own.

::

    from sqla_jobs.models import Job

    with Session(engine) as session, session.begin():
        session.add(Job(task="send_receipt", args={"order": 7}))

The tables are ``sqla_jobs``, ``sqla_jobs_results`` and ``sqla_jobs_schedules`` (the slots of
periodic tasks) on a :class:`~sqlalchemy.MetaData` of their own (:data:`metadata`). Create
them with the library's revisions: add ``sqla_jobs.migrations:versions`` to your Alembic
``version_locations`` and add :data:`metadata` to your ``target_metadata`` list, or call
:func:`sqla_jobs.migrations.upgrade` on a database without an Alembic environment.
This module is not imported by ``import sqla_jobs``.
"""

from __future__ import annotations

from sqlalchemy import MetaData
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs.schema import JobMixin, JobResultMixin, ScheduleMixin

__all__ = ["Base", "Job", "JobResult", "JobSchedule", "metadata"]


class Base(DeclarativeBase):
    """The declarative base of the library's own tables."""

    metadata = MetaData()


class Job(JobMixin, Base):
    """A job in the default table, ``sqla_jobs``."""

    __tablename__ = "sqla_jobs"


class JobResult(JobResultMixin, Base):
    """The stored value of a succeeded :class:`Job`, in ``sqla_jobs_results``."""

    __tablename__ = "sqla_jobs_results"


class JobSchedule(ScheduleMixin, Base):
    """The slots of the periodic tasks of :class:`Job`, in ``sqla_jobs_schedules``."""

    __tablename__ = "sqla_jobs_schedules"


metadata = Base.metadata
