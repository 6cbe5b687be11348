"""Workflows: jobs that run after other jobs, created in the caller's own transaction.

Build a graph with :class:`Workflow` (no SQL), then write it with :func:`enqueue_workflow`
in the session of your business transaction: the workflow's row and all its steps exist if
and only if that transaction commits::

    flow = Workflow("order 7")
    charge = flow.add("charge", charge_card.job({"order": 7}))
    stock = flow.add("reserve", reserve_stock.job({"order": 7}), after=charge)
    email = flow.add("email", send_email.job({"order": 7}), after=charge)
    flow.add("ship", ship.job({"order": 7}), after=[stock, email])
    with Session(engine) as session, session.begin():
        session.add(order)
        enqueue_workflow(session, flow)

A step is a job of a model that mixes in :class:`~sqla_jobs.schema.workflows.StepMixin`. It
runs once every step it names in ``after`` succeeded: the transaction that ends its last
dependency makes it pending (the workflow trigger, :mod:`sqla_jobs.schema.workflows`), so
nothing polls. A step can only name steps added before it, so a graph has no cycle by
construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from sqlalchemy import inspect
from sqlalchemy.exc import IntegrityError

from sqla_jobs import tracing, validation
from sqla_jobs._queries import workflows as queries
from sqla_jobs._queries.run import Executor, job_table_of, result_table_of
from sqla_jobs._queries.variant import tables_of
from sqla_jobs._queries.workflows import StepState
from sqla_jobs.errors import (
    ConfigurationError,
    InvalidWorkflowError,
    JobNotFoundError,
    LeaseLostError,
    WorkflowTimeoutError,
)
from sqla_jobs.queue.enqueueing import check_unique_key
from sqla_jobs.schema import JobMixin, JobStatus, has_steps
from sqla_jobs.schema.workflows import (
    DEPENDENCY_POLICIES,
    StepMixin,
    WorkflowMixin,
    WorkflowStatus,
    check_step_model,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from sqla_jobs.queue import ClaimedJob

__all__ = [
    "MAX_STEPS",
    "EnqueuedWorkflow",
    "Step",
    "StepMixin",
    "StepState",
    "Workflow",
    "WorkflowMixin",
    "WorkflowStatus",
    "add_steps",
    "cancel_workflow",
    "dependency_results",
    "enqueue_workflow",
    "wait_for_workflow",
    "workflow_steps",
]

#: The most steps one :class:`Workflow` (or one :func:`add_steps`) writes at once.
MAX_STEPS: Final = 100_000

_FINAL_WORKFLOW = frozenset(
    {WorkflowStatus.SUCCEEDED.value, WorkflowStatus.FAILED.value, WorkflowStatus.CANCELLED.value}
)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a :class:`Workflow`: its name, its job row (not yet written), the names
    of the steps it runs after, and what it does if one of them fails."""

    name: str
    job: JobMixin
    after: tuple[str, ...]
    if_dependency_fails: str


