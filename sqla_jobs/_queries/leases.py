"""Every SQL statement of leasing, as builders over the user's lease table.

Pure functions like :mod:`sqla_jobs._queries` (no session, no I/O, no logging), kept in a
module of their own because they share nothing with the job statements: they run on any
table of the user's with :class:`~sqla_jobs.schema.leases.LeaseMixin` columns, keyed by
that table's own primary key (one column or several, of any type), fenced by
``lease_fence`` rather than by a job's ``attempts``.

Time is the database's: ``statement_timestamp()``, as for jobs.

The fence: ``lease_fence`` grows by one on every acquire and never otherwise, so
``(primary key, lease_fence)`` names one grant. Renew and release match on that pair and on
the holder (a released row's holder is null, so it matches nothing); a grant whose row was
acquired again since (after its lease expired) matches zero rows.

Batches of grants arrive as one array per primary-key column plus ``:fences`` and
``:holders``, unnested together, so the SQL text is the same for every batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final, NamedTuple, TypedDict

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    func,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.dml import ReturningUpdate

from sqla_jobs._queries.run import Executor, built

__all__ = [
    "AcquireParams",
    "Grant",
    "GrantRow",
    "LeaseQueryError",
    "LeaseRow",
    "acquire",
    "acquired",
    "key_params",
    "lock",
    "locked",
    "release",
    "released",
    "renew",
    "renewed",
]

_SECOND: Final[ColumnElement[Any]] = literal_column("interval '1 second'")
_ONE: Final[ColumnElement[int]] = literal_column("1", BigInteger)


def _now() -> ColumnElement[Any]:
    return func.statement_timestamp()


def key_params(table: Table) -> tuple[str, ...]:
    """The names of the array parameters that carry the grants' primary keys, one per
    primary-key column, in the table's primary-key order (``key_0``, ``key_1``, ...)."""
    return tuple(f"key_{index}" for index in range(len(table.primary_key.columns)))


def _grants(table: Table) -> tuple[Any, ColumnElement[bool]]:
    """The batch's grants as rows ``(k0, ..., fence)`` and the fenced match on the table."""
    primary_key = list(table.primary_key.columns)
    arrays = [
        bindparam(name, type_=ARRAY(column.type))
        for name, column in zip(key_params(table), primary_key, strict=True)
    ]
    arrays.append(bindparam("fences", type_=ARRAY(BigInteger)))
    arrays.append(bindparam("holders", type_=ARRAY(Text)))
    labels = [f"k{index}" for index in range(len(primary_key))]
    grants = (
        func.unnest(*arrays).table_valued(*labels, "fence", "holder").render_derived(name="grants")
    )
    match = and_(
        *(column == grants.c[label] for column, label in zip(primary_key, labels, strict=True)),
        table.c.lease_fence == grants.c.fence,
        # A released row's holder is null, which equals nothing.
        table.c.lease_holder == grants.c.holder,
    )
    return grants, match


def acquire(
    table: Table,
    *,
    where: ColumnElement[bool] | None,
    order_by: tuple[ColumnElement[Any], ...],
) -> Select[Any]:
    """Lease up to ``:limit`` acquirable rows matching ``where`` to ``:holder`` for
    ``:duration_seconds``; return them in ``order_by`` order.

    Acquirable: ``lease_expires_at <= statement_timestamp()``, which holds for free rows
    (their ``lease_expires_at`` is when they became free) and for expired leases alike: an
    expired lease is taken over here, in the same statement, with no reaper. Each acquired
    row's ``lease_fence`` grows by one.

    Locks: ``FOR UPDATE SKIP LOCKED`` on the chosen rows (of this table only, whatever
    ``where`` reads), so concurrent acquirers take disjoint rows and never wait for rows
    another transaction holds. Index: the lease index, ``(lease_index_columns...,
    lease_expires_at, primary key)``; with equality on its leading columns and the default
    order (``lease_expires_at``, then the primary key) the scan reads acquirable rows only,
    already in order. Another order sorts the acquirable rows that ``where`` matches.

    The first CTE fences the planner, as in the job claim, so that ``LIMIT`` and the row
    locks apply once, to the chosen rows; the ``UPDATE`` is a CTE too so that the final
    ``SELECT`` can return the rows in ``order_by`` order, read from the versions before the
    update (every part of the statement sees the same snapshot).

    Returns the primary-key columns, ``lease_fence``, ``lease_holder``, ``lease_expires_at``.
    Parameters: ``:limit``, ``:holder``, ``:duration_seconds``.
    """
    now = _now()
    primary_key = list(table.primary_key.columns)
    chosen = select(*primary_key).where(table.c.lease_expires_at <= now)
    if where is not None:
        chosen = chosen.where(where)
    acquirable = (
        chosen.order_by(*order_by)
        .limit(bindparam("limit", type_=BigInteger))
        .with_for_update(of=table, skip_locked=True)
        .cte("acquirable")
    )
    acquired = (
        update(table)
        .where(*(column == acquirable.c[column.name] for column in primary_key))
        .values(
            lease_holder=bindparam("holder"),
            lease_fence=table.c.lease_fence + _ONE,
            lease_expires_at=now + bindparam("duration_seconds", type_=Float) * _SECOND,
        )
        .returning(
            *primary_key, table.c.lease_fence, table.c.lease_holder, table.c.lease_expires_at
        )
        .cte("acquired")
    )
    return (
        select(
            *(acquired.c[column.name] for column in primary_key),
            acquired.c.lease_fence,
            acquired.c.lease_holder,
            acquired.c.lease_expires_at,
        )
        .select_from(acquired)
        .join(table, and_(*(column == acquired.c[column.name] for column in primary_key)))
        .order_by(*order_by)
    )


