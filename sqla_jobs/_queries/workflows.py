"""The statements of workflows (:mod:`sqla_jobs.schema.workflows`): new ids for a graph's
steps, the workflow's row, cancelling a workflow, steps added by a running step, a step's
dependencies' results, a workflow's steps, and pruning finished workflows.

What a step's end does to its workflow and its dependents is not here: the workflow trigger
does it (:func:`~sqla_jobs.schema.workflows.step_trigger_sql`), whatever statement ends it.
The statements here that change a workflow's graph follow the trigger's order of locks: a
step's own row, then the workflow's row, then waiting steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Insert,
    Integer,
    Select,
    String,
    Table,
    Text,
    TextClause,
    Update,
    and_,
    bindparam,
    delete,
    func,
    literal_column,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.sql.dml import ReturningDelete
from sqlalchemy.sql.selectable import Subquery

from sqla_jobs._queries._sql import _lit, _now, _seconds
from sqla_jobs._queries.outcomes import cancel_notification
from sqla_jobs._queries.run import Executor, NoParams, Query
from sqla_jobs.ddl import literal as ddl_literal
from sqla_jobs.ddl import qualified_name
from sqla_jobs.schema import JobStatus
from sqla_jobs.schema.workflows import WorkflowStatus

__all__ = [
    "ADDED_STEPS",
    "ADD_STEPS_FENCE",
    "CANCEL_WAITING_STEPS",
    "DEPENDENCY_RESULTS",
    "NEW_IDS",
    "PRUNE_WORKFLOWS",
    "REQUEST_STEP_CANCELS",
    "RUNNING_WORKFLOW",
    "STEPS",
    "STEP_STATE_COLUMNS",
    "STEP_TRIGGERS",
    "WAIT_FOR_NEW_STEPS",
    "WORKFLOW_CANCEL",
    "WORKFLOW_STATUS",
    "StepState",
    "insert_unique_workflow",
    "insert_workflow",
    "workflow_steps_of",
]

_RUNNING: Final[ColumnElement[str]] = literal_column(f"'{WorkflowStatus.RUNNING.value}'")


def _sequence_of(table: Table) -> ColumnElement[Any]:
    # The table's id sequence, named in the statement's text (a constant of the table's).
    name = ddl_literal(qualified_name(table.name, table.schema))
    return func.pg_get_serial_sequence(literal_column(name), literal_column("'id'"))


def _ids_of(table: Table, count: str) -> ColumnElement[Any]:
    series = select(func.nextval(_sequence_of(table))).select_from(
        func.generate_series(literal_column("1"), bindparam(count, type_=Integer))
    )
    return func.array(series.scalar_subquery())


def new_ids(table: Table, *, workflow: Table) -> Select[Any]:
    """New ids from the sequences of the workflow table (one, for the workflow) and of the job
    table (``:count``, for its steps), so that the caller can write each step with the ids of
    its dependencies and dependents in one flush. Returns ``workflow_id, step_ids``."""
    return select(
        func.nextval(_sequence_of(workflow)).label("workflow_id"),
        _ids_of(table, "count").label("step_ids"),
    )


def step_ids(table: Table) -> Select[Any]:
    """``:count`` new ids from the job table's sequence: ``step_ids``."""
    return select(_ids_of(table, "count").label("step_ids"))


def insert_unique_workflow(workflow: Table, values: dict[str, Any]) -> Insert:
    """``INSERT`` of a workflow row with ``values`` unless a running workflow has its
    ``unique_key`` (``ON CONFLICT DO NOTHING`` on the unique index, whose predicate it
    repeats). Returns ``id``, or no row for a duplicate. Built per call: the model's own
    columns set vary."""
    return (
        insert(workflow)
        .values(values)
        .on_conflict_do_nothing(
            index_elements=[workflow.c.unique_key],
            index_where=text(
                f"unique_key IS NOT NULL AND status = '{WorkflowStatus.RUNNING.value}'"
            ),
        )
        .returning(workflow.c.id)
    )


def insert_workflow(executor: Executor, workflow: Table, values: dict[str, Any]) -> int | None:
    """Run :func:`insert_unique_workflow`: the new workflow's id, or None for a duplicate."""
    row = executor.execute(insert_unique_workflow(workflow, values)).first()
    return None if row is None else int(row.id)


def running_workflow(workflow: Table) -> Select[Any]:
    """The running workflow of unique key ``:unique_key``: ``id`` (no row when none)."""
    return select(workflow.c.id).where(
        workflow.c.unique_key == bindparam("unique_key", type_=String),
        workflow.c.status == _RUNNING,
    )


