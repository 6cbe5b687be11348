"""A job model's variant, decided once per model: its finished jobs stay in its own table, or
they move into a partitioned history table (``partitioned_history = True``, see
:mod:`sqla_jobs.history`).

:func:`tables_of` resolves a model to its :class:`JobTables` (or :class:`HistoryJobTables`)
once; what differs between the two (where a finished job's status is found, what happens
when a job ends outside a worker's completion, where a dead or cancelled job is retried
from, whether finished jobs may be pruned one by one, which history the statistics and the
dashboard read, whether a completion keeps results without a result model) is a method or
an attribute of that object, not a branch on the model in the code above.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any, cast

from sqlalchemy import Table

from sqla_jobs._queries import admin, history
from sqla_jobs._queries.run import Executor, job_table_of
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.schema.history import has_history, history_table

__all__ = ["HistoryJobTables", "JobTables", "tables_of"]


class JobTables:
    """A job model whose finished jobs stay in its table (until pruned)."""

    #: The partitioned history table, for a model that has one.
    history: Table | None = None
    #: Whether a completion stores the handler's result without a result model (the history
    #: rows hold it: :data:`~sqla_jobs._queries.history.COMPLETE`).
    keeps_results: bool = False

    def __init__(self, model: type[Any], table: Table) -> None:
        self.model = model
        self.table = table

    def status(self, executor: Executor, job_id: int) -> str | None:
        """Job ``job_id``'s status, or None when there is no such job."""
        row = admin.STATUS_OF.one(executor, self.table, {"job_id": job_id})
        return None if row is None else row.status

    def ended(self, executor: Executor, job_id: int) -> None:
        """Job ``job_id`` has just ended (cancelled, or dead) in this transaction, outside a
        worker's completion: it stays where it is."""

    def retry_ended(self, executor: Executor, job_id: int) -> bool:
        """Make job ``job_id`` pending again where it is kept once ended, if it is there and
        dead or cancelled; whether it was (:data:`~sqla_jobs._queries.outcomes.RETRY` has
        run on the job table already)."""
        return False

    def check_prunable(self) -> None:
        """Raise ConfigurationError where finished jobs are not pruned one by one."""


class HistoryJobTables(JobTables):
    """A job model whose finished jobs move into its partitioned history table."""

    history: Table
    keeps_results = True

    def __init__(self, model: type[Any], table: Table) -> None:
        super().__init__(model, table)
        self.history = history_table(table)

    def status(self, executor: Executor, job_id: int) -> str | None:
        """Job ``job_id``'s status, from its table, else from its history."""
        found = super().status(executor, job_id)
        if found is not None:
            return found
        row = history.STATUS_OF.one(executor, self.table, {"job_id": job_id})
        return None if row is None else row.status

    def ended(self, executor: Executor, job_id: int) -> None:
        """A job that has just ended moves into the history, in the same transaction."""
        history.MOVE_FINISHED.result(executor, self.table, {"job_id": job_id})

    def retry_ended(self, executor: Executor, job_id: int) -> bool:
        """A dead or cancelled job in the history moves back into the job table, pending."""
        return history.RETRY.one(executor, self.table, {"job_id": job_id}) is not None

    def check_prunable(self) -> None:
        raise ConfigurationError(
            f"{self.model.__name__} keeps its finished jobs in a partitioned history: prune "
            "it with sqla_jobs.history.drop_partitions(engine, model, older_than=...) or "
            "sqla-jobs prune, which drop whole partitions"
        )


def tables_of(model: type[Any]) -> JobTables:
    """The model's :class:`JobTables`, resolved once: :class:`HistoryJobTables` for a model
    with ``partitioned_history``. Refuses what is not a mapped job model
    (:func:`~sqla_jobs._queries.run.job_table_of`)."""
    return _tables_of(cast(Hashable, model))


@functools.lru_cache(maxsize=256)
def _tables_of(key: Hashable) -> JobTables:
    model = cast(type[Any], key)
    table = job_table_of(model)
    return HistoryJobTables(model, table) if has_history(model) else JobTables(model, table)