def renew(table: Table) -> ReturningUpdate[Any]:
    """Extend the given grants to ``statement_timestamp() + :duration_seconds``. Fenced.

    A grant whose lease expired but whose row nobody acquired since is renewed too: its
    unchanged fence proves no one else held the row in between. Locks the rows in
    primary-key order (waiting for a transaction that holds one, as an ``UPDATE`` would, so
    two renewals of overlapping batches cannot deadlock), found through the primary key.
    Only ``lease_expires_at`` changes. Returns the primary key, ``lease_fence``, ``lease_holder``,
    ``lease_expires_at`` of each renewed grant.
    Parameters: :func:`key_params`, ``:fences``, ``:holders``, ``:duration_seconds``.
    """
    return _fenced_update(
        table,
        "renewed",
        lease_expires_at=_now() + bindparam("duration_seconds", type_=Float) * _SECOND,
    )


def release(table: Table) -> ReturningUpdate[Any]:
    """End the given grants now: the rows are free (``lease_holder`` null) and acquirable
    from this statement's time on. Fenced; locks as :func:`renew` does.

    ``lease_fence`` stays as it is (it grows on acquire only), and with it the row
    remembers its last grant. Returns what :func:`renew` returns; ``lease_expires_at`` is
    the time of the release. Parameters: :func:`key_params`, ``:fences``, ``:holders``.
    """
    return _fenced_update(table, "released", lease_holder=null(), lease_expires_at=_now())


def _fenced_update(table: Table, name: str, **values: Any) -> ReturningUpdate[Any]:
    grants, match = _grants(table)
    primary_key = list(table.primary_key.columns)
    held = (
        select(*primary_key, table.c.lease_fence)
        .select_from(table)
        .join(grants, match)
        .order_by(*primary_key)
        .with_for_update(of=table)
        .cte(f"{name}_rows")
    )
    return (
        update(table)
        .where(
            *(column == held.c[column.name] for column in primary_key),
            table.c.lease_fence == held.c.lease_fence,
        )
        .values(**values)
        .returning(
            *primary_key, table.c.lease_fence, table.c.lease_holder, table.c.lease_expires_at
        )
    )


def lock(table: Table) -> Select[Any]:
    """Lock the rows of the given grants until the caller's transaction ends (``SELECT ...
    FOR UPDATE``, in primary-key order). Fenced: a grant taken over since is not returned.

    The second half of a lock-held acquire: the grant was committed on another connection,
    and this holds its rows for the caller's transaction. Finds them through the primary
    key. Returns the primary key and
    ``lease_fence`` of each locked grant. Parameters: :func:`key_params`, ``:fences``, ``:holders``.
    """
    grants, match = _grants(table)
    primary_key = list(table.primary_key.columns)
    return (
        select(*primary_key, table.c.lease_fence)
        .select_from(table)
        .join(grants, match)
        .order_by(*primary_key)
        .with_for_update(of=table)
    )


# -- running them: the caller's transaction, typed grants in, rows by name out --------------
#
# Not Query constants: a lease table's primary key is the user's (its columns' names, types and
# number differ by model), so the bind names (``key_0``, ...) and the returned columns are
# the table's; and :func:`acquire` is built anew for each ``where`` and ``order_by`` (caching
# a statement per expression would keep every one ever passed). These functions take and
# return the same fixed shapes instead, and check each statement's returned columns the
# first time they run it on a table.