def workflow_status(workflow: Table) -> Select[Any]:
    """The status of workflow ``:flow_id`` (no row: no such workflow)."""
    return select(workflow.c.status).where(workflow.c.id == bindparam("flow_id", type_=BigInteger))


def workflow_cancel(workflow: Table) -> Update:
    """Mark workflow ``:flow_id`` cancelled (``cancel_requested_at``, kept if set) and
    lock its row. Returns ``status``: the workflow's, which turns ``cancelled`` when its last
    step ends (at once if it has none left). No row: no such workflow."""
    return (
        update(workflow)
        .where(workflow.c.id == bindparam("flow_id", type_=BigInteger))
        .values(
            cancel_requested_at=func.coalesce(workflow.c.cancel_requested_at, _now()),
        )
        .returning(workflow.c.status)
    )


def request_step_cancels(table: Table) -> Update:
    """Ask each running step of workflow ``:flow_id`` to stop, as
    :func:`~sqla_jobs._queries.outcomes.request_cancel` does for one job (the same
    notification). Returns ``id, attempts`` (and the notification's empty value)."""
    return (
        update(table)
        .where(
            table.c.workflow_id == bindparam("flow_id", type_=BigInteger),
            table.c.status == _lit(JobStatus.RUNNING),
        )
        .values(cancel_requested_at=func.coalesce(table.c.cancel_requested_at, _now()))
        .returning(table.c.id, table.c.attempts, cancel_notification(table))
    )


def cancel_waiting_steps(table: Table) -> Update:
    """End every pending or waiting step of workflow ``:flow_id`` cancelled (the trigger
    counts each in the workflow). Returns ``id``."""
    return (
        update(table)
        .where(
            table.c.workflow_id == bindparam("flow_id", type_=BigInteger),
            table.c.status.in_([_lit(JobStatus.PENDING), _lit(JobStatus.WAITING)]),
        )
        .values(
            status=_lit(JobStatus.CANCELLED),
            finished_at=_now(),
            last_error=literal_column("'its workflow was cancelled'"),
        )
        .returning(table.c.id)
    )


def add_steps_fence(table: Table, *, workflow: Table) -> Select[Any]:
    """The first write of steps added by a running step: attempt ``(:job_id, :attempt)``
    (fenced: running, that attempt) gets the new steps with no dependency among them,
    ``:first_steps``, as dependents; then its workflow's row counts ``:count`` more steps
    (locked second, as the trigger locks it). Returns ``workflow_id`` (no row: the attempt
    lost its job, or the job is not a step)."""
    fenced = (
        update(table)
        .where(
            table.c.id == bindparam("job_id", type_=BigInteger),
            table.c.attempts == bindparam("attempt", type_=Integer),
            table.c.status == _lit(JobStatus.RUNNING),
            table.c.workflow_id.is_not(None),
        )
        .values(
            dependents=func.array_cat(
                table.c.dependents, bindparam("first_steps", type_=ARRAY(BigInteger))
            )
        )
        .returning(table.c.workflow_id)
        .cte("fenced")
    )
    counted = (
        update(workflow)
        .where(workflow.c.id == fenced.c.workflow_id)
        .values(
            steps_total=workflow.c.steps_total + bindparam("count", type_=Integer),
            steps_left=workflow.c.steps_left + bindparam("count", type_=Integer),
        )
        .returning(workflow.c.id)
        .cte("counted")
    )
    return select(counted.c.id.label("workflow_id"))


def added_steps(table: Table) -> Select[Any]:
    """The steps named ``:names`` of the workflow of attempt ``(:job_id, :attempt)``
    (fenced: none when it no longer holds its job): ``step, id``. What a retried step finds
    of the steps an earlier attempt of it added. Through the primary key and the step
    index."""
    this = table.alias("this")
    return (
        select(table.c.step, table.c.id)
        .select_from(this)
        .join(
            table,
            and_(
                table.c.workflow_id == this.c.workflow_id,
                table.c.step == func.any(bindparam("names", type_=ARRAY(String))),
            ),
        )
        .where(
            this.c.id == bindparam("job_id", type_=BigInteger),
            this.c.attempts == bindparam("attempt", type_=Integer),
            this.c.status == _lit(JobStatus.RUNNING),
        )
    )


