"""A job model's variant, decided once per model: its finished jobs stay in its own table, or
they move into a partitioned history table (``partitioned_history = True``, see
:mod:`sqla_jobs.history`).

:func:`tables_of` resolves a model to its :class:`JobTables` (or :class:`HistoryJobTables`)
once; what differs between the two (where a finished job's status is found, what happens
when a job ends outside a worker's completion, where a dead or cancelled job is retried
from, whether finished jobs may be pruned one by one, which history the statistics and the
dashboard read, how an attempt's completion is written and where its result goes) is a
method or an attribute of that object, not a branch on the model in the code above.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import Table

from sqla_jobs._queries import admin, history, outcomes
from sqla_jobs._queries._sql import FenceParams
from sqla_jobs._queries.rows import COMPLETE_STATUS, FENCE
from sqla_jobs._queries.run import Executor, job_table_of, result_table_of
from sqla_jobs.errors import ConfigurationError, InvalidJobError, JobStateError
from sqla_jobs.schema import JobStatus, has_steps
from sqla_jobs.schema.history import has_history, history_table
from sqla_jobs.schema.workflows import check_step_model

__all__ = [
    "Completion",
    "HistoryJobTables",
    "JobTables",
    "Result",
    "StepHistoryJobTables",
    "tables_of",
]

_CANCELLED = JobStatus.CANCELLED.value

#: JSON as the history's completion reads its results (the values are checked by the caller).
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


class Result(NamedTuple):
    """A handler's result for one attempt, to store with its completion (the value already
    checked to be JSON that jsonb stores)."""

    job_id: int
    attempt: int
    task: str
    value: Any


class Completion(NamedTuple):
    """What a fenced completion matched, as ``(id, attempt)`` fences: the attempts whose job
    ended succeeded (or deleted), and those whose job ended cancelled instead (its cancel was
    requested). An attempt in neither had lost its job: nothing changed for it."""

    done: set[tuple[int, int]]
    cancelled: set[tuple[int, int]]


def _split(rows: Sequence[Any]) -> Completion:
    # A completed row's status says which: cancelled (cancel requested), else done.
    done: set[tuple[int, int]] = set()
    cancelled: set[tuple[int, int]] = set()
    for row in rows:
        (cancelled if row[COMPLETE_STATUS] == _CANCELLED else done).add(FENCE(row))
    return Completion(done, cancelled)


class JobTables:
    """A job model whose finished jobs stay in its table (until pruned)."""

    #: The partitioned history table, for a model that has one.
    history: Table | None = None
    #: The workflow table, for a model with workflow steps whose finished jobs move into a
    #: history (its mover moves a workflow's steps together: :class:`StepHistoryJobTables`).
    workflow: Table | None = None
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

    def retry(self, executor: Executor, job_id: int) -> bool:
        """Make job ``job_id`` pending again, if it is dead or cancelled; whether it was.
        Here it is in its table (:data:`~sqla_jobs._queries.outcomes.RETRY`)."""
        return outcomes.RETRY.one(executor, self.table, {"job_id": job_id}) is not None

    def check_prunable(self) -> None:
        """Raise ConfigurationError where finished jobs are not pruned one by one."""

    def complete(
        self,
        executor: Executor,
        fences: FenceParams,
        count: int,
        *,
        held: bool = False,
        results: Sequence[Result] | None = None,
        result_model: type[Any] | None = None,
    ) -> Completion:
        """Complete the ``count`` attempts of ``fences``, each only if it still owns its job
        (the fence), storing ``results`` for those that ended succeeded.

        Here the job stays in its table, succeeded (deleted where the model sets
        ``delete_on_success``), and the results go to ``result_model``'s table (by default
        the job model's ``result_model``; one is required for results, checked before any
        SQL). ``held``: the caller's transaction holds the rows locked (a lock-held group,
        :data:`~sqla_jobs._queries.outcomes.COMPLETE_HELD`), and a job whose cancel was
        requested is left running, untouched; otherwise it ends cancelled, its result not
        stored.
        """
        result_table = None
        if results is not None:
            result_model = result_model or self.model.result_model
            if result_model is None:
                raise InvalidJobError("result_model", "is required to store results")
            result_table = result_table_of(result_model)
        if self.model.delete_on_success:
            # complete_and_delete leaves a job whose cancel was requested as it is.
            rows = outcomes.COMPLETE_AND_DELETE.tuples(executor, self.table, fences)
            done = set(map(FENCE, rows))
            cancelled: set[tuple[int, int]] = set()
            if not held and len(done) < count:  # not deleted: lost, or cancel requested (rare)
                # Fenced, so neither a deleted job nor one another attempt owns matches.
                rows = outcomes.CANCEL_ATTEMPTS.tuples(executor, self.table, fences)
                cancelled = set(map(FENCE, rows))
            completion = Completion(done, cancelled)
        elif held:
            rows = outcomes.COMPLETE_HELD.tuples(executor, self.table, fences)
            completion = Completion(set(map(FENCE, rows)), set())
        else:
            completion = _split(outcomes.COMPLETE.tuples(executor, self.table, fences))
        if result_table is not None and results and completion.done:
            done = completion.done
            payload = [
                {"job_id": result.job_id, "task": result.task, "value": result.value}
                for result in results
                if (result.job_id, result.attempt) in done
            ]
            if payload:
                outcomes.STORE_RESULTS.result(executor, result_table, {"results": payload})
        return completion


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

    def retry(self, executor: Executor, job_id: int) -> bool:
        """In its table, else a dead or cancelled job in the history moves back into the
        job table, pending (:data:`~sqla_jobs._queries.history.RETRY`)."""
        return (
            super().retry(executor, job_id)
            or history.RETRY.one(executor, self.table, {"job_id": job_id}) is not None
        )

    def complete(
        self,
        executor: Executor,
        fences: FenceParams,
        count: int,
        *,
        held: bool = False,
        results: Sequence[Result] | None = None,
        result_model: type[Any] | None = None,
    ) -> Completion:
        """Here a completed job moves into the history, succeeded, with its result, in one
        statement (:data:`~sqla_jobs._queries.history.COMPLETE`): no result table is
        involved, and ``result_model`` is not used."""
        values = {
            f"{result.job_id}:{result.attempt}": result.value
            for result in results or ()
            if result.value is not None  # None: no result (SQL null), as a worker stores none
        }
        params: history.CompleteParams = {
            "fence_ids": fences["fence_ids"],
            "fence_attempts": fences["fence_attempts"],
            "results": _encode(values) if values else "{}",
        }
        return _split(history.COMPLETE.tuples(executor, self.table, params, held=held))

    def check_prunable(self) -> None:
        raise ConfigurationError(
            f"{self.model.__name__} keeps its finished jobs in a partitioned history: prune "
            "it with sqla_jobs.history.drop_partitions(engine, model, older_than=...) or "
            "sqla-jobs prune, which drop whole partitions"
        )


class StepHistoryJobTables(HistoryJobTables):
    """A job model with workflow steps and a partitioned history: its jobs finish in place,
    like :class:`JobTables` (a step's dependents and its workflow read its row and its
    result until the workflow ends), and the history's mover moves them
    (:data:`~sqla_jobs._queries.history.SWEEP`): a job that is no step at the mover's next
    run, a workflow's steps once the workflow ended.

    The one rule of this variant: the rows of an ended workflow's steps change only under
    its workflow's row lock, which the mover takes too (shared, skipping a locked one). A
    retry takes it first, brings every step of the workflow that the mover took back from
    the history, then retries the step in the job table: the workflow trigger then finds
    the whole graph, as for a model without a history."""

    keeps_results = False
    workflow: Table

    def __init__(self, model: type[Any], table: Table) -> None:
        super().__init__(model, table)
        self.workflow = check_step_model(model)

    # Its jobs finish in place, as a model's without a history: a completion writes where
    # JobTables' does (results into the result model's table), and a job that ended
    # otherwise stays where it is, for the mover.
    complete = JobTables.complete
    ended = JobTables.ended

    def retry(self, executor: Executor, job_id: int) -> bool:
        """A step: its workflow locked, its steps back from the history, then retried in the
        job table. Raises JobStateError for a step whose workflow is gone (retention
        deleted it). A job that is no step: as for :class:`HistoryJobTables`."""
        found = history.STEP_WORKFLOW.one(executor, self.table, {"job_id": job_id})
        if found is None or found.workflow_id is None:
            return super().retry(executor, job_id)
        flow: history.WorkflowIdParams = {"workflow_id": found.workflow_id}
        if history.LOCK_WORKFLOW.one(executor, self.workflow, flow) is None:
            raise JobStateError(
                f"job {job_id} is a step of workflow {found.workflow_id}, which is gone "
                "(the history's retention deleted it): it cannot run again"
            )
        result_model = self.model.result_model
        results = None if result_model is None else result_table_of(result_model)
        history.BRING_BACK.rows(executor, self.table, flow, result_table=results)
        return JobTables.retry(self, executor, job_id)


def tables_of(model: type[Any]) -> JobTables:
    """The model's :class:`JobTables`, resolved once: :class:`HistoryJobTables` for a model
    with ``partitioned_history``, :class:`StepHistoryJobTables` for one that has workflow
    steps too. Refuses what is not a mapped job model
    (:func:`~sqla_jobs._queries.run.job_table_of`)."""
    return _tables_of(cast(Hashable, model))


@functools.lru_cache(maxsize=256)
def _tables_of(key: Hashable) -> JobTables:
    model = cast(type[Any], key)
    table = job_table_of(model)
    if not has_history(model):
        return JobTables(model, table)
    if has_steps(model):
        return StepHistoryJobTables(model, table)
    return HistoryJobTables(model, table)
