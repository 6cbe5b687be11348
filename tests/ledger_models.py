"""A model with workflow steps and a partitioned history, on a MetaData of its own (the
tests of workflows with a history make its tables in a database of their own)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import DeclarativeBase, Mapped

from sqla_jobs import JobMixin, JobResultMixin, StepMixin, WorkflowMixin
from sqla_jobs.history import history_table


class Base(DeclarativeBase):
    pass


class LedgerWorkflow(WorkflowMixin, Base):
    __tablename__ = "ledger_workflows"


class LedgerJobResult(JobResultMixin, Base):
    __tablename__ = "ledger_job_results"


class LedgerJob(StepMixin, JobMixin, Base):
    """Steps of a LedgerWorkflow whose finished jobs move into a partitioned history."""

    __tablename__ = "ledger_jobs"
    partitioned_history = True
    workflow_model = LedgerWorkflow
    result_model = LedgerJobResult


class LedgerJobHistory(Base):
    __table__ = history_table(LedgerJob)
    id: Mapped[int]
    status: Mapped[str]
    result: Mapped[Any]
