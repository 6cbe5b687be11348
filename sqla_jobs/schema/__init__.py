"""The job and result columns, as SQLAlchemy declarative mixins.

Users mix :class:`JobMixin` (and optionally :class:`JobResultMixin`) into their own
declarative classes, choose the table name and add columns of their own::

    class Base(DeclarativeBase):
        pass

    class EmailJob(JobMixin, Base):
        __tablename__ = "email_jobs"
        order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))

    class EmailJobResult(JobResultMixin, Base):
        __tablename__ = "email_job_results"

Every index and constraint name derives from the table name through :func:`names`, which
the migration helpers use too, so a model and its migration always agree.
"""

from __future__ import annotations

import enum
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    FetchedValue,
    Identity,
    Index,
    Integer,
    Interval,
    SmallInteger,
    String,
    Table,
    Text,
    event,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import InstanceState, Mapped, Mapper, declared_attr, mapped_column

from sqla_jobs import ddl, tracing, validation
from sqla_jobs.errors import ConfigurationError, InvalidJobError, UniqueJobError
from sqla_jobs.naming import TableNames, identifier, names

__all__ = [
    "DEFAULT_QUEUE",
    "DEFAULT_UNIQUE_STATUSES",
    "FINISHED_STATUSES",
    "PLAIN_STATUSES",
    "RUNNABLE_STATUSES",
    "STEP_COLUMNS",
    "JobMixin",
    "JobResultMixin",
    "JobStatus",
    "ScheduleMixin",
    "TableNames",
    "dead_predicate",
    "has_steps",
    "key_predicate",
    "keyed_pending_predicate",
    "names",
    "pending_predicate",
    "running_predicate",
    "unique_predicate",
]

DEFAULT_QUEUE = "default"


class JobStatus(str, enum.Enum):
    """Where a job is in its life.

    ``waiting`` jobs are steps of a workflow that wait for their dependencies
    (:mod:`sqla_jobs.schema.workflows`; only a model with steps has them); ``pending`` jobs
    wait for their run-at time (a retry waits here too, with a later run-at); ``running``
    jobs are held by one attempt (by its lease, or by its row lock); ``succeeded``, ``dead``
    (failed its last attempt) and ``cancelled`` are final until an operator retries.
    """

    WAITING = "waiting"
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"


RUNNABLE_STATUSES = (JobStatus.PENDING, JobStatus.RUNNING)
#: The columns :class:`~sqla_jobs.schema.workflows.StepMixin` adds to a job table.
STEP_COLUMNS = (
    "workflow_id",
    "step",
    "depends_on",
    "dependents",
    "waiting_for",
    "if_dependency_fails",
    "blocked_by",
)
#: The statuses a job table without steps allows (every one but ``waiting``).
PLAIN_STATUSES = tuple(s for s in JobStatus if s is not JobStatus.WAITING)
FINISHED_STATUSES = (JobStatus.SUCCEEDED, JobStatus.DEAD, JobStatus.CANCELLED)
#: The statuses in which a unique job holds its key unless told otherwise: at most one job
#: per key is pending or running. A set must include both (a key that a running job did not
#: hold would let a duplicate run beside it).
DEFAULT_UNIQUE_STATUSES = RUNNABLE_STATUSES
#: The longest stored unique key: an explicit key of up to MAX_UNIQUE_KEY_LENGTH characters
#: plus a period bucket suffix ("@" and up to 20 digits).
UNIQUE_KEY_COLUMN_LENGTH = 255


def _status_list(statuses: tuple[JobStatus, ...]) -> str:
    return ", ".join(f"'{s.value}'" for s in statuses)


def pending_predicate() -> str:
    """The predicate of the pending index, as SQL text: ``status = 'pending' AND
    ordering_key IS NULL`` (jobs with an ordering key have an index of their own, so that
    the plain claim never reads them: :func:`keyed_pending_predicate`).

    The claim statement repeats it with a literal value (never a bind parameter), so that
    the planner can prove the partial index applies even to a prepared, generic plan.
    """
    return f"status = '{JobStatus.PENDING.value}' AND ordering_key IS NULL"