class AcquireParams(TypedDict):
    """An acquire's bind parameters (:func:`acquire`)."""

    limit: int
    holder: str
    duration_seconds: float


class Grant(NamedTuple):
    """One grant as renew, release and lock match it: the row's primary key (its values in
    the table's primary-key order), its ``lease_fence`` and its holder."""

    key: tuple[Any, ...]
    fence: int
    holder: str


class LeaseRow(NamedTuple):
    """A grant as :func:`acquire`, :func:`renew` and :func:`release` return it: the primary
    key, ``lease_fence``, ``lease_holder``, ``lease_expires_at``."""

    key: tuple[Any, ...]
    fence: int
    holder: str | None
    expires_at: datetime


class GrantRow(NamedTuple):
    """A grant :func:`lock` locked: the primary key and ``lease_fence``."""

    key: tuple[Any, ...]
    fence: int


#: The columns each statement returns after the primary key's.
_LEASE_COLUMNS: Final = ("lease_fence", "lease_holder", "lease_expires_at")
_GRANT_COLUMNS: Final = ("lease_fence",)
_CHECKED: Final[set[tuple[Any, Table]]] = set()


class LeaseQueryError(AssertionError):
    """A lease statement that does not return the primary key then the columns its row
    reads (a bug of the query layer, raised the first time it runs on a table)."""


def _checked(statement: Any, builder: Any, table: Table, tail: tuple[str, ...]) -> Any:
    if (builder, table) not in _CHECKED:
        returned = tuple(column.name for column in statement.exported_columns)
        expected = (*(column.name for column in table.primary_key.columns), *tail)
        if returned != expected:
            raise LeaseQueryError(
                f"{builder.__qualname__} returns {list(returned)}, not {list(expected)}"
            )
        _CHECKED.add((builder, table))
    return statement


def _grant_params(table: Table, grants: Sequence[Grant]) -> dict[str, Any]:
    """The bind parameters of :func:`_grants`: one array per primary-key column
    (:func:`key_params`), ``fences`` and ``holders``."""
    params: dict[str, Any] = {
        name: [grant.key[index] for grant in grants] for index, name in enumerate(key_params(table))
    }
    params["fences"] = [grant.fence for grant in grants]
    params["holders"] = [grant.holder for grant in grants]
    return params


def _lease_rows(table: Table, rows: Any) -> list[LeaseRow]:
    width = len(table.primary_key.columns)
    return [LeaseRow(tuple(row[:width]), *row[width:]) for row in rows]


def acquired(
    executor: Executor,
    table: Table,
    params: AcquireParams,
    *,
    where: ColumnElement[bool] | None,
    order_by: tuple[ColumnElement[Any], ...],
) -> list[LeaseRow]:
    """Run :func:`acquire` in ``executor``'s transaction (the caller's: it begins and ends
    it, and the grants exist once it commits); the leases granted, in ``order_by`` order."""
    statement = _checked(
        acquire(table, where=where, order_by=order_by), acquire, table, _LEASE_COLUMNS
    )
    return _lease_rows(table, executor.execute(statement, dict(params)))


def renewed(
    executor: Executor, table: Table, grants: Sequence[Grant], duration_seconds: float
) -> list[LeaseRow]:
    """Run :func:`renew` on ``grants`` in ``executor``'s transaction (the caller's); the
    grants renewed."""
    statement = _checked(built(renew, table), renew, table, _LEASE_COLUMNS)
    params = _grant_params(table, grants) | {"duration_seconds": duration_seconds}
    return _lease_rows(table, executor.execute(statement, params))


def released(executor: Executor, table: Table, grants: Sequence[Grant]) -> list[LeaseRow]:
    """Run :func:`release` on ``grants`` in ``executor``'s transaction (the caller's); the
    grants released."""
    statement = _checked(built(release, table), release, table, _LEASE_COLUMNS)
    return _lease_rows(table, executor.execute(statement, _grant_params(table, grants)))


def locked(executor: Executor, table: Table, grants: Sequence[Grant]) -> list[GrantRow]:
    """Run :func:`lock` on ``grants`` in ``executor``'s transaction (the caller's, which
    holds the row locks until it ends); the grants locked."""
    statement = _checked(built(lock, table), lock, table, _GRANT_COLUMNS)
    width = len(table.primary_key.columns)
    rows = executor.execute(statement, _grant_params(table, grants))
    return [GrantRow(tuple(row[:width]), row[width]) for row in rows]