class Workflow:
    """A graph of steps to write together with :func:`enqueue_workflow` (or to add to a
    running step's workflow with :func:`add_steps`). Building it runs no SQL; every check
    is made here, as each step is added.

    ``name`` labels the workflow (its row's ``name``; the dashboard shows it).
    """

    def __init__(self, name: str = "") -> None:
        self.name = _label(name)
        self._steps: dict[str, Step] = {}
        self._model: type[JobMixin] | None = None

    @property
    def steps(self) -> tuple[Step, ...]:
        """The steps, in the order they were added."""
        return tuple(self._steps.values())

    @property
    def model(self) -> type[JobMixin]:
        """The job model of the steps (ConfigurationError while there is none)."""
        if self._model is None:
            raise InvalidWorkflowError("steps", "a workflow needs at least one step")
        return self._model

    def __len__(self) -> int:
        return len(self._steps)

    def __contains__(self, name: object) -> bool:
        return name in self._steps

    def add(
        self,
        name: str,
        job: JobMixin,
        *,
        after: str | Iterable[str] = (),
        if_dependency_fails: str = "cancel",
    ) -> str:
        """Add step ``name`` running ``job`` (a new job row, such as ``task.job(args)``)
        once every step named in ``after`` (added before it) succeeded; return ``name``.

        ``if_dependency_fails``: ``"cancel"`` (the default) ends the step cancelled as soon
        as one of its dependencies ends dead or cancelled, and the steps after it too;
        ``"run"`` runs it once all its dependencies ended, whatever their outcome (a
        cleanup, a report). :class:`~sqla_jobs.errors.InvalidWorkflowError` for a bad or
        repeated name, an unknown dependency (one not added yet: a graph has no cycle), a
        job that is not new, or one of another model than the other steps.
        """
        name = _checked(validation.check_name, "name", name)
        if name in self._steps:
            raise InvalidWorkflowError("name", f"step {name!r} was already added")
        names = (after,) if isinstance(after, str) else tuple(after)
        for dependency in names:
            if dependency not in self._steps:
                raise InvalidWorkflowError(
                    "after",
                    f"step {name!r} names {dependency!r}, which is not a step added before it "
                    "(a step runs after steps added earlier, so a workflow has no cycle)",
                )
        if len(set(names)) != len(names):
            raise InvalidWorkflowError("after", f"step {name!r} names a dependency twice")
        if if_dependency_fails not in DEPENDENCY_POLICIES:
            raise InvalidWorkflowError(
                "if_dependency_fails", f"must be one of {list(DEPENDENCY_POLICIES)}"
            )
        model = _step_model(job)
        if self._model is not None and model is not self._model:
            raise InvalidWorkflowError(
                "job",
                f"step {name!r} is a {model.__name__}, the others are "
                f"{self._model.__name__}: a workflow's steps share one job model",
            )
        if not _is_new(job) or job.__dict__.get("id") is not None:
            raise InvalidWorkflowError("job", f"step {name!r}'s job is not a new job row")
        if len(self._steps) >= MAX_STEPS:
            raise InvalidWorkflowError("steps", f"a workflow writes at most {MAX_STEPS} steps")
        check_step_model(model)
        self._model = model
        self._steps[name] = Step(name, job, names, if_dependency_fails)
        return name

    def chain(self, *steps: tuple[str, JobMixin], after: str | Iterable[str] = ()) -> str:
        """Add ``(name, job)`` steps that run one after the other (the first after
        ``after``); return the last one's name."""
        if not steps:
            raise InvalidWorkflowError("steps", "a chain needs at least one step")
        previous: str | Iterable[str] = after
        for name, job in steps:
            previous = self.add(name, job, after=previous)
        assert isinstance(previous, str)
        return previous

    def group(self, steps: Mapping[str, JobMixin], *, after: str | Iterable[str] = ()) -> list[str]:
        """Add steps that run side by side (each after ``after``); return their names, to
        name as the ``after`` of a step that runs once all of them succeeded (fan-in)."""
        if not steps:
            raise InvalidWorkflowError("steps", "a group needs at least one step")
        names = (after,) if isinstance(after, str) else tuple(after)
        return [self.add(name, job, after=names) for name, job in steps.items()]


def _is_new(row: object) -> bool:
    """Whether ``row`` (a mapped instance) is transient: in no session, never written."""
    state: Any = inspect(row)  # (an InstanceState; Optional in the lowest SQLAlchemy's stubs)
    return bool(state.transient)


def _label(name: object) -> str:
    if not isinstance(name, str) or len(name) > validation.MAX_NAME_LENGTH:
        raise InvalidWorkflowError(
            "name", f"must be a string of at most {validation.MAX_NAME_LENGTH} characters"
        )
    return name


def _step_model(job: object) -> type[JobMixin]:
    model: type[Any] = type(job)
    if not isinstance(job, JobMixin) or not has_steps(model):
        raise InvalidWorkflowError(
            "job", f"{job!r} is not a job of a model that mixes in StepMixin"
        )
    return model


def _checked(check: Callable[[str, object], str], field: str, value: object) -> str:
    try:
        return check(field, value)
    except InvalidWorkflowError:
        raise
    except Exception as exc:  # the field rules' own error, said as the workflow's
        raise InvalidWorkflowError(field, str(exc).split(": ", 1)[-1]) from exc


class EnqueuedWorkflow(NamedTuple):
    """What :func:`enqueue_workflow` wrote: the workflow's id, whether it was created (False:
    a running workflow had its unique key, and nothing was written; ``id`` is that one's),
    and each step's job id by name (empty when not created)."""

    id: int
    created: bool
    steps: dict[str, int]


