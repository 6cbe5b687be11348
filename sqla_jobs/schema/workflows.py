"""Workflows: graphs of jobs whose steps run after their dependencies succeeded.

Two mixins, like the job tables: :class:`WorkflowMixin` for a table of workflows (one row
per workflow: its status and its step counts, plus any columns of yours, such as a foreign
key to an order), and :class:`StepMixin`, mixed into a job model beside
:class:`~sqla_jobs.JobMixin` so that its jobs can be steps::

    class OrderWorkflow(WorkflowMixin, Base):
        __tablename__ = "order_workflows"
        order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))

    class OrderJob(StepMixin, JobMixin, Base):
        __tablename__ = "order_jobs"
        workflow_model = OrderWorkflow

A step is a job row with six more columns (all NULL for a job that is not a step, which
then costs nothing more than before): its workflow, its name in the workflow, the ids of
the steps it depends on and of those that depend on it, how many of its dependencies have
not ended yet, and what it does when one of them fails. A step that waits for its
dependencies has the status ``waiting``, which no claim index holds.

The rules of the graph live in one place, the workflow trigger on the job table
(:func:`step_trigger_sql`): whatever ends a step (a worker's completion, a failure, a
cancel, an expired lease, an operator's SQL), the same transaction counts it in its
workflow's row and releases, cancels or revives its dependents. Every change to a
workflow's graph first locks the workflow's row, so two of them never interleave.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, ClassVar, Final

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    FetchedValue,
    Identity,
    Index,
    Integer,
    String,
    Table,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, declared_attr, mapped_column

from sqla_jobs import ddl, validation
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.naming import identifier, names
from sqla_jobs.schema import STEP_COLUMNS, UNIQUE_KEY_COLUMN_LENGTH, JobStatus

__all__ = [
    "DEPENDENCY_POLICIES",
    "STEP_COLUMNS",
    "StepMixin",
    "WorkflowMixin",
    "WorkflowNames",
    "WorkflowStatus",
    "check_step_model",
    "drop_step_trigger_sql",
    "step_trigger_sql",
    "workflow_names",
]

#: What a step does when one of its dependencies ends dead or cancelled: ``"cancel"`` (the
#: default: it ends cancelled at once, and so do the steps that wait for it) or ``"run"``
#: (it runs once all its dependencies ended, whatever their outcome).
DEPENDENCY_POLICIES: Final = ("cancel", "run")


class WorkflowStatus(str, enum.Enum):
    """Where a workflow is: ``running`` until every step ended; then ``succeeded`` (every
    step succeeded), ``failed`` (a step ended dead or cancelled) or ``cancelled``
    (:func:`sqla_jobs.cancel_workflow` was called). A retried step makes a failed workflow
    running again."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class WorkflowNames:
    """The names of the schema objects of a job table's workflows, derived from the job
    table's name (and the workflow table's): the step index, the trigger and its
    function, and the workflow table's own index and check."""

    def __init__(self, job_table: str, workflow_table: str) -> None:
        self.job_table = job_table
        self.workflow_table = workflow_table
        self.step_index = identifier(job_table, "step_idx")
        self.status_check = identifier(job_table, "status_ck")
        self.trigger = identifier(job_table, "workflow_tg")
        self.delete_trigger = identifier(job_table, "workflow_del_tg")
        self.function = identifier(job_table, "workflow_fn")
        self.workflow_unique_index = identifier(workflow_table, "unique_idx")
        self.workflow_finished_index = identifier(workflow_table, "finished_idx")
        self.workflow_status_check = identifier(workflow_table, "status_ck")


def workflow_names(job_table: str, workflow_table: str) -> WorkflowNames:
    """The :class:`WorkflowNames` of ``job_table``'s workflows kept in ``workflow_table``."""
    return WorkflowNames(job_table, workflow_table)


def _statuses(statuses: Any) -> str:
    return ", ".join(f"'{s.value}'" for s in statuses)


