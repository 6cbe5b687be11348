"""Enqueue and periodic-job statements (see :mod:`sqla_jobs._queries`)."""

from __future__ import annotations

from typing import Any, Final, NamedTuple, TypedDict, TypeVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Float,
    Insert,
    Integer,
    Select,
    Table,
    Text,
    Update,
    any_,
    bindparam,
    case,
    cast,
    column,
    func,
    literal_column,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, insert
from sqlalchemy.orm import Session

from sqla_jobs._queries._sql import (
    _ONE,
    _now,
)
from sqla_jobs._queries.run import Query
from sqla_jobs.schema import STEP_COLUMNS as schema_step_columns
from sqla_jobs.schema import JobMixin, JobStatus, unique_predicate

# -- enqueue -------------------------------------------------------------------------------

#: The job inputs that the mixin declares, which :func:`enqueue_many` always takes.
ENQUEUE_COLUMNS: Final = ("queue", "task", "args", "priority", "run_at", "max_attempts")
#: The columns the queue itself manages; an enqueuer never sets them.
MANAGED_COLUMNS: Final = frozenset(
    {
        "id",
        "status",
        "attempts",
        "lease_expires_at",
        "leased_by",
        "last_error",
        "created_at",
        "finished_at",
        "cancel_requested_at",
        "snoozes",
        "progress",
        "attempted_at",
    }
)
#: A workflow step's columns (:class:`~sqla_jobs.schema.workflows.StepMixin`), which only
#: :func:`sqla_jobs.enqueue_workflow` and ``JobContext.add_steps`` set.
STEP_COLUMNS: Final = frozenset(schema_step_columns)

#: The columns filled in from the enqueuer's context, never from the enqueuer's values
#: (schema version 3: the trace context, see sqla_jobs.tracing).
CONTEXT_COLUMNS: Final = frozenset({"trace_context"})


#: The unique-job columns (schema version 3), written only by :func:`enqueue_unique`.
UNIQUE_COLUMNS: Final = frozenset({"unique_key", "unique_statuses"})


#: The columns of ordering keys (schema version 3): an enqueuer sets them like its own
#: columns, but they are the library's, not the model's.
ORDERING_COLUMNS: Final = frozenset({"ordering_key", "key_limit"})

#: The columns of job control (schema version 4): the job's own time limit, which an
#: enqueuer sets like the ordering columns, and three the queue manages (in
#: :data:`MANAGED_COLUMNS`): how often the job snoozed, its latest progress, and when its
#: latest attempt started.
CONTROL_COLUMNS: Final = frozenset({"time_limit", "snoozes", "progress", "attempted_at"})
#: The columns of :data:`CONTROL_COLUMNS` an enqueuer may set.
CONTROL_INPUTS: Final = frozenset({"time_limit"})


def enqueue_columns(table: Table) -> tuple[str, ...]:
    """The columns :func:`enqueue_many` inserts: :data:`ENQUEUE_COLUMNS`, then the model's own
    columns (neither the mixin's inputs, nor :data:`MANAGED_COLUMNS`, nor
    :data:`UNIQUE_COLUMNS`, nor :data:`CONTEXT_COLUMNS`) in table order."""
    own = tuple(
        c.name
        for c in table.columns
        if c.name not in MANAGED_COLUMNS
        and c.name not in ENQUEUE_COLUMNS
        and c.name not in UNIQUE_COLUMNS
        and c.name not in CONTEXT_COLUMNS
        and c.name not in STEP_COLUMNS
    )
    return ENQUEUE_COLUMNS + own


def _recordset_values(table: Table, *extra: Any) -> tuple[list[Any], Any, list[ColumnElement[Any]]]:
    """The enqueue columns, the ``jsonb_to_recordset(:rows)`` they are read from (with the
    ``extra`` columns too), and each column's value with its server default applied."""
    columns = [table.c[name] for name in enqueue_columns(table)]
    rows = (
        func.jsonb_to_recordset(func.cast(bindparam("rows", type_=Text), JSONB))
        .table_valued(*(column(c.name, c.type) for c in columns), *extra)
        .render_derived(name="r", with_types=True)
    )
    values: list[ColumnElement[Any]] = []
    for column_ in columns:
        value: ColumnElement[Any] = rows.c[column_.name]
        default_arg = getattr(column_.server_default, "arg", None)
        if isinstance(default_arg, str):
            value = func.coalesce(value, literal_column("'" + default_arg.replace("'", "''") + "'"))
        elif default_arg is not None:
            value = func.coalesce(value, default_arg)
        values.append(value)
    return columns, rows, values