def keyed_pending_predicate() -> str:
    """The predicate of the keyed pending index (schema version 3), as SQL text:
    ``status = 'pending' AND ordering_key IS NOT NULL``."""
    return f"status = '{JobStatus.PENDING.value}' AND ordering_key IS NOT NULL"


def key_predicate() -> str:
    """The predicate of the key index (schema version 3), as SQL text: the jobs of a key
    that are pending or running."""
    return (
        f"ordering_key IS NOT NULL AND status IN ('{JobStatus.PENDING.value}', "
        f"'{JobStatus.RUNNING.value}')"
    )


def running_predicate() -> str:
    """The predicate of the running index, as SQL text: ``status = 'running'`` (see
    :func:`pending_predicate`)."""
    return f"status = '{JobStatus.RUNNING.value}'"


def dead_predicate() -> str:
    """The predicate of the dead index, as SQL text: ``status = 'dead'`` (see
    :func:`pending_predicate`)."""
    return f"status = '{JobStatus.DEAD.value}'"


def unique_predicate() -> str:
    """The predicate of the unique index, as SQL text.

    A job holds its key only while its status is one of *its own* unique statuses (stored
    with the job, so each enqueue may choose its set without another index); a job without
    a key is not in the index at all. ``INSERT ... ON CONFLICT`` repeats the predicate word
    for word, so that PostgreSQL infers this index as the arbiter.
    """
    return "unique_key IS NOT NULL AND status = ANY (unique_statuses)"