class WorkflowMixin:
    """The columns of a workflow table; mix it into a declarative class of your own and name
    it as the ``workflow_model`` of a job model that mixes in :class:`StepMixin`.

    ``steps_total``, ``steps_left`` and ``steps_failed`` are kept by the workflow trigger in
    the transaction that ends each step; ``status`` turns final (and ``finished_at`` is set)
    in the one that ends the last. ``unique_key`` (set by
    :func:`sqla_jobs.enqueue_workflow`'s ``unique_key``) is unique among running workflows.
    ``trace_context`` is the creating span's, which every step's trace continues.
    """

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    name: Mapped[str] = mapped_column(String(validation.MAX_NAME_LENGTH), server_default="")
    status: Mapped[str] = mapped_column(String(16), server_default=WorkflowStatus.RUNNING.value)
    steps_total: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    steps_left: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    steps_failed: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    unique_key: Mapped[str | None] = mapped_column(
        String(UNIQUE_KEY_COLUMN_LENGTH), server_default=FetchedValue()
    )
    trace_context: Mapped[dict[str, str] | None] = mapped_column(
        JSONB(none_as_null=True),  # type: ignore[no-untyped-call, unused-ignore]
        server_default=FetchedValue(),
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    cancel_requested_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=FetchedValue()
    )
    finished_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=FetchedValue()
    )

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        table: str = cls.__tablename__  # type: ignore[attr-defined]
        running = f"status = '{WorkflowStatus.RUNNING.value}'"
        return (
            # At most one running workflow per unique key.
            Index(
                identifier(table, "unique_idx"),
                "unique_key",
                unique=True,
                postgresql_where=text(f"unique_key IS NOT NULL AND {running}"),
            ),
            # Finished workflows by finish time: what pruning deletes, oldest first.
            Index(
                identifier(table, "finished_idx"),
                "finished_at",
                "id",
                postgresql_where=text("finished_at IS NOT NULL"),
            ),
            CheckConstraint(
                f"status IN ({_statuses(WorkflowStatus)})", name=identifier(table, "status_ck")
            ),
        )


class StepMixin:
    """The columns that let a job model's jobs be steps of a workflow; mix it in beside
    :class:`~sqla_jobs.JobMixin` and set ``workflow_model`` to your
    :class:`WorkflowMixin` model (see the module docstring).

    Never set these columns yourself: :func:`sqla_jobs.enqueue_workflow` and
    :meth:`sqla_jobs.JobContext.add_steps` write them. A model with steps cannot also set
    ``delete_on_success``: a step's row must stay where its dependents and its workflow can
    read it until the workflow ends. With ``partitioned_history``, its jobs finish in place
    and the history's mover moves them: a job that is no step at its next run, a
    workflow's steps once the workflow ended, together (see :mod:`sqla_jobs.history`).
    """

    #: The :class:`WorkflowMixin` model whose rows are this model's workflows.
    workflow_model: ClassVar[type[WorkflowMixin] | None] = None
    #: Marks the job model as one with steps (read by JobMixin's table arguments).
    _sqla_jobs_steps: ClassVar[bool] = True

    workflow_id: Mapped[int | None] = mapped_column(BigInteger, server_default=FetchedValue())
    step: Mapped[str | None] = mapped_column(
        String(validation.MAX_NAME_LENGTH), server_default=FetchedValue()
    )
    depends_on: Mapped[list[int] | None] = mapped_column(
        ARRAY(BigInteger), server_default=FetchedValue()
    )
    dependents: Mapped[list[int] | None] = mapped_column(
        ARRAY(BigInteger), server_default=FetchedValue()
    )
    waiting_for: Mapped[int | None] = mapped_column(Integer, server_default=FetchedValue())
    if_dependency_fails: Mapped[str | None] = mapped_column(
        String(8), server_default=FetchedValue()
    )
    blocked_by: Mapped[int | None] = mapped_column(BigInteger, server_default=FetchedValue())


_FINAL = (JobStatus.SUCCEEDED, JobStatus.DEAD, JobStatus.CANCELLED)
_NOT_FINAL = (JobStatus.WAITING, JobStatus.PENDING, JobStatus.RUNNING)


