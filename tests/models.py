"""The models a user of sqla_jobs would write: their own tables, names and extra columns."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from sqla_jobs import JobMixin, JobResultMixin, ScheduleMixin
from sqla_jobs.history import history_table
from sqla_jobs.schema.fair import fair_index
from sqla_jobs.schema.rates import rate_table
from sqla_jobs.schema.workflows import StepMixin, WorkflowMixin


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))


class EmailJob(JobMixin, Base):
    __tablename__ = "email_jobs"

    order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
    order: Mapped[Order | None] = relationship()


#: The rate table of EmailJob's rate-limited queues (optional: made where rate limits are used).
EMAIL_JOB_RATES = rate_table(EmailJob)


class TenantJob(JobMixin, Base):
    """Jobs of many customers, claimed fairly across them (FairShare("tenant"))."""

    __tablename__ = "tenant_jobs"

    tenant: Mapped[str | None] = mapped_column(String(50))


#: Where a fair claim of TenantJob finds each customer's jobs.
TENANT_JOB_FAIR_INDEX = fair_index(TenantJob, "tenant")


class OrderWorkflow(WorkflowMixin, Base):
    """An order's workflow (charge, then stock and email, then ship), tied to its order."""

    __tablename__ = "order_workflows"

    order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
    order: Mapped[Order | None] = relationship()


class OrderJobResult(JobResultMixin, Base):
    __tablename__ = "order_job_results"


class OrderJob(StepMixin, JobMixin, Base):
    """Jobs that can be steps of an OrderWorkflow."""

    __tablename__ = "order_jobs"
    workflow_model = OrderWorkflow
    result_model = OrderJobResult

    order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))


class EmailJobResult(JobResultMixin, Base):
    __tablename__ = "email_job_results"


class EmailJobSchedule(ScheduleMixin, Base):
    """The slots of EmailJob's periodic tasks."""

    __tablename__ = "email_job_schedules"


class ReportJob(JobMixin, Base):
    """Deletes its row on success and keeps only the result (seed 001's variant)."""

    __tablename__ = "report_jobs"
    delete_on_success = True


class ReportJobResult(JobResultMixin, Base):
    __tablename__ = "report_job_results"


class ArchiveJob(JobMixin, Base):
    """Moves its finished jobs into a history table partitioned by day (issue 11)."""

    __tablename__ = "archive_jobs"
    partitioned_history = True

    tenant: Mapped[str | None] = mapped_column(String(50))


class ArchiveJobHistory(Base):
    """The history of ArchiveJob, mapped to query it (the annotations are for typing only:
    the columns come from the table)."""

    __table__ = history_table(ArchiveJob)

    id: Mapped[int]
    status: Mapped[str]
    tenant: Mapped[str | None]
    result: Mapped[Any]