class JobMixin:
    """The columns of a job table; mix it into a declarative class of your own.

    Adding an instance to a session enqueues the job, and the job exists if and only if that
    session's transaction commits (a transactional outbox)::

        with Session(engine) as session, session.begin():
            session.add(Order(id=7))
            session.add(EmailJob(task="send_receipt", args={"order": 7}, queue="email"))

    Values are checked as they are assigned (:class:`~sqla_jobs.errors.InvalidJobError`
    names the field), and ``args`` once more at flush, because a dict can be changed in place
    after it was assigned. A check that fails at assignment (the constructor included) is an
    ordinary exception: the value is not set and nothing else changes, so a caller who
    catches it and commits does commit their other rows. A check that fails at flush aborts
    the session's transaction: nothing of that transaction is written.

    Columns left unset take their database defaults (``queue`` ``'default'``, ``status``
    ``'pending'``, ``priority`` 0, ...), which the flush reads back into the object; before
    the flush they read ``None``.

    Class-level options (set them on your subclass):

    ``max_args_bytes``
        The largest accepted size of ``args`` as compact JSON, in bytes (default 256 KiB).
    ``delete_on_success``
        Delete the job row when it succeeds, keeping only its result row if one is stored
        (default ``False``: keep the row as ``succeeded`` until it is pruned).
    ``result_model``
        The :class:`JobResultMixin` model that stores the values handlers return, declared
        once here instead of on every :func:`~sqla_jobs.complete` call or
        :class:`~sqla_jobs.Registry` (default ``None``: return values are not stored).
    ``partitioned_history``
        Move each finished job (succeeded, dead, cancelled), with its result, out of this
        table into its history table, partitioned by day (:mod:`sqla_jobs.history`), so
        that this table holds only the jobs still to run (default ``False``).

    Ordering keys (schema version 3): a job with an ``ordering_key`` runs only when fewer
    than its ``key_limit`` (default 1: one at a time, in order) jobs of that key are in
    progress, and after the key's jobs that sort before it; see
    :func:`sqla_jobs.claim` (``keys=True``).
    """

    max_args_bytes: ClassVar[int] = validation.DEFAULT_MAX_ARGS_BYTES
    delete_on_success: ClassVar[bool] = False
    result_model: ClassVar[type[JobResultMixin] | None] = None
    partitioned_history: ClassVar[bool] = False

    # No Python-side defaults (``default=``), only server defaults, and FetchedValue() (no
    # DDL) on the nullable managed columns: the ORM's INSERT then sends only the columns the
    # caller set (task, args, ...) instead of every column of every row, and reads the
    # defaults back through RETURNING. Measured on add_all() + flush(): 7k -> 11k jobs/s.
    # Until the flush, an attribute left unset reads None.
    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    queue: Mapped[str] = mapped_column(
        String(validation.MAX_NAME_LENGTH), server_default=DEFAULT_QUEUE
    )
    task: Mapped[str] = mapped_column(String(validation.MAX_NAME_LENGTH))
    args: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    status: Mapped[str] = mapped_column(String(16), server_default=JobStatus.PENDING.value)
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("0"))
    run_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(
        Integer,
        server_default=text(str(validation.DEFAULT_MAX_ATTEMPTS)),
    )
    lease_expires_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=FetchedValue()
    )
    leased_by: Mapped[str | None] = mapped_column(
        String(validation.MAX_NAME_LENGTH), server_default=FetchedValue()
    )
    last_error: Mapped[str | None] = mapped_column(Text, server_default=FetchedValue())
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=FetchedValue()
    )
    # Unique jobs (schema version 3): set only by sqla_jobs.enqueue_unique(_many), never by
    # assignment (see _refuse_unique). NULL for every other job, which the unique index
    # then leaves out: a job without a key costs that index nothing.
    unique_key: Mapped[str | None] = mapped_column(
        String(UNIQUE_KEY_COLUMN_LENGTH), server_default=FetchedValue()
    )
    unique_statuses: Mapped[list[str] | None] = mapped_column(
        ARRAY(String(16)), server_default=FetchedValue()
    )
    # Schema version 3: when sqla_jobs.cancel() asked the running attempt to stop (database
    # time). Once set, the job ends cancelled: no transition makes it pending or succeeded.
    cancel_requested_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=FetchedValue()
    )
    # Schema version 3: per-key order and limits. Nullable, no default: adding them to a
    # live table rewrites nothing, and a job without a key is in none of the keyed indexes.
    # FetchedValue(), as above: an INSERT of a job without them does not send them.
    ordering_key: Mapped[str | None] = mapped_column(
        String(validation.MAX_KEY_LENGTH), server_default=FetchedValue()
    )
    key_limit: Mapped[int | None] = mapped_column(SmallInteger, server_default=FetchedValue())
    # Schema version 3: the enqueuer's trace context (W3C ``traceparent``/``tracestate`` as
    # the OpenTelemetry propagator writes them), or NULL; set at insert (sqla_jobs.tracing).
    trace_context: Mapped[dict[str, str] | None] = mapped_column(
        # (JSONB's constructor is untyped in SQLAlchemy 2.0.30, the lowest version.)
        JSONB(none_as_null=True),  # type: ignore[no-untyped-call, unused-ignore]
        server_default=FetchedValue(),
    )

    # Schema version 4 (job control). The job's own time limit, NULL for its task's
    # (sqla_jobs.Task's time_limit; none when neither has one). FetchedValue(), as above.
    time_limit: Mapped[timedelta | None] = mapped_column(Interval, server_default=FetchedValue())
    # How many times the job snoozed (sqla_jobs.Snooze: run again later, no attempt spent).
    snoozes: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # The latest progress its running handler reported (ctx.report_progress): {"value": a
    # number, "message": text, "at": database time}, or NULL. Kept once the job ends.
    progress: Mapped[dict[str, Any] | None] = mapped_column(
        JSONB(none_as_null=True),  # type: ignore[no-untyped-call, unused-ignore]
        server_default=FetchedValue(),
    )
    # When its latest attempt started: set by the claim that started it, in the same UPDATE
    # (database time: the claim statement's start), NULL until its first claim. What the
    # dashboard counts a running job's time from.
    attempted_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=FetchedValue()
    )

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        n = names(cls.__tablename__)  # type: ignore[attr-defined]
        steps = has_steps(cls)
        statuses = tuple(JobStatus) if steps else PLAIN_STATUSES
        return (
            *(_step_table_args(n.table) if steps else ()),
            # The claim's two indexes (schema version 2), partial so that a claim's cost grows
            # neither with the finished history nor with the jobs in flight. Pending jobs in
            # claim order: a claimed job leaves the index, so running ones are never read on
            # the way to the next pending one.
            Index(
                n.pending_index,
                "queue",
                "priority",
                "run_at",
                "id",
                postgresql_where=text(pending_predicate()),
            ),
            # Running jobs by lease end: the claim reads only the expired leases, never the
            # live ones. (lease_expires_at is indexed, so a heartbeat is not a HOT update.)
            Index(
                n.running_index,
                "queue",
                "lease_expires_at",
                postgresql_where=text(running_predicate()),
            ),
            # Dead jobs by queue and finish time (schema version 3): health checks and
            # `sqla-jobs status` count and list them from this small index, never from the
            # finished history. Only a job that dies or is retried from dead writes to it.
            Index(
                n.dead_index,
                "queue",
                "finished_at",
                "id",
                postgresql_where=text(dead_predicate()),
            ),
            # Unique jobs (schema version 3): at most one job per key among the jobs whose
            # status is in their own unique statuses. A job that leaves them (completes, is
            # moved to a history table) frees its key with no extra write: its new row
            # version fails the predicate and gets no entry.
            Index(
                n.unique_index,
                "unique_key",
                unique=True,
                postgresql_where=text(unique_predicate()),
            ),
            # Schema version 3. Pending jobs with an ordering key, in claim order: where the
            # keyed claim finds the keys worth looking at. Jobs without a key are never in it.
            Index(
                n.keyed_pending_index,
                "queue",
                "priority",
                "run_at",
                "id",
                postgresql_where=text(keyed_pending_predicate()),
            ),
            # A key's jobs: its new ones (attempts = 0) in (priority, run_at, id) order, one
            # range of this index; its retries (attempts > 0) and running ones, the next.
            Index(
                n.key_index,
                "ordering_key",
                "status",
                "attempts",
                "priority",
                "run_at",
                "id",
                postgresql_where=text(key_predicate()),
            ),
            CheckConstraint(f"status IN ({_status_list(statuses)})", name=n.status_check),
            CheckConstraint(
                f"priority BETWEEN {validation.PRIORITY_MIN} AND {validation.PRIORITY_MAX}",
                name=n.priority_check,
            ),
            CheckConstraint("attempts >= 0 AND max_attempts >= 1", name=n.attempts_check),
        )

    if not TYPE_CHECKING:  # at run time only: to a type checker, assignments stay typed

        def __setattr__(self, key: str, value: object) -> None:
            # Every job field is checked as it is assigned, the constructor's keyword
            # arguments included (SQLAlchemy's constructor assigns them one by one). A plain
            # __setattr__ rather than @validates: validators are attribute events, and on
            # add_all's hot path their dispatch cost about as much as the checks themselves
            # (callgrind, instructions per constructed job of 5,000: 121.2k with @validates,
            # 119.6k here; the bare declarative class 70.4k).
            if key in _CHECKED_FIELDS:
                value = _checked(self, key, value)
            super().__setattr__(key, value)

    def __repr__(self) -> str:
        # Only what the instance already holds: reading a mapped attribute could load it
        # (SQL in a log line), or raise DetachedInstanceError once it is expired and its
        # session gone, which is exactly when a job tends to get logged. An attribute not
        # loaded is left out; the id of an expired job still shows, from its identity key.
        loaded = self.__dict__
        state = loaded.get("_sa_instance_state")
        job_id = loaded.get("id")
        if job_id is None and state is not None and state.key is not None:
            job_id = state.key[1][0]
        parts = [f"id={job_id}"]
        parts += [f"{key}={loaded[key]!r}" for key in ("task", "queue") if key in loaded]
        if "status" in loaded:
            parts.append(f"status={loaded['status']}")
        if "attempts" in loaded or "max_attempts" in loaded:
            parts.append(
                f"attempts={loaded.get('attempts', '?')}/{loaded.get('max_attempts', '?')}"
            )
        return f"<{type(self).__name__} {' '.join(parts)}>"