def step_trigger_sql(
    job_table: Table | str,
    workflow_table: Table | str,
    *,
    schema: str | None = None,
    workflow_schema: str | None = None,
) -> tuple[str, str, str]:
    """``CREATE OR REPLACE FUNCTION`` of the workflow trigger's function, and its two
    ``CREATE TRIGGER`` (after an update of ``status``, after a delete).

    The trigger runs after a step's row changes status across the line between running
    (waiting, pending, running) and ended (succeeded, dead, cancelled), or is deleted
    before it ended (counted as cancelled). In the same transaction, with the workflow's
    row locked first:

    * a step ended: its workflow's ``steps_left`` goes down by one (``steps_failed`` up by
      one unless it succeeded), and the workflow ends with the last step. Then each waiting
      dependent counts it as ended (``waiting_for`` minus one; at zero it turns pending and
      a worker is woken), except when the step failed and the dependent's policy is
      ``cancel``: then the dependent, and every waiting step that depends on it through
      steps whose policy is ``cancel``, end cancelled at once, in one statement, each with
      ``blocked_by`` naming this step;
    * an ended step runs again (an operator's retry): the workflow counts it as running
      again (and is running again), and the steps that its failure cancelled wait again,
      each for its dependencies that have not ended; one that another failed dependency
      still blocks stays cancelled.

    Rows the trigger itself updates fire it again, one level deep: a cancelled dependent's
    own dependents are already cancelled, or counted by it like any ended step.
    """
    job = (
        job_table if isinstance(job_table, str) else job_table.name,
        schema if isinstance(job_table, str) else job_table.schema,
    )
    flow = (
        workflow_table if isinstance(workflow_table, str) else workflow_table.name,
        workflow_schema if isinstance(workflow_table, str) else workflow_table.schema,
    )
    n = workflow_names(job[0], flow[0])
    t = ddl.qualified_name(*job)
    w = ddl.qualified_name(*flow)
    channel = ddl.literal(names(job[0]).channel)
    final = _statuses(_FINAL)
    succeeded = f"'{JobStatus.SUCCEEDED.value}'"
    cancelled = f"'{JobStatus.CANCELLED.value}'"
    dead = f"'{JobStatus.DEAD.value}'"
    waiting = f"'{JobStatus.WAITING.value}'"
    pending = f"'{JobStatus.PENDING.value}'"
    body = f"""
DECLARE
    s record;
    ended text;
    woken int;
    revived bigint[];
    kept bigint[];
BEGIN
    IF TG_OP = 'DELETE' THEN
        s := OLD;
        ended := {cancelled};
    ELSE
        s := NEW;
        IF NEW.status IN ({final}) THEN
            ended := NEW.status;
        END IF;
    END IF;
    IF ended IS NOT NULL THEN
        -- The workflow's row first: every change to a workflow's graph holds its lock.
        UPDATE {w} SET
            steps_left = steps_left - 1,
            steps_failed = steps_failed + (ended <> {succeeded})::int,
            status = CASE
                WHEN steps_left > 1 THEN status
                WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
                WHEN steps_failed + (ended <> {succeeded})::int > 0 THEN 'failed'
                ELSE 'succeeded' END,
            finished_at = CASE WHEN steps_left > 1 THEN NULL ELSE statement_timestamp() END
        WHERE id = s.workflow_id;
        IF s.dependents IS NULL THEN
            RETURN NULL;
        END IF;
        -- Each dependent that waits for it counts it as ended, unless it failed and the
        -- dependent's policy is to cancel; at zero the dependent is runnable, and woken.
        WITH released AS (
            UPDATE {t} SET
                waiting_for = waiting_for - 1,
                status = CASE WHEN waiting_for > 1 THEN {waiting} ELSE {pending} END
            WHERE id = ANY (s.dependents) AND status = {waiting}
                AND (ended = {succeeded} OR if_dependency_fails = 'run')
            RETURNING queue, status
        )
        SELECT count(pg_notify({channel}, queue)) INTO woken
        FROM (SELECT DISTINCT queue FROM released WHERE status = {pending}) AS runnable;
        IF ended <> {succeeded} THEN
            -- Its failure cancels the waiting steps that depend on it through steps whose
            -- policy is cancel: all of them at once (a chain is one statement, not a
            -- trigger per link; their own triggers then find nothing left to cancel).
            WITH RECURSIVE doomed(id, dependents) AS (
                SELECT id, dependents FROM {t}
                WHERE id = ANY (s.dependents) AND status = {waiting}
                    AND if_dependency_fails IS DISTINCT FROM 'run'
                UNION
                SELECT d.id, d.dependents FROM doomed AS p
                JOIN {t} AS d ON d.id = ANY (p.dependents)
                WHERE d.status = {waiting} AND d.if_dependency_fails IS DISTINCT FROM 'run'
            )
            UPDATE {t} SET
                status = {cancelled},
                finished_at = statement_timestamp(),
                blocked_by = s.id,
                last_error = 'step ' || s.id || ' (' || coalesce(s.step, '') || ') ended '
                    || ended
            WHERE id IN (SELECT id FROM doomed) AND status = {waiting};
        END IF;
        RETURN NULL;
    END IF;
    -- An ended step runs again: the workflow counts it as running again.
    UPDATE {w} SET
        steps_left = steps_left + 1,
        steps_failed = steps_failed - (OLD.status <> {succeeded})::int,
        status = 'running',
        finished_at = NULL
    WHERE id = s.workflow_id;
    IF pg_trigger_depth() > 1 THEN
        RETURN NULL;  -- revived by the step below, which recounted its dependents
    END IF;
    -- The steps its failure cancelled wait again, but for one that another ended dependency
    -- (dead or cancelled, and not revived here) still blocks.
    revived := ARRAY(
        SELECT id FROM {t}
        WHERE workflow_id = s.workflow_id AND status = {cancelled} AND blocked_by = s.id
    );
    LOOP
        kept := ARRAY(
            SELECT r.id FROM {t} AS r
            WHERE r.id = ANY (revived)
                AND (r.if_dependency_fails = 'run' OR NOT EXISTS (
                    SELECT FROM {t} AS p
                    WHERE p.id = ANY (r.depends_on) AND p.status IN ({dead}, {cancelled})
                        AND p.id <> ALL (revived) AND p.id <> s.id))
        );
        EXIT WHEN cardinality(kept) = cardinality(revived);
        revived := kept;
    END LOOP;
    -- The waiting steps that had counted one of them as ended count it again.
    UPDATE {t} AS d SET waiting_for = d.waiting_for + c.n
    FROM (
        SELECT dependent, count(*) AS n
        FROM {t} AS p, unnest(p.dependents) AS dependent
        WHERE p.id = ANY (revived || s.id)
        GROUP BY dependent
    ) AS c
    WHERE d.id = c.dependent AND d.status = {waiting} AND d.id <> ALL (revived);
    UPDATE {t} AS r SET
        status = {waiting},
        finished_at = NULL,
        blocked_by = NULL,
        last_error = NULL,
        waiting_for = (
            SELECT count(*) FROM {t} AS p
            WHERE p.id = ANY (r.depends_on)
                AND (p.status NOT IN ({final}) OR p.id = ANY (revived))
        )
    WHERE r.id = ANY (revived);
    RETURN NULL;
END;
"""
    function_name = ddl.qualified_name(n.function, job[1])
    function = (
        f"CREATE OR REPLACE FUNCTION {function_name}() "
        f"RETURNS trigger LANGUAGE plpgsql AS {ddl.BODY_TAG}{body}{ddl.BODY_TAG}"
    )
    not_final = _statuses(_NOT_FINAL)
    # Fired only where a step crosses the line between running and ended (a job that is
    # not a step, whose workflow_id is NULL, never fires it: the condition is all it costs).
    on_update = (
        f"CREATE TRIGGER {ddl.quote(n.trigger)} "
        f"AFTER UPDATE OF status ON {t} FOR EACH ROW "
        f"WHEN (OLD.workflow_id IS NOT NULL "
        f"AND (OLD.status IN ({not_final})) = (NEW.status IN ({final}))) "
        f"EXECUTE FUNCTION {function_name}()"
    )
    on_delete = (
        f"CREATE TRIGGER {ddl.quote(n.delete_trigger)} "
        f"AFTER DELETE ON {t} FOR EACH ROW "
        f"WHEN (OLD.workflow_id IS NOT NULL AND OLD.status IN ({not_final})) "
        f"EXECUTE FUNCTION {function_name}()"
    )
    return function, on_update, on_delete


