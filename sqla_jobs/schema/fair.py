"""The fair index of a job model's tenant column: where a fair claim
(:class:`~sqla_jobs.FairShare`) finds a queue's tenants and each tenant's next jobs.

Declared by the application beside its model, for the column it shares by, so that
``alembic revision --autogenerate`` sees it::

    class EmailJob(JobMixin, Base):
        __tablename__ = "email_jobs"
        tenant_id: Mapped[int | None]

    fair_index(EmailJob, "tenant_id")

or created in a revision with :func:`sqla_jobs.migrations.create_fair_index`::

    email_jobs_fair_tenant_id_idx ON email_jobs (queue, tenant_id, priority, run_at, id)
        WHERE status = 'pending' AND ordering_key IS NULL
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import Index, text

from sqla_jobs.naming import identifier
from sqla_jobs.schema import job_table_of, pending_predicate

__all__ = ["FAIR_INDEX_COLUMNS", "fair_index", "fair_index_name"]

#: The fair index's columns, the tenant column's place held by None.
FAIR_INDEX_COLUMNS: Final = ("queue", None, "priority", "run_at", "id")


def fair_index_name(table_name: str, column: str) -> str:
    """``<table>_fair_<column>_idx`` (cut short past PostgreSQL's 63 bytes, as every name)."""
    return identifier(table_name, f"fair_{column}_idx")


def fair_index(model: object, column: str) -> Index:
    """The fair index of ``model``'s tenant column ``column``, declared on its table (once:
    a second call returns the same index). The pending index's predicate, with the tenant
    column after the queue: each tenant's pending jobs in claim order, and the tenants of a
    queue one descent apart."""
    table = job_table_of(model)
    name = fair_index_name(table.name, column)
    for index in table.indexes:
        if index.name == name:
            return index
    columns = [table.c[part or column] for part in FAIR_INDEX_COLUMNS]
    return Index(name, *columns, postgresql_where=text(pending_predicate()))