def _step_table_args(table: str) -> tuple[Any, ...]:
    # What a model with steps adds (sqla_jobs.schema.workflows): the step index, a
    # workflow's steps by name, unique; jobs that are not steps are not in it.
    return (
        Index(
            identifier(table, "step_idx"),
            "workflow_id",
            "step",
            unique=True,
            postgresql_where=text("workflow_id IS NOT NULL"),
        ),
    )


def has_steps(model: object) -> bool:
    """Whether ``model`` is a job model whose jobs can be workflow steps (it mixes in
    :class:`~sqla_jobs.schema.workflows.StepMixin`)."""
    return bool(getattr(model, "_sqla_jobs_steps", False))


def job_table_of(model: object) -> Table:
    """The job table of ``model`` (a mapped class that mixes in :class:`JobMixin`, or the
    table itself); ConfigurationError for anything else."""
    if isinstance(model, Table):
        return model
    table = getattr(model, "__table__", None)
    if not (isinstance(model, type) and issubclass(model, JobMixin) and isinstance(table, Table)):
        raise ConfigurationError(f"{model!r} is not a mapped class that mixes in JobMixin")
    return table


class ScheduleMixin:
    """One row per periodic task: the latest slot a job was enqueued for.

    The worker's scheduler (:mod:`sqla_jobs.periodic`) moves ``last_slot`` forward with
    ``UPDATE ... WHERE last_slot < :slot`` in the transaction that enqueues the slot's job,
    so exactly one worker wins each slot, and no slot runs twice even after its job finished
    and left the job table. Mix it into a model of yours next to your job model, and give it
    to the :class:`~sqla_jobs.Registry` (``schedule_model=``)::

        class EmailJobSchedule(ScheduleMixin, Base):
            __tablename__ = "email_job_schedules"
    """

    name: Mapped[str] = mapped_column(String(validation.MAX_NAME_LENGTH), primary_key=True)
    last_slot: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class JobResultMixin:
    """The columns of a result table: one row per succeeded job that stored a value.

    ``job_id`` is deliberately not a foreign key, so that a job table with
    ``delete_on_success = True`` can drop the job row and keep only its result.
    """

    job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    task: Mapped[str] = mapped_column(String(validation.MAX_NAME_LENGTH))
    value: Mapped[Any] = mapped_column(JSONB, nullable=True)
    finished_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )


# Set on an instance by the ``args`` check: (validation.args_snapshot() of the value it
# passed, the size limit it was checked against).
_CHECKED_ARGS = "_sqla_jobs_checked_args"
_UNIQUE_FIELDS = frozenset({"unique_key", "unique_statuses"})
#: The columns of a workflow step (sqla_jobs.schema.workflows.StepMixin), which only
#: sqla_jobs.enqueue_workflow and JobContext.add_steps write.
_STEP_FIELDS = frozenset(STEP_COLUMNS)
_CHECKED_FIELDS = (
    validation.JOB_FIELDS | {"status", "trace_context"} | _UNIQUE_FIELDS | _STEP_FIELDS
)
_STATUS_VALUES = frozenset(s.value for s in JobStatus)


def _checked(job: JobMixin, key: str, value: object) -> object:
    """The value to store for the job field ``key`` (or InvalidJobError), as it is assigned."""
    if key in _UNIQUE_FIELDS:
        # A plain INSERT of a duplicate key would abort the caller's whole transaction at
        # flush, by surprise: refuse it here, at assignment, before anything is written.
        if value is None:
            return value
        raise UniqueJobError(
            key,
            "is set by sqla_jobs.enqueue_unique(session, job, key=...) (or "
            "enqueue_unique_many), which never aborts your transaction on a duplicate; "
            "session.add() of a job with a unique key would",
        )
    if key in _STEP_FIELDS:
        if value is None:
            return value
        raise InvalidJobError(
            key, "is set by sqla_jobs.enqueue_workflow (or JobContext.add_steps), never by hand"
        )
    if key == "status":
        if isinstance(value, JobStatus):
            value = value.value
        if value == JobStatus.WAITING.value:
            raise InvalidJobError(
                key,
                "'waiting' is a workflow step's status until its dependencies end; "
                "sqla_jobs.enqueue_workflow sets it",
            )
        if not isinstance(value, str) or value not in _STATUS_VALUES:
            raise InvalidJobError(key, f"must be one of {[s.value for s in JobStatus]}")
        return value
    if key == "trace_context":
        return validation.check_trace_context(key, value)
    limit = job.max_args_bytes
    if key == "args":
        # Remember what passed, so that the flush can tell cheaply that it is unchanged.
        snapshot = validation.checked_args(key, value, max_bytes=limit)
        job.__dict__[_CHECKED_ARGS] = (snapshot, limit)
        return value
    return validation.check_field(key, value, max_args_bytes=limit)