def drop_step_trigger_sql(
    job_table: Table | str,
    workflow_table: Table | str,
    *,
    schema: str | None = None,
) -> tuple[str, str, str]:
    """``DROP TRIGGER IF EXISTS`` of both workflow triggers, then ``DROP FUNCTION IF
    EXISTS`` of their function."""
    job = (
        job_table if isinstance(job_table, str) else job_table.name,
        schema if isinstance(job_table, str) else job_table.schema,
    )
    flow = workflow_table if isinstance(workflow_table, str) else workflow_table.name
    n = workflow_names(job[0], flow)
    t = ddl.qualified_name(*job)
    return (
        f"DROP TRIGGER IF EXISTS {ddl.quote(n.trigger)} ON {t}",
        f"DROP TRIGGER IF EXISTS {ddl.quote(n.delete_trigger)} ON {t}",
        f"DROP FUNCTION IF EXISTS {ddl.qualified_name(n.function, job[1])}()",
    )


def check_step_model(model: type[Any]) -> Table:
    """The workflow table of job model ``model`` (one that mixes in :class:`StepMixin`), or
    ConfigurationError: it names no ``workflow_model``, or sets ``delete_on_success`` (a
    step's row stays where its dependents and its workflow read it until the workflow
    ends; with ``partitioned_history``, the steps of a workflow move into the history
    together once it ended)."""
    workflow_model = getattr(model, "workflow_model", None)
    table = getattr(workflow_model, "__table__", None)
    if not (
        isinstance(workflow_model, type)
        and issubclass(workflow_model, WorkflowMixin)
        and isinstance(table, Table)
    ):
        raise ConfigurationError(
            f"{model.__name__} mixes in StepMixin: set its workflow_model to a mapped class "
            f"that mixes in WorkflowMixin, not {workflow_model!r}"
        )
    if getattr(model, "delete_on_success", False):
        raise ConfigurationError(
            f"{model.__name__} mixes in StepMixin and sets delete_on_success: a workflow "
            "step's row stays in the job table until its workflow ends (its dependents and "
            "its workflow read it); prune finished workflows with sqla_jobs.prune"
        )
    return table