def wait_for_new_steps(table: Table) -> Update:
    """The waiting steps of workflow ``:flow_id`` named ``:names`` now wait also for the new
    steps ``:last_steps`` (those no other new step depends on): ``waiting_for`` grows by
    their number. Returns ``id, step`` of those changed; a named step that is not waiting
    (it runs, or ended) is left as it is."""
    last: ColumnElement[Any] = bindparam("last_steps", type_=ARRAY(BigInteger))
    return (
        update(table)
        .where(
            table.c.workflow_id == bindparam("flow_id", type_=BigInteger),
            table.c.step == func.any(bindparam("names", type_=ARRAY(String))),
            table.c.status == _lit(JobStatus.WAITING),
        )
        .values(
            waiting_for=table.c.waiting_for + func.cardinality(last),
            depends_on=func.array_cat(table.c.depends_on, last),
        )
        .returning(table.c.id, table.c.step)
    )


def dependency_results(table: Table, *, results: Table) -> Select[Any]:
    """The dependencies of step ``:job_id``: ``step, id, status, value`` (``value`` from
    the result table, NULL where none was stored), by step name."""
    this = table.alias("this")
    return (
        select(table.c.step, table.c.id, table.c.status, results.c.value)
        .select_from(this)
        .join(table, table.c.id == func.any(this.c.depends_on))
        .outerjoin(results, results.c.job_id == table.c.id)
        .where(this.c.id == bindparam("job_id", type_=BigInteger))
        .order_by(table.c.step)
    )


#: The columns of a workflow's steps as :func:`steps` reads them (:class:`StepState`).
STEP_STATE_COLUMNS: Final = (
    "id",
    "step",
    "task",
    "queue",
    "status",
    "attempts",
    "max_attempts",
    "depends_on",
    "waiting_for",
    "if_dependency_fails",
    "blocked_by",
    "run_at",
    "attempted_at",
    "finished_at",
    "last_error",
)


def workflow_steps_of(
    table: Table, columns: Sequence[str], *, history: Table | None = None
) -> Subquery:
    """The ``columns`` of workflow ``:flow_id``'s steps, wherever each is: the job table
    (through its step index), and with ``history`` (a model with a partitioned history)
    the history too (through its workflow index, one range per partition), where an ended
    workflow's steps move. A step is in one of the two. The source every reader of a
    workflow's steps selects from."""
    flow_id = bindparam("flow_id", type_=BigInteger)
    hot = select(*(table.c[name] for name in columns)).where(table.c.workflow_id == flow_id)
    if history is None:
        return hot.subquery("steps")
    old = select(*(history.c[name] for name in columns)).where(history.c.workflow_id == flow_id)
    return union_all(hot, old).subquery("steps")


def steps(table: Table, *, history: Table | None = None) -> Select[Any]:
    """The steps of workflow ``:flow_id``, in id order (the order they were added): the
    :data:`STEP_STATE_COLUMNS`, with no dependencies as ``{}`` and no policy as
    ``'cancel'`` (:func:`workflow_steps_of`: ``history`` too)."""
    found = workflow_steps_of(table, STEP_STATE_COLUMNS, history=history)
    empty = literal_column("'{}'", ARRAY(BigInteger))
    filled = {
        "depends_on": func.coalesce(found.c.depends_on, empty).label("depends_on"),
        "if_dependency_fails": func.coalesce(
            found.c.if_dependency_fails, literal_column("'cancel'")
        ).label("if_dependency_fails"),
    }
    return select(*(filled.get(name, found.c[name]) for name in STEP_STATE_COLUMNS)).order_by(
        found.c.id
    )


def prune_workflows(workflow: Table) -> ReturningDelete[Any]:
    """Delete the workflows that finished more than ``:older_than_seconds`` ago (database
    time), oldest first, as many as hold fewer than ``:limit`` steps before the last one
    taken (at least one, however many steps it has). Returns their ``id``: the caller
    deletes their steps (:func:`prune_steps`) in the same transaction."""
    finished = (
        select(
            workflow.c.id,
            workflow.c.steps_total,
            func.sum(workflow.c.steps_total)
            .over(order_by=(workflow.c.finished_at, workflow.c.id))
            .label("through"),
        )
        .where(
            workflow.c.finished_at.is_not(None),
            workflow.c.finished_at < _now() - _seconds("older_than_seconds"),
        )
        .order_by(workflow.c.finished_at, workflow.c.id)
        .limit(bindparam("limit", type_=Integer))
        .subquery()
    )
    doomed = select(finished.c.id).where(
        finished.c.through - finished.c.steps_total < bindparam("limit", type_=Integer)
    )
    return (
        delete(workflow).where(workflow.c.id.in_(doomed.scalar_subquery())).returning(workflow.c.id)
    )