def _place(
    flow: Workflow,
    ids: Sequence[int],
    workflow_id: int,
    context: dict[str, str] | None,
    *,
    outside: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Set each step's columns: its id, its workflow, its name, its dependencies and its
    dependents (by id), how many it waits for, its status. ``outside``: steps that the new
    ones depend on without being among them (a running step's own), by name."""
    by_name = dict(zip(flow._steps, ids, strict=True))
    dependents: dict[str, list[int]] = {name: [] for name in by_name}
    for step in flow._steps.values():
        for dependency in step.after:
            dependents[dependency].append(by_name[step.name])
    for step in flow._steps.values():
        job = step.job
        depends_on = [by_name[name] for name in step.after]
        outer = [] if outside is None or step.after else list(outside.values())
        waits = depends_on + outer
        _set(job, "id", by_name[step.name])
        _set(job, "workflow_id", workflow_id)
        _set(job, "step", step.name)
        _set(job, "depends_on", waits or None)
        _set(job, "dependents", dependents[step.name] or None)
        _set(job, "waiting_for", len(waits) or None)
        _set(job, "status", JobStatus.WAITING.value if waits else JobStatus.PENDING.value)
        if step.if_dependency_fails != "cancel":
            _set(job, "if_dependency_fails", step.if_dependency_fails)
        if context is not None and "trace_context" not in job.__dict__:
            _set(job, "trace_context", context)
    return by_name


def _set(job: JobMixin, key: str, value: object) -> None:
    # Past JobMixin's assignment checks, which refuse these columns to everyone else.
    object.__setattr__(job, key, value)


def enqueue_workflow(
    session: Session,
    flow: Workflow,
    *,
    workflow: WorkflowMixin | None = None,
    unique_key: str | None = None,
) -> EnqueuedWorkflow:
    """Write ``flow`` (its workflow row and every step) in ``session``'s transaction; it
    exists once the caller commits, and never commits itself.

    ``workflow``: a new instance of the steps' ``workflow_model`` carrying your own columns
    (``OrderWorkflow(order=order)``), else one is made. ``unique_key``: write nothing if a
    running workflow has that key (``created`` False, and the existing one's id), which
    never aborts the caller's transaction; the workflow row is then inserted at once, and
    only its column attributes are written (set foreign keys, not relationships). For an
    :class:`~sqlalchemy.ext.asyncio.AsyncSession`: ``await
    async_session.run_sync(enqueue_workflow, flow)``.

    One statement draws the ids; the steps and the workflow row are added to the session,
    and written by its next flush. The workflow carries the current span's trace context,
    and so does each step: a workflow is one trace. Every check runs before any SQL
    (:class:`~sqla_jobs.errors.InvalidWorkflowError`).
    """
    model = flow.model
    workflow_model = model.workflow_model  # type: ignore[attr-defined]
    if workflow is None:
        workflow = workflow_model()
    elif type(workflow) is not workflow_model or not _is_new(workflow):
        raise InvalidWorkflowError(
            "workflow", f"must be a new {workflow_model.__name__}, not {workflow!r}"
        )
    if unique_key is not None:
        unique_key = check_unique_key(unique_key)
    table = job_table_of(model)
    workflow_table = workflow_model.__table__
    count = len(flow)
    ids = queries.NEW_IDS.one(session, table, {"count": count}, workflow=workflow_table)
    assert ids is not None
    context = workflow.__dict__.get("trace_context") or tracing.enqueue_context()
    values: dict[str, Any] = {
        "id": ids.workflow_id,
        "name": workflow.__dict__.get("name") or flow.name,
        "steps_total": count,
        "steps_left": count,
        "trace_context": context,
    }
    if unique_key is not None:
        own = {
            column.key: workflow.__dict__[column.key]
            for column in workflow_table.columns
            if column.key in workflow.__dict__
        }
        inserted = queries.insert_workflow(
            session, workflow_table, {**own, **values, "unique_key": unique_key}
        )
        if inserted is None:
            running = queries.RUNNING_WORKFLOW.one(
                session, workflow_table, {"unique_key": unique_key}
            )
            return EnqueuedWorkflow(running.id if running is not None else 0, False, {})
    else:
        for key, value in values.items():
            setattr(workflow, key, value)
        session.add(workflow)
    steps = _place(flow, ids.step_ids, ids.workflow_id, context)
    session.add_all(step.job for step in flow._steps.values())
    return EnqueuedWorkflow(ids.workflow_id, True, steps)


def add_steps(
    session: Session,
    job: ClaimedJob,
    flow: Workflow,
    *,
    then: Iterable[str] = (),
    exist_ok: bool = False,
) -> dict[str, int]:
    """Add ``flow``'s steps to the workflow of running step ``job``, in ``session``'s
    transaction (in lock mode the claim's own, ``ctx.session``; in lease mode one of
    yours, which commits it). Returns each new step's job id by name.

    The new steps without an ``after`` of their own run after ``job`` succeeded. ``then``
    names waiting steps of the workflow (such as one that runs after ``job``) that must now
    also wait for every new step: a fan-in after a fan-out over data the step found. A
    named step that is not waiting (it runs, or ended) is refused, and so is a new step's
    name that the workflow already has (:class:`~sqla_jobs.errors.InvalidWorkflowError`).
    Fenced by the attempt: :class:`~sqla_jobs.errors.LeaseLostError` if it no longer holds
    the job. Runs in a savepoint and flushes the new steps: a refusal writes nothing and
    leaves the caller's transaction usable.

    ``exist_ok``: when the workflow already has every step of ``flow`` by name (an earlier
    attempt of this lease-mode step added them, then failed or lost its worker), add
    nothing and return their ids; some but not all of them is still refused.
    """
    model = flow.model
    if job.model is not model:
        raise InvalidWorkflowError(
            "job", f"the new steps are {model.__name__}s, the running step a {job.model.__name__}"
        )
    names = [_checked(validation.check_name, "then", name) for name in then]
    table = job_table_of(model)
    workflow_table = model.workflow_model.__table__  # type: ignore[attr-defined]
    if exist_ok:
        found = {
            row.step: row.id
            for row in queries.ADDED_STEPS.rows(
                session,
                job_table_of(model),
                {"job_id": job.id, "attempt": job.attempt, "names": list(flow._steps)},
            )
        }
        if len(found) == len(flow):
            return {name: found[name] for name in flow._steps}
        if found:
            raise InvalidWorkflowError(
                "name",
                f"job {job.id}'s workflow has {sorted(found)} of these steps but not the "
                "others: exist_ok takes all of them or none",
            )
    # In a savepoint: a refusal once rows were read (a lost lease, a ``then`` step that is
    # not waiting, a name the workflow has) leaves the caller's transaction as it was.
    with session.begin_nested():
        return _add_steps(session, job, flow, names, table, workflow_table)


def _add_steps(
    session: Session,
    job: ClaimedJob,
    flow: Workflow,
    names: list[str],
    table: Any,
    workflow_table: Any,
) -> dict[str, int]:
    count = len(flow)
    drawn = queries.STEP_IDS.one(session, table, {"count": count})
    assert drawn is not None
    first = [
        i for i, step in zip(drawn.step_ids, flow._steps.values(), strict=True) if not step.after
    ]
    # The trigger's order of locks: the running step's row, then its workflow's row.
    fenced = queries.ADD_STEPS_FENCE.one(
        session,
        table,
        {"job_id": job.id, "attempt": job.attempt, "first_steps": first, "count": count},
        workflow=workflow_table,
    )
    if fenced is None:
        raise LeaseLostError(
            f"job {job.id} attempt {job.attempt} no longer holds its job (or it is not a "
            "workflow step): no step was added"
        )
    ids = _place(
        flow,
        drawn.step_ids,
        fenced.workflow_id,
        tracing.enqueue_context(),
        outside={"": job.id},
    )
    if names:
        depended = {dependency for step in flow._steps.values() for dependency in step.after}
        last = [ids[name] for name in ids if name not in depended]
        changed = queries.WAIT_FOR_NEW_STEPS.rows(
            session, table, {"flow_id": fenced.workflow_id, "names": names, "last_steps": last}
        )
        missing = sorted(set(names) - {row.step for row in changed})
        if missing:
            raise InvalidWorkflowError(
                "then", f"{missing} are not waiting steps of job {job.id}'s workflow"
            )
        waiting = [row.id for row in changed]
        for step in flow._steps.values():
            if step.name not in depended:
                _set(step.job, "dependents", (step.job.__dict__.get("dependents") or []) + waiting)
    session.add_all(step.job for step in flow._steps.values())
    try:
        session.flush()
    except IntegrityError as exc:
        raise InvalidWorkflowError(
            "name", f"one of {sorted(ids)} is already a step of job {job.id}'s workflow"
        ) from exc
    return ids


def cancel_workflow(session: Executor, model: type[JobMixin], workflow_id: int) -> WorkflowStatus:
    """Cancel workflow ``workflow_id`` of job model ``model`` (the steps' model): its pending
    and waiting steps end cancelled, its running ones are asked to stop (as
    :func:`sqla_jobs.cancel` asks a running job), and the workflow ends ``cancelled`` with its
    last step. Returns its status once the caller commits: ``cancelled``, or ``running``
    while steps still run; a finished workflow keeps its status (idempotent).
    :class:`~sqla_jobs.errors.JobNotFoundError` when there is no such workflow."""
    validation.check_job_id("workflow_id", workflow_id)
    table, workflow_table = _tables(model)
    params: queries.WorkflowIdParams = {"flow_id": workflow_id}
    # The trigger's order of locks: running steps' rows, the workflow's, waiting steps'.
    queries.REQUEST_STEP_CANCELS.rows(session, table, params)
    row = queries.WORKFLOW_CANCEL.one(session, workflow_table, params)
    if row is None:
        raise JobNotFoundError(f"{model.__name__} has no workflow {workflow_id}")
    if row.status in _FINAL_WORKFLOW:
        return WorkflowStatus(row.status)
    queries.CANCEL_WAITING_STEPS.rows(session, table, params)
    status = queries.WORKFLOW_STATUS.one(session, workflow_table, params)
    assert status is not None
    return WorkflowStatus(status.status)


def workflow_steps(session: Executor, model: type[JobMixin], workflow_id: int) -> list[StepState]:
    """The steps of workflow ``workflow_id`` (of job model ``model``) in the order they were
    added, each with its status and its dependencies' ids: the graph, as it stands. For a
    model with a partitioned history, an ended workflow's steps are read from the history
    once the mover took them there."""
    validation.check_job_id("workflow_id", workflow_id)
    table, _ = _tables(model)
    history = tables_of(model).history
    return queries.STEPS.rows(session, table, {"flow_id": workflow_id}, history=history)


def dependency_results(session: Executor, job: ClaimedJob) -> dict[str, Any]:
    """The results of step ``job``'s dependencies, by step name: each one that succeeded and
    stored a value (a step whose policy is ``"run"`` may find a failed one missing). Needs
    the model's ``result_model``."""
    model = job.model
    if not has_steps(model):
        raise ConfigurationError(f"{model.__name__} has no workflow steps")
    result_model = model.result_model
    if result_model is None:
        raise ConfigurationError(
            f"{model.__name__} has no result_model: its steps store no results to read"
        )
    rows = queries.DEPENDENCY_RESULTS.rows(
        session, job_table_of(model), {"job_id": job.id}, results=result_table_of(result_model)
    )
    return {row.step: row.value for row in rows if row.status == JobStatus.SUCCEEDED.value}


def wait_for_workflow(
    sessions: Callable[[], Session],
    workflow_model: type[WorkflowMixin],
    workflow_id: int,
    *,
    timeout: float,
    poll: float = 0.2,
) -> WorkflowStatus:
    """Wait until workflow ``workflow_id`` has ended and return its final status, reading its
    row every ``poll`` seconds in a short transaction of a session from ``sessions`` (a
    sessionmaker). :class:`~sqla_jobs.errors.WorkflowTimeoutError` after ``timeout``
    seconds; :class:`~sqla_jobs.errors.JobNotFoundError` when there is no such workflow."""
    validation.check_job_id("workflow_id", workflow_id)
    deadline = time.monotonic() + validation.check_duration("timeout", timeout).total_seconds()
    table = workflow_model.__table__  # type: ignore[attr-defined]
    while True:
        with sessions() as session, session.begin():
            row = queries.WORKFLOW_STATUS.one(session, table, {"flow_id": workflow_id})
        if row is None:
            raise JobNotFoundError(f"{workflow_model.__name__} has no workflow {workflow_id}")
        if row.status in _FINAL_WORKFLOW:
            return WorkflowStatus(row.status)
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkflowTimeoutError(
                f"workflow {workflow_id} is still {row.status} after {timeout:g} seconds"
            )
        time.sleep(min(poll, left))


def _tables(model: type[JobMixin]) -> tuple[Any, Any]:
    if not has_steps(model):
        raise ConfigurationError(f"{model!r} is not a job model that mixes in StepMixin")
    return job_table_of(model), check_step_model(model)