def enqueue_many(table: Table) -> Insert:
    """Insert a batch of pending jobs from ``:rows``, a JSON array of objects (as text).

    ``INSERT INTO t (queue, task, args, ...) SELECT ... FROM jsonb_to_recordset(:rows)``:
    one statement per batch whatever its size, and the same SQL text for every size, so
    PostgreSQL prepares it once; the whole batch crosses the wire as one JSON document that
    the client encodes in one call (measured faster than one array per column, whose text
    elements the driver must escape one by one, and close to ``COPY``).

    The keys are :func:`enqueue_columns`; a missing key or a JSON null takes the column's
    server default (``coalesce``), so a row lands exactly as an ORM insert without that
    value would, and the columns not inserted (``id``, ``status``, ``attempts``,
    ``created_at``, ...) take their defaults as usual. ``:trace_context`` (a JSON object, or
    NULL) is every row's ``trace_context``. Locks: only the new rows. The statement-level
    NOTIFY trigger runs once per statement.
    """
    columns, rows, values = _recordset_values(table)
    trace_context = table.c.trace_context
    values.append(bindparam("trace_context", type_=trace_context.type))
    return insert(table).from_select(
        [*(c.name for c in columns), trace_context.name],
        select(*values).select_from(rows),
        include_defaults=False,
    )


def enqueue_unique(table: Table) -> Select[Any]:
    """Insert a batch of unique jobs from ``:rows``, skipping each whose key is held; return,
    for every row, the id of the job that holds its key.

    ``:rows`` is :func:`enqueue_many`'s JSON document, each object with three more keys:
    ``unique_key`` (the key, or its base when there is a period), ``unique_period`` (the
    period in seconds, or null), ``unique_statuses`` (the statuses in which the job holds
    its key) and ``n`` (the row's position); ``:trace_context`` as for :func:`enqueue_many`.
    With a period, the stored key is ``<base>@<bucket>``, the bucket being
    ``floor(epoch(run_at) / period)``: the period is the one the job's ``run_at`` falls in,
    and ``run_at`` defaults to the database's ``now()``, the transaction's start.

    ``INSERT ... ON CONFLICT (unique_key) WHERE <unique predicate> DO NOTHING``, arbitrated by
    the unique index: a duplicate is skipped, never an error, so the caller's transaction
    goes on. Rows of the same key within the batch are reduced to the first (by ``n``), and
    inserted in key order (so that two batches over the same keys cannot deadlock). When
    the row holding a key is not yet committed, the INSERT waits for its transaction:
    skipped if it commits, inserted if it rolls back.

    Returns ``n, unique_key, inserted_id, holder_id`` per row in ``n`` order:
    ``inserted_id`` when this statement inserted the key's job, else ``holder_id``, the job
    that held it as this statement's snapshot saw it. Both are null when the holder was
    committed after the statement began, or left its unique statuses meanwhile: run the
    statement again for those rows (a new snapshot decides). Locks: the new rows; reads
    the unique index.
    """
    columns, rows, values = _recordset_values(
        table,
        column("unique_key", Text),
        column("unique_period", Float),
        column("unique_statuses", ARRAY(Text)),
        column("n", Integer),
    )
    names_ = [c.name for c in columns]
    run_at = values[names_.index("run_at")]
    base = rows.c.unique_key
    bucket = cast(
        func.floor(cast(func.extract("epoch", run_at), Float) / rows.c.unique_period),
        BigInteger,
    )
    key = case(
        (rows.c.unique_period.is_(None), base),
        else_=base + literal_column("'@'") + cast(bucket, Text),
    )
    trace_context = table.c.trace_context
    source = (
        select(
            *(value.label(name) for name, value in zip(names_, values, strict=True)),
            bindparam("trace_context", type_=trace_context.type).label(trace_context.name),
            key.label("unique_key"),
            cast(rows.c.unique_statuses, table.c.unique_statuses.type).label("unique_statuses"),
            rows.c.n,
            func.row_number().over(partition_by=key, order_by=rows.c.n).label("rank"),
        )
        .select_from(rows)
        .cte("source")
    )
    inserted_columns = [*names_, trace_context.name, "unique_key", "unique_statuses"]
    # In key order: two transactions inserting the same keys take them in the same order,
    # so their waits on each other's uncommitted keys cannot deadlock.
    first = (
        select(*(source.c[name] for name in inserted_columns))
        .where(source.c.rank == _ONE)
        .order_by(source.c.unique_key)
    )
    inserted = (
        insert(table)
        .from_select(inserted_columns, first, include_defaults=False)
        .on_conflict_do_nothing(index_elements=["unique_key"], index_where=text(unique_predicate()))
        .returning(table.c.id, table.c.unique_key)
        .cte("inserted")
    )
    # The unique predicate again, on this table's columns (qualified, inside a correlated
    # subquery), so that the lookup reads the unique index.
    holder = (
        select(table.c.id)
        .where(
            table.c.unique_key == source.c.unique_key,
            table.c.unique_key.is_not(None),
            table.c.status == any_(table.c.unique_statuses),
        )
        .scalar_subquery()
    )
    return (
        select(
            source.c.n,
            source.c.unique_key,
            inserted.c.id.label("inserted_id"),
            holder.label("holder_id"),
        )
        .select_from(source.outerjoin(inserted, inserted.c.unique_key == source.c.unique_key))
        .order_by(source.c.n)
    )


