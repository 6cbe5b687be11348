"""The lease operations: acquire, renew, release, on any model with :class:`LeaseMixin`.

Every function takes the caller's :class:`~sqlalchemy.orm.Session` (or Core
:class:`~sqlalchemy.Connection`) and runs in the caller's transaction: it never commits,
rolls back or closes it. A lease acquired in lease mode exists once the caller commits;
:mod:`sqla_jobs.aio` runs these same functions for ``AsyncSession``.

A holder's life, for a seat of show 7::

    with Session(engine) as session, session.begin():
        (lease,) = acquire_leases(
            session, Seat, where=Seat.show_id == 7, holder="cart-41", duration=600
        )
    ...
    with Session(engine) as session, session.begin():
        renew_lease(session, lease, duration=600)  # LeaseLostError: it was taken over
    ...
    with Session(engine) as session, session.begin():
        release_lease(session, lease)  # and sell the seat, in the same transaction

Every argument is checked before any SQL runs: a model without the mixin raises
:class:`~sqla_jobs.errors.ConfigurationError`, any other bad argument
:class:`~sqla_jobs.errors.InvalidLeaseError` naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Final, NamedTuple, TypeAlias, cast

from sqlalchemy import Boolean, ColumnElement, Connection, Table, inspect
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ClauseElement, ColumnClause, TextClause
from sqlalchemy.sql.selectable import SelectBase
from sqlalchemy.types import NullType

from sqla_jobs import validation
from sqla_jobs._queries.leases import (
    AcquireParams,
    Grant,
    LeaseRow,
    acquired,
    locked,
    released,
    renewed,
)
from sqla_jobs.errors import (
    ConfigurationError,
    InvalidJobError,
    InvalidLeaseError,
    LeaseLostError,
)
from sqla_jobs.holding import first_step_engine
from sqla_jobs.schema.leases import LeaseMixin

__all__ = [
    "MAX_ACQUIRE_LIMIT",
    "Lease",
    "acquire_leases",
    "release_lease",
    "release_leases",
    "renew_lease",
    "renew_leases",
]

#: The most rows one acquire may lease.
MAX_ACQUIRE_LIMIT: Final = 10_000

#: What the lease operations run on: an ORM session or a Core connection, in its current
#: transaction, which they never commit.
Executor: TypeAlias = Session | Connection


class Lease(NamedTuple):
    """One grant of one row to one holder, as :func:`acquire_leases` returns it.

    Plain, immutable data that outlives the session. ``key`` is the row's primary key as
    ``session.get(model, key)`` takes it: the value for a one-column primary key, a tuple
    for a composite one. ``fence`` is the row's ``lease_fence`` for this grant: it grows
    with every acquire of the row, so a higher fence is a later holder (hand it to any
    system that must refuse a holder whose lease was taken over). ``expires_at`` is the end
    of the lease in **database** time, as of the acquire (or the renewal that returned
    this record).

    Renew and release match a lease on ``(key, fence, holder)``; ``expires_at`` is
    informative. A lease kept elsewhere (a cookie, a column) can be rebuilt from those
    three values with ``Lease(Seat, key, fence, holder, expires_at)``.
    """

    model: type[LeaseMixin]
    key: Any
    fence: int
    holder: str
    expires_at: datetime


# -- checks -----------------------------------------------------------------------------


def _lease_table(model: object) -> Table:
    if not (isinstance(model, type) and issubclass(model, LeaseMixin)):
        raise ConfigurationError(f"{model!r} is not a mapped class that mixes in LeaseMixin")
    if inspect(model, raiseerr=False) is None:
        raise ConfigurationError(f"{model.__name__} mixes in LeaseMixin but is not mapped")
    table = getattr(model, "__table__", None)
    if not isinstance(table, Table):
        raise ConfigurationError(f"{model.__name__} is not mapped to a table")
    return table


def _lease_error(exc: InvalidJobError) -> InvalidLeaseError:
    return InvalidLeaseError(exc.field, exc.reason)


def _holder(value: object) -> str:
    try:
        return validation.check_name("holder", value)
    except InvalidJobError as exc:
        raise _lease_error(exc) from None


def _duration_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise InvalidLeaseError(
            "duration", f"must be a timedelta or a number of seconds, not {type(value).__name__}"
        )
    if isinstance(value, int) and value > validation.MAX_DURATION_SECONDS:
        value = float("inf")  # float() of a huge int would overflow; it is refused below
    try:
        return validation.check_duration("duration", value).total_seconds()
    except InvalidJobError as exc:
        raise _lease_error(exc) from None


def _limit(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidLeaseError("limit", f"must be an integer, not {type(value).__name__}")
    if not 1 <= value <= MAX_ACQUIRE_LIMIT:
        raise InvalidLeaseError("limit", f"{value} is out of range [1, {MAX_ACQUIRE_LIMIT}]")
    return value


def _element(field: str, value: object, table: Table, model: type[Any]) -> ColumnElement[Any]:
    """``value`` as a SQL expression on ``table``'s own columns: the one home of the rule
    ``where`` and ``order_by`` share. Outside its subqueries, the expression may hold the
    model's columns, bound values, operators and functions, and nothing else: no column of
    another table or alias (it would join that table to every row), no column bound to no
    table (``sqlalchemy.column("x")``: its name is resolved by PostgreSQL, not checked
    here) and no raw SQL (``text()``, ``literal_column()``), which cannot be checked at all.
    A subquery (``exists()``, ``column.in_(select(...))``) may read any table: its rows are
    its own business."""
    clause = getattr(value, "__clause_element__", None)
    element = clause() if callable(clause) else value
    if not isinstance(element, ColumnElement):
        raise InvalidLeaseError(
            field,
            f"must be a SQL expression on {model.__name__}'s columns (such as "
            f"{model.__name__}.{table.primary_key.columns[0].key} == 1), "
            f"not {type(value).__name__}",
        )
    others: set[str] = set()
    stack: list[ClauseElement] = [element]
    while stack:
        part = stack.pop()
        if isinstance(part, SelectBase):
            continue  # a subquery: not walked
        if isinstance(part, TextClause) or (isinstance(part, ColumnClause) and part.is_literal):
            raise InvalidLeaseError(
                field,
                f"holds raw SQL ({str(part)[:80]!r}), which cannot be checked: build it from "
                f"{model.__name__}'s columns, operators and functions "
                f"({model.__name__}.{table.primary_key.columns[0].key} == 1, sqlalchemy.func)",
            )
        if isinstance(part, ColumnClause):
            source = part.table
            if source is None:
                raise InvalidLeaseError(
                    field,
                    f"names a column {part.name!r} of no table: use {model.__name__}'s own "
                    f"attribute ({model.__name__}.{part.name}), which is checked",
                )
            if source._deannotate() is not table:
                others.add(str(getattr(source, "description", source)))
            continue
        stack.extend(part.get_children())
    # Any other FROM the expression would add (a table-valued function, ...), as above.
    others.update(
        str(getattr(source, "description", source))
        for source in element._from_objects
        if source._deannotate() is not table
    )
    if others:
        hint = (
            "filter on another table through a subquery "
            "(sqlalchemy.exists(...), column.in_(select(...)))"
            if field == "where"
            else f"order by {model.__name__}'s own columns"
        )
        raise InvalidLeaseError(
            field,
            f"reads {', '.join(sorted(others))}, not only {table.name}: acquire leases rows "
            f"of {model.__name__} alone; {hint}",
        )
    return element


def _where(value: object, table: Table, model: type[Any]) -> ColumnElement[bool] | None:
    if value is None:
        return None
    element = _element("where", value, table, model)
    if not isinstance(element.type, Boolean | NullType):
        raise InvalidLeaseError(
            "where", f"is an expression of type {element.type}, not a condition (true or false)"
        )
    return cast(ColumnElement[bool], element)


def _order(value: object, table: Table, model: type[Any]) -> tuple[ColumnElement[Any], ...]:
    primary_key = list(table.primary_key.columns)
    if value is None:
        return (table.c.lease_expires_at, *primary_key)
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not items:
        raise InvalidLeaseError("order_by", "must name at least one expression, or be None")
    order = [_element("order_by", item, table, model) for item in items]
    # The primary key breaks ties, so that the order is always the same.
    order += [c for c in primary_key if not any(e.compare(c) for e in order)]
    return tuple(order)


def _key(lease: Lease, width: int) -> tuple[Any, ...]:
    key = lease.key
    parts = tuple(key) if isinstance(key, tuple) else (key,)
    if len(parts) != width or any(part is None for part in parts):
        shape = "one value" if width == 1 else f"a tuple of {width} values"
        raise InvalidLeaseError(
            "leases", f"holds a key {key!r}; {lease.model.__name__}'s primary key is {shape}"
        )
    return parts


def _batch(leases: object) -> tuple[Table | None, list[Lease]]:
    """Check a batch of leases: one model, well-formed keys, fences and holders. Returns
    their table (None for an empty batch) and the leases."""
    if isinstance(leases, Lease) or not isinstance(leases, Iterable):
        raise InvalidLeaseError(
            "leases",
            f"must be a sequence of leases, not {type(leases).__name__} (one lease: "
            "renew_lease / release_lease)",
        )
    batch = list(leases)
    if not batch:
        return None, batch
    for lease in batch:
        if not isinstance(lease, Lease):
            raise InvalidLeaseError("leases", f"holds a {type(lease).__name__}, not a Lease")
    model = batch[0].model
    others = sorted({_name(lease.model) for lease in batch if lease.model is not model})
    if others:
        raise InvalidLeaseError(
            "leases",
            f"holds leases of {_name(model)} and of {', '.join(others)}: a batch is of one "
            "model; split it by model",
        )
    table = _lease_table(model)
    width = len(table.primary_key.columns)
    for lease in batch:
        _key(lease, width)
        if isinstance(lease.fence, bool) or not isinstance(lease.fence, int) or lease.fence < 1:
            raise InvalidLeaseError("leases", f"holds a fence {lease.fence!r}; fences are >= 1")
        _holder(lease.holder)
    return table, batch


def _name(model: object) -> str:
    return str(getattr(model, "__name__", repr(model)))


# -- plumbing ---------------------------------------------------------------------------


def _grants(table: Table, leases: Sequence[Lease]) -> list[Grant]:
    width = len(table.primary_key.columns)
    return [Grant(_key(lease, width), lease.fence, lease.holder) for lease in leases]


def _lost(table: Table, leases: Sequence[Lease], rows: Iterable[LeaseRow]) -> list[Lease]:
    kept = {(row.key, row.fence) for row in rows}
    width = len(table.primary_key.columns)
    return [lease for lease in leases if (_key(lease, width), lease.fence) not in kept]


def _lease(model: type[LeaseMixin], table: Table, row: LeaseRow) -> Lease:
    width = len(table.primary_key.columns)
    key = row.key[0] if width == 1 else row.key
    assert row.holder is not None  # an acquired grant names its holder
    return Lease(model, key, row.fence, row.holder, row.expires_at)


# -- the operations ---------------------------------------------------------------------


def acquire_leases(
    session: Executor,
    model: type[LeaseMixin],
    *,
    holder: str,
    duration: timedelta | float,
    where: ColumnElement[bool] | None = None,
    order_by: Any = None,
    limit: int = 1,
    hold: bool = False,
) -> list[Lease]:
    """Lease up to ``limit`` acquirable rows of ``model`` that match ``where`` to ``holder``
    for ``duration``; return the leases, in ``order_by`` order (possibly none).

    Acquirable means free, or leased with the lease expired by the **database's** clock: an
    expired lease is taken over by this same statement (no reaper). The rows are chosen in
    ``order_by`` order (an expression on the model's columns, or a list of them; the
    primary key breaks ties) with ``FOR UPDATE SKIP LOCKED``, in one statement: concurrent
    acquirers get disjoint rows and never wait for rows another transaction holds. The
    default order is the row free (or expired) the longest first, which the lease index
    serves without a sort; ``order_by=Seat.number`` takes the lowest free number instead,
    at the cost of sorting the acquirable rows that ``where`` matches.

    ``where`` is a condition on the model's own columns (``Seat.show_id == 7``); another
    table may only appear inside a subquery, and raw SQL (``text()``, ``literal_column()``)
    is refused, since it cannot be checked. Each acquired row's ``lease_fence`` grows by
    one: the new value is the lease's ``fence``.

    **Lease mode** (``hold=False``, the default). The acquire runs in the caller's
    transaction; the lease exists once the caller commits, and lasts ``duration`` from the
    acquire, in database time, unless renewed or released. Before the commit the rows are
    locked, so others skip them; a rollback undoes the acquire, fence included (the same
    fence may then be granted again: act on a lease only after its transaction commits).

    **Lock-held mode** (``hold=True``). The grant is made and committed first, in a short
    transaction of its own on a separate connection from the session's engine, so that its
    fence is never granted twice. The rows are then locked (``SELECT ... FOR UPDATE``) in
    the caller's transaction, which must be READ COMMITTED (else
    :class:`ConfigurationError`). While that transaction lasts, no acquire can take the
    rows, even after ``duration`` has passed, and the holder's renew and release still
    apply. Release them in that same transaction and your writes and the release commit
    together, or not at all. If it rolls back, or its process dies, the locks go at once
    and the grant stands until it expires: ``duration`` is then the delay before the rows
    come back. Committed without a release, the rows stay leased until ``duration`` has
    passed, as in lease mode. Only committed rows can be acquired so (the separate
    connection does not see the caller's uncommitted ones).

    Raises :class:`ConfigurationError` for a model without the mixin and
    :class:`InvalidLeaseError` for any other bad argument, before any SQL runs.
    """
    table = _lease_table(model)
    where_clause = _where(where, table, model)
    order = _order(order_by, table, model)
    params: AcquireParams = {
        "limit": _limit(limit),
        "holder": _holder(holder),
        "duration_seconds": _duration_seconds(duration),
    }
    if not isinstance(hold, bool):
        raise InvalidLeaseError("hold", f"must be True or False, not {hold!r}")
    if not hold:
        rows = acquired(session, table, params, where=where_clause, order_by=order)
        return [_lease(model, table, row) for row in rows]
    engine = first_step_engine(session, model, call="acquire_leases(hold=True)", step="the grant")
    with engine.begin() as connection:
        rows = acquired(connection, table, params, where=where_clause, order_by=order)
    granted = [_lease(model, table, row) for row in rows]
    if not granted:
        return []
    kept = {(row.key, row.fence) for row in locked(session, table, _grants(table, granted))}
    width = len(table.primary_key.columns)
    return [lease for lease in granted if (_key(lease, width), lease.fence) in kept]


def renew_leases(
    session: Executor, leases: Sequence[Lease], *, duration: timedelta | float
) -> list[Lease]:
    """Extend these leases to ``duration`` from now, in database time, in one statement.

    Returns the leases that were not renewed, because they are no longer their holder's:
    released, or expired and taken by another acquire (a higher fence). Nothing changes
    for those; stop using their rows. A lease that expired but whose row nobody acquired
    since is renewed: its unchanged fence proves no one else held the row meanwhile.

    Runs in the caller's transaction (the renewal counts once it commits) and waits for
    a row lock another transaction holds on one of the rows, as any ``UPDATE`` does. The
    records returned by :func:`acquire_leases` keep their old ``expires_at``; a holder
    that must know when to stop without asking the database stops ``duration`` after it
    *sent* the renewal, by its own monotonic clock, which is never later than the
    database's ``lease_expires_at``.
    """
    seconds = _duration_seconds(duration)
    table, batch = _batch(leases)
    if table is None:
        return []
    return _lost(table, batch, renewed(session, table, _grants(table, batch), seconds))


def renew_lease(session: Executor, lease: Lease, *, duration: timedelta | float) -> Lease:
    """Extend one lease (see :func:`renew_leases`); return it with its new ``expires_at``.

    Raises :class:`LeaseLostError` when the lease is no longer its holder's; nothing
    changes then.
    """
    seconds = _duration_seconds(duration)
    table, checked = _one(lease)
    rows = renewed(session, table, _grants(table, [checked]), seconds)
    if not rows:
        raise LeaseLostError(_lost_message(checked))
    return checked._replace(expires_at=rows[0].expires_at)


def release_leases(session: Executor, leases: Sequence[Lease]) -> list[Lease]:
    """End these leases now: their rows are free, and acquirable from this moment.

    Returns the leases that were no longer their holder's (released already, or expired
    and taken by another acquire); nothing changes for those. Runs in the caller's
    transaction, which holds the rows' locks until it ends: writes of yours to those rows
    in the same transaction commit together with the release, and no acquire can take the
    rows before. Waits for row locks as :func:`renew_leases` does.
    """
    table, batch = _batch(leases)
    if table is None:
        return []
    return _lost(table, batch, released(session, table, _grants(table, batch)))


def release_lease(session: Executor, lease: Lease) -> None:
    """End one lease now (see :func:`release_leases`).

    Raises :class:`LeaseLostError` when the lease is no longer its holder's; nothing
    changes then. Released first in a transaction, it is also the fenced guard for writes
    that must happen only if the lease still held: the row stays locked until the commit::

        with Session(engine) as session, session.begin():
            release_lease(session, lease)  # raises if the cart lost the seat
            session.get_one(Seat, lease.key).sold_to = "cart-41"
    """
    table, checked = _one(lease)
    if not released(session, table, _grants(table, [checked])):
        raise LeaseLostError(_lost_message(checked))


def _one(lease: object) -> tuple[Table, Lease]:
    """Check one lease; return its table and the lease."""
    if not isinstance(lease, Lease):
        raise InvalidLeaseError(
            "lease", f"must be a Lease, not {type(lease).__name__} (several: the *_leases forms)"
        )
    table, _ = _batch([lease])
    assert table is not None
    return table, lease


def _lost_message(lease: Lease) -> str:
    return (
        f"{lease.model.__name__} {lease.key!r}: the lease of {lease.holder!r} with fence "
        f"{lease.fence} is no longer held (released, or expired and acquired again); "
        "nothing was changed"
    )