def _recheck_args(_mapper: object, _connection: object, state: InstanceState[JobMixin]) -> None:
    # A dict can be changed in place after it was assigned, which no validator sees; check
    # once more before the INSERT. Raising here aborts the flush and the session's
    # transaction, so nothing of the transaction is written. (raw=True: the listener gets
    # the InstanceState, and reads the instance's dict directly: an ``args`` that is not
    # loaded was not changed, and reading it through the attribute would load it mid-flush.)
    loaded = state.dict
    args = loaded.get("args")
    if args is None:  # never assigned (the column default, {}, applies) or not loaded
        return
    # The same bytes are the same value (see args_snapshot), whatever happened in between:
    # then the check at assignment still holds, and the JSON encoding can be skipped.
    snapshot, limit = loaded.pop(_CHECKED_ARGS, (None, 0))
    max_bytes = state.class_.max_args_bytes
    if snapshot is not None and limit <= max_bytes and validation.args_snapshot(args) == snapshot:
        return
    validation.check_args("args", args, max_bytes=max_bytes)


def _before_insert(mapper: object, connection: object, state: InstanceState[JobMixin]) -> None:
    _recheck_args(mapper, connection, state)
    # The ORM's enqueue paths (session.add, Task.enqueue, sqla_jobs.aio): the trace context
    # of the span current at the flush, unless the caller set one. Here rather than as the
    # column's Python-side default, which the ORM would evaluate, send and set back on every
    # row (measured: 5-10% of add_all's CPU per job); this costs a function call. The
    # column's FetchedValue keeps it out of the INSERT when it is not set, as above.
    context = tracing.enqueue_context()
    if context is not None and "trace_context" not in state.dict:
        target = state.obj()
        if target is not None:
            target.trace_context = context


event.listen(JobMixin, "before_insert", _before_insert, propagate=True, raw=True)
event.listen(JobMixin, "before_update", _recheck_args, propagate=True, raw=True)


def _attach_table_ddl(mapper: Mapper[Any], _class: type[Any]) -> None:
    # So that metadata.create_all() builds what the migrations build: the NOTIFY trigger and
    # the storage parameters (sqla_jobs.ddl), on PostgreSQL only.

    table = mapper.local_table
    if not isinstance(table, Table) or table.info.get("sqla_jobs_ddl"):
        return  # a single-table subclass shares its parent's table, which already has it
    table.info["sqla_jobs_ddl"] = True
    after_create: tuple[str, ...] = (
        ddl.set_storage_parameters(table.name, table.schema),
        ddl.create_notify_function(table.name, table.schema),
        ddl.create_notify_trigger(table.name, table.schema),
    )
    before_drop: tuple[str, ...] = (
        ddl.drop_notify_trigger(table.name, table.schema),
        ddl.drop_notify_function(table.name, table.schema),
    )
    if has_steps(_class):
        from sqla_jobs.schema import workflows  # a module of this package that imports it

        workflow_table = workflows.check_step_model(_class)
        after_create += workflows.step_trigger_sql(table, workflow_table)
        before_drop += workflows.drop_step_trigger_sql(table, workflow_table)
    for sql in after_create:
        event.listen(table, "after_create", ddl.executable(sql).execute_if(dialect="postgresql"))
    for sql in before_drop:
        event.listen(table, "before_drop", ddl.executable(sql).execute_if(dialect="postgresql"))


event.listen(JobMixin, "after_mapper_constructed", _attach_table_ddl, propagate=True)