def enqueue_debounced(table: Table) -> Insert:
    """Enqueue the one job of ``:rows`` debounced under its ``unique_key``: insert it as a
    pending job that runs ``:window`` seconds from now, or, when a pending job holds the key
    already, make that job this one. Returns ``id`` (the job's) and ``inserted`` (whether
    this statement inserted it).

    ``:rows`` is :func:`enqueue_many`'s JSON document with one object, carrying its
    ``unique_key`` too; ``:trace_context`` as there. The job holds its key while it is
    pending only (``unique_statuses = {pending}``), so a job that has started takes no more
    enqueues: the next one starts the next burst.

    ``INSERT ... ON CONFLICT (unique_key) WHERE <unique predicate> DO UPDATE``, arbitrated by
    the unique index: the pending job's columns become the new enqueue's (every column
    inserted: arguments, priority, the model's own, the trace context), and its ``run_at``
    the later of its own and ``now + :window``, capped at ``created_at + :max_wait`` (the
    first enqueue's time, when ``:max_wait`` is not null): a steady stream of enqueues still
    runs the job every ``:max_wait``. Statement time (``statement_timestamp()``), the
    database's clock. Concurrent enqueuers of one key queue on the pending row's lock, the
    last to commit writing its arguments; one waiting on an uncommitted insert inserts
    when that rolls back. A claim skips the row while an enqueue holds it, and an enqueue
    that waited for a claim finds the job started and inserts a new one.
    """
    columns, rows, values = _recordset_values(table, column("unique_key", Text))
    names_ = [c.name for c in columns]
    now = func.statement_timestamp()
    window = bindparam("window", type_=Float) * literal_column("interval '1 second'")
    trace_context = table.c.trace_context
    source = [
        *(
            now + window if name == "run_at" else value
            for name, value in zip(names_, values, strict=True)
        ),
        bindparam("trace_context", type_=trace_context.type),
        rows.c.unique_key,
        cast(literal_column(f"ARRAY['{JobStatus.PENDING.value}']"), table.c.unique_statuses.type),
    ]
    inserted_columns = [*names_, trace_context.name, "unique_key", "unique_statuses"]
    statement = insert(table).from_select(
        inserted_columns, select(*source).select_from(rows), include_defaults=False
    )
    excluded = statement.excluded
    max_wait = bindparam("max_wait", type_=Float) * literal_column("interval '1 second'")
    changes: dict[str, Any] = {
        name: excluded[name] for name in (*names_, trace_context.name) if name != "run_at"
    }
    # LEAST ignores a NULL: without :max_wait, the later of the two times.
    changes["run_at"] = func.least(
        func.greatest(table.c.run_at, excluded.run_at), table.c.created_at + max_wait
    )
    return statement.on_conflict_do_update(
        index_elements=["unique_key"],
        index_where=text(unique_predicate()),
        set_=changes,
    ).returning(table.c.id, literal_column("xmax = 0", Boolean).label("inserted"))