def prune_steps(table: Table) -> ReturningDelete[Any]:
    """Delete the steps of the workflows ``:flow_ids`` (which have ended: no trigger
    fires). Returns ``id``."""
    return (
        delete(table)
        .where(table.c.workflow_id == func.any(bindparam("workflow_ids", type_=ARRAY(BigInteger))))
        .returning(table.c.id)
    )


def step_triggers(table: Table) -> TextClause:
    """The enabled triggers on the job table, by name (``tgname``): what a worker of a model
    with steps checks for the workflow trigger at its start. The table's name is bound into
    the statement: execute it without parameters. Reads the catalog; takes no lock."""
    return text(
        "SELECT coalesce(array_agg(tgname::text), '{}') AS names FROM pg_trigger "
        "WHERE tgrelid = to_regclass(:trigger_table) AND NOT tgisinternal AND tgenabled <> 'D'"
    ).bindparams(bindparam("trigger_table", qualified_name(table.name, table.schema), type_=Text))


class TriggersRow(NamedTuple):
    names: list[str]


class CountParams(TypedDict):
    count: int


class NewIdsRow(NamedTuple):
    workflow_id: int
    step_ids: list[int]


class StepIdsRow(NamedTuple):
    step_ids: list[int]


class UniqueKeyParams(TypedDict):
    unique_key: str


class WorkflowIdParams(TypedDict):
    flow_id: int


class IdRow(NamedTuple):
    id: int


class StatusRow(NamedTuple):
    status: str


class CancelRow(NamedTuple):
    id: int
    attempts: int
    pg_notify: Any = None


class AddStepsParams(TypedDict):
    job_id: int
    attempt: int
    first_steps: list[int]
    count: int


class WorkflowRow(NamedTuple):
    workflow_id: int


class WaitForParams(TypedDict):
    flow_id: int
    names: list[str]
    last_steps: list[int]


class AddedParams(TypedDict):
    job_id: int
    attempt: int
    names: list[str]


class AddedRow(NamedTuple):
    step: str
    id: int


class StepRow(NamedTuple):
    id: int
    step: str


class JobIdParams(TypedDict):
    job_id: int


class DependencyRow(NamedTuple):
    step: str
    id: int
    status: str
    value: Any


class StepState(NamedTuple):
    """A step as :func:`~sqla_jobs.workflow_steps` reads it: its id and name, task, queue,
    status and attempts, the ids of the steps it depends on (``[]`` for none), how many of
    them it still waits for (while ``waiting``), what it does when one fails (``"cancel"``
    or ``"run"``), the failed step that cancelled it (``blocked_by``), and its times and
    last error."""

    id: int
    step: str
    task: str
    queue: str
    status: str
    attempts: int
    max_attempts: int
    depends_on: list[int]
    waiting_for: int | None
    if_dependency_fails: str
    blocked_by: int | None
    run_at: Any
    attempted_at: Any
    finished_at: Any
    last_error: str | None


class PruneParams(TypedDict):
    older_than_seconds: float
    limit: int


class PruneStepsParams(TypedDict):
    workflow_ids: list[int]


STEP_TRIGGERS: Final = Query(step_triggers, NoParams, TriggersRow)
NEW_IDS: Final = Query(new_ids, CountParams, NewIdsRow)
STEP_IDS: Final = Query(step_ids, CountParams, StepIdsRow)
RUNNING_WORKFLOW: Final = Query(running_workflow, UniqueKeyParams, IdRow)
WORKFLOW_STATUS: Final = Query(workflow_status, WorkflowIdParams, StatusRow)
WORKFLOW_CANCEL: Final = Query(workflow_cancel, WorkflowIdParams, StatusRow)
REQUEST_STEP_CANCELS: Final = Query(request_step_cancels, WorkflowIdParams, CancelRow)
CANCEL_WAITING_STEPS: Final = Query(cancel_waiting_steps, WorkflowIdParams, IdRow)
ADD_STEPS_FENCE: Final = Query(add_steps_fence, AddStepsParams, WorkflowRow)
WAIT_FOR_NEW_STEPS: Final = Query(wait_for_new_steps, WaitForParams, StepRow)
ADDED_STEPS: Final = Query(added_steps, AddedParams, AddedRow)
DEPENDENCY_RESULTS: Final = Query(dependency_results, JobIdParams, DependencyRow)
#: ``history=``: the history table of a model with one.
STEPS: Final = Query(steps, WorkflowIdParams, StepState)
PRUNE_WORKFLOWS: Final = Query(prune_workflows, PruneParams, IdRow)
PRUNE_STEPS: Final = Query(prune_steps, PruneStepsParams, IdRow)