class DebouncedParams(TypedDict):
    """:class:`EnqueueParams` (one row, with its ``unique_key``), the seconds the job waits
    after the last enqueue (``window``) and the most it waits after the first (``max_wait``,
    None for no cap)."""

    rows: str
    trace_context: dict[str, str] | None
    window: float
    max_wait: float | None


class DebouncedRow(NamedTuple):
    """The debounced job: its id, and whether the enqueue inserted it (else it changed the
    pending job that held the key)."""

    id: int
    inserted: bool


class EnqueueParams(TypedDict):
    """The jobs to insert, as a JSON array of rows (one object each, by column name), and
    the trace context every one of them gets (None outside a trace)."""

    rows: str
    trace_context: dict[str, str] | None


class UniqueRow(NamedTuple):
    """One row of :func:`enqueue_unique`'s input (``n``, its place) and what became of it:
    the id of the job it inserted, or of the job that holds its key (neither: settle it
    again, in a new statement)."""

    n: int
    unique_key: str
    inserted_id: int | None
    holder_id: int | None


ENQUEUE_MANY: Final[Query[EnqueueParams, tuple[()]]] = Query(enqueue_many, EnqueueParams)
ENQUEUE_UNIQUE: Final = Query(enqueue_unique, EnqueueParams, UniqueRow)
ENQUEUE_DEBOUNCED: Final = Query(enqueue_debounced, DebouncedParams, DebouncedRow)


_Job = TypeVar("_Job", bound=JobMixin)


def enqueued_jobs(
    session: Session,
    model: type[_Job],
    *,
    status: str,
    task: str | None,
    queue: str | None,
    args: dict[str, Any] | None,
) -> list[_Job]:
    """The jobs of ``model`` in ``status`` that ``session`` sees, oldest first, filtered by
    ``task``, ``queue`` and ``args`` (jsonb containment: the job's args hold at least these
    keys and values); as ORM objects (:func:`sqla_jobs.testing.enqueued`)."""
    statement = select(model).where(model.status == status)
    if task is not None:
        statement = statement.where(model.task == task)
    if queue is not None:
        statement = statement.where(model.queue == queue)
    if args is not None:
        statement = statement.where(model.args.contains(args))
    return list(session.scalars(statement.order_by(model.id)))


# -- periodic jobs -------------------------------------------------------------------------


def database_now() -> Select[Any]:
    """``statement_timestamp()``: the database's clock (the scheduler's slots, a report's
    time)."""
    return select(_now())


def schedule_create(schedule_table: Table) -> Insert:
    """Start periodic task ``:schedule_name``'s row at ``:slot`` unless it has one:
    ``INSERT ... ON CONFLICT (name) DO NOTHING RETURNING name``. A row comes back only to
    the one transaction that created it (a concurrent creator waits for it, then skips)."""
    stmt = insert(schedule_table).values(
        name=bindparam("schedule_name", type_=Text),
        last_slot=bindparam("slot", type_=schedule_table.c.last_slot.type),
    )
    return stmt.on_conflict_do_nothing(index_elements=["name"]).returning(schedule_table.c.name)


def schedule_advance(schedule_table: Table) -> Update:
    """Move periodic task ``:schedule_name`` to ``:slot`` if its last slot is earlier, or
    later than ``:horizon`` (the mark of a clock read that was ahead, see
    :func:`sqla_jobs.periodic.enqueue_due`); return the last slot it moved from, as
    ``recorded``.

    The slot's one winner: the row is locked first (``SELECT ... FOR UPDATE`` in a CTE), so
    concurrent schedulers queue on its lock, and each compares the version the previous one
    committed (a locking read returns the latest one), so exactly one transaction gets a
    row back per slot. Run it in the transaction that enqueues the slot's job: if that
    rolls back, the slot is free again. Uses the primary key.
    """
    slot = bindparam("slot", type_=schedule_table.c.last_slot.type)
    horizon = bindparam("horizon", type_=schedule_table.c.last_slot.type)
    recorded = (
        select(schedule_table.c.name, schedule_table.c.last_slot)
        .where(schedule_table.c.name == bindparam("schedule_name", type_=Text))
        .with_for_update()
        .cte("recorded")
    )
    return (
        update(schedule_table)
        .where(
            schedule_table.c.name == recorded.c.name,
            or_(recorded.c.last_slot < slot, recorded.c.last_slot > horizon),
        )
        .values(last_slot=slot, updated_at=_now())
        .returning(recorded.c.last_slot.label("recorded"))
    )
