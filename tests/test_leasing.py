"""Leasing any row: acquire, renew, release, lock-held use, bad input, the index, migrations.

The tables are tests/lease_models.py's, in a database of their own, emptied before each
test; every test uses committed data (leases involve several sessions and connections).
The many-process proof is tests/test_lease_proof.py.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from conftest import FreshDatabase, advance_clock
from lease_models import Address, LeaseBase, Licence, Seat, Show
from models import EmailJob
from plans import explain_rolled_back, plan_nodes
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, aliased, mapped_column

import sqla_jobs
from sqla_jobs import (
    ConfigurationError,
    InvalidJobError,
    InvalidLeaseError,
    JobMixin,
    Lease,
    LeaseLostError,
    LeaseMixin,
    acquire_leases,
    aio,
    lease_names,
    migrations,
    release_lease,
    release_leases,
    renew_lease,
    renew_leases,
)
from sqla_jobs.schema import leases as lease_schema

PAGE = Path(__file__).resolve().parents[1] / "docs" / "how-to" / "leasing.md"
SHOWS = (7, 8)
SEATS_PER_SHOW = 10


@pytest.fixture(scope="session")
def _lease_database(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(fresh_database("sqla_jobs_lease"), pool_pre_ping=True)
    LeaseBase.metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def engine(_lease_database: sa.Engine) -> sa.Engine:
    """This module's ``engine`` (in place of conftest's): the lease tables, emptied, then
    seats 1-10 in show 7 and 11-20 in show 8, all free."""
    tables = ", ".join(t.name for t in LeaseBase.metadata.sorted_tables)
    with _lease_database.begin() as connection:
        connection.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
        connection.execute(sa.insert(Show), [{"id": show} for show in SHOWS])
        connection.execute(
            sa.insert(Seat),
            [
                {"id": n, "show_id": show, "number": n}
                for i, show in enumerate(SHOWS)
                for n in range(i * SEATS_PER_SHOW + 1, (i + 1) * SEATS_PER_SHOW + 1)
            ],
        )
    return _lease_database


def acquire(engine: sa.Engine, **options: Any) -> list[Lease]:
    options.setdefault("holder", "cart-1")
    options.setdefault("duration", 60)
    with Session(engine) as session, session.begin():
        return acquire_leases(session, Seat, **options)


def rows(engine: sa.Engine, *ids: int) -> dict[int, tuple[Any, ...]]:
    """``id -> (lease_holder, lease_fence, lease_expires_at)``."""
    query = sa.select(Seat.id, Seat.lease_holder, Seat.lease_fence, Seat.lease_expires_at)
    if ids:
        query = query.where(Seat.id.in_(ids))
    with engine.connect() as connection:
        return {row[0]: tuple(row[1:]) for row in connection.execute(query)}


def db_now(engine: sa.Engine) -> datetime:
    with engine.connect() as connection:
        value: datetime = connection.execute(sa.select(sa.func.clock_timestamp())).scalar_one()
        return value


# -- acquire ----------------------------------------------------------------------------------


def test_acquire_leases_matching_rows_to_the_holder_in_database_time(engine: sa.Engine) -> None:
    before = db_now(engine)
    leases = acquire(engine, where=Seat.show_id == 8, limit=3, holder="cart-41", duration=90)
    after = db_now(engine)

    assert len(leases) == 3
    assert {lease.key for lease in leases} <= set(range(11, 21))
    for lease in leases:
        assert (lease.model, lease.fence, lease.holder) == (Seat, 1, "cart-41")
        start = lease.expires_at - timedelta(seconds=90)
        assert before <= start <= after  # statement_timestamp() + duration
    state = rows(engine)
    for lease in leases:
        assert state[lease.key] == ("cart-41", 1, lease.expires_at)
    untouched = [state[n] for n in state if n not in {lease.key for lease in leases}]
    assert all(holder is None and fence == 0 for holder, fence, _ in untouched)


def test_acquire_takes_no_more_than_there_is(engine: sa.Engine) -> None:
    assert len(acquire(engine, where=Seat.show_id == 7, limit=50)) == 10
    assert acquire(engine, where=Seat.show_id == 7, limit=50) == []
    assert acquire(engine, where=Seat.show_id == 99) == []


def test_default_order_is_free_the_longest_then_by_key(engine: sa.Engine) -> None:
    first = acquire(engine, where=Seat.show_id == 7, limit=3)
    assert [lease.key for lease in first] == [1, 2, 3]  # inserted together: key order
    with Session(engine) as session, session.begin():
        release_leases(session, [first[1], first[0]])  # 2 then 1, in one statement
    # 4..10 have been free since the insert; 1 and 2 only since the release.
    again = acquire(engine, where=Seat.show_id == 7, limit=10)
    assert [lease.key for lease in again] == [4, 5, 6, 7, 8, 9, 10, 1, 2]


def test_order_by_chooses_and_orders_the_leases(engine: sa.Engine) -> None:
    top = acquire(engine, where=Seat.show_id == 7, order_by=Seat.number.desc(), limit=3)
    assert [lease.key for lease in top] == [10, 9, 8]
    rest = acquire(engine, order_by=[Seat.show_id.desc(), Seat.number], limit=4)
    assert [lease.key for lease in rest] == [11, 12, 13, 14]


def test_where_may_read_another_table_in_a_subquery(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        connection.execute(sa.update(Show).where(Show.id == 7).values(on_sale=False))
    on_sale = sa.exists().where(Show.id == Seat.show_id, Show.on_sale)
    leases = acquire(engine, where=on_sale & Seat.sold_to.is_(None), limit=20)
    assert sorted(lease.key for lease in leases) == list(range(11, 21))


def test_where_and_order_by_built_from_the_models_columns(engine: sa.Engine) -> None:
    # Functions, casts, bound values, constants and an IN subquery on another table: all
    # built from SQLAlchemy's expressions, so checked; none of it is raw SQL.
    eight = sa.select(Show.id).where(Show.on_sale, Show.id == 8).scalar_subquery()
    where = (
        sa.and_(
            sa.func.coalesce(Seat.sold_to, sa.literal("")) == "",
            sa.cast(Seat.number, sa.String).in_([str(n) for n in range(1, 21)]),
            Seat.show_id.in_(sa.select(Show.id).where(Show.id == 8)),
            Seat.show_id == eight,
        )
        | sa.false()
    ) & sa.true()
    leases = acquire(engine, where=where, order_by=sa.func.abs(Seat.number - 15), limit=3)
    assert [lease.key for lease in leases] == [15, 14, 16]


def test_concurrent_acquirers_take_disjoint_rows_without_waiting(engine: sa.Engine) -> None:
    with Session(engine) as first, first.begin():
        held = acquire_leases(
            first, Seat, where=Seat.show_id == 7, limit=4, holder="a", duration=60
        )
        with Session(engine) as second, second.begin():
            # A wait on the first transaction's locked rows would time out here.
            second.execute(sa.text("SET LOCAL lock_timeout = '1s'"))
            other = acquire_leases(
                second, Seat, where=Seat.show_id == 7, limit=10, holder="b", duration=60
            )
    assert len(held) == 4
    assert len(other) == 6
    assert not {lease.key for lease in held} & {lease.key for lease in other}


def test_a_rolled_back_acquire_leaves_nothing(engine: sa.Engine) -> None:
    with Session(engine) as session:
        session.begin()
        acquire_leases(session, Seat, where=Seat.id == 1, holder="gone", duration=60)
        session.rollback()
    assert rows(engine, 1)[1][:2] == (None, 0)


# -- expiry, renew, release -------------------------------------------------------------------


def test_an_expired_lease_is_taken_over_by_the_next_acquire(engine: sa.Engine) -> None:
    (stale,) = acquire(engine, where=Seat.id == 1, holder="slow", duration=30)
    assert acquire(engine, where=Seat.id == 1, holder="fast") == []  # not yet
    advance_clock(engine, Seat, 31)
    (taken,) = acquire(engine, where=Seat.id == 1, holder="fast", duration=60)
    assert (taken.key, taken.fence, taken.holder) == (1, 2, "fast")

    with Session(engine) as session, session.begin():
        assert renew_leases(session, [stale], duration=60) == [stale]
        assert release_leases(session, [stale]) == [stale]
        with pytest.raises(LeaseLostError, match=r"Seat 1: the lease of 'slow' with fence 1"):
            renew_lease(session, stale, duration=60)
        with pytest.raises(LeaseLostError):
            release_lease(session, stale)
    assert rows(engine, 1)[1] == ("fast", 2, taken.expires_at)  # the lost calls changed nothing


def test_renew_extends_from_now_in_database_time(engine: sa.Engine) -> None:
    (lease,) = acquire(engine, where=Seat.id == 1, duration=60)
    before = db_now(engine)
    with Session(engine) as session, session.begin():
        renewed = renew_lease(session, lease, duration=timedelta(minutes=5))
    after = db_now(engine)
    assert (renewed.key, renewed.fence, renewed.holder) == (lease.key, 1, lease.holder)
    assert before <= renewed.expires_at - timedelta(minutes=5) <= after
    assert rows(engine, 1)[1] == (lease.holder, 1, renewed.expires_at)
    with Session(engine) as session, session.begin():
        assert renew_leases(session, [lease, renewed], duration=60) == []  # same grant twice


def test_an_expired_lease_nobody_took_can_still_be_renewed(engine: sa.Engine) -> None:
    # Its fence has not moved, which proves no one else held the row in between.
    (lease,) = acquire(engine, where=Seat.id == 1, duration=30)
    advance_clock(engine, Seat, 31)
    with Session(engine) as session, session.begin():
        renewed = renew_lease(session, lease, duration=60)
    assert renewed.fence == 1
    assert acquire(engine, where=Seat.id == 1) == []


def test_release_frees_the_row_and_the_fence_only_grows(engine: sa.Engine) -> None:
    (lease,) = acquire(engine, where=Seat.id == 1)
    with Session(engine) as session, session.begin():
        release_lease(session, lease)
        released_at = session.execute(sa.select(sa.func.statement_timestamp())).scalar_one()
    holder, fence, expires_at = rows(engine, 1)[1]
    assert (holder, fence) == (None, 1)
    assert expires_at <= released_at  # free since the release: acquirable at once
    (again,) = acquire(engine, where=Seat.id == 1, holder="cart-2")
    assert again.fence == 2
    with Session(engine) as session, session.begin():
        with pytest.raises(LeaseLostError):
            release_lease(session, lease)  # released once already
        assert renew_leases(session, [lease, again], duration=60) == [lease]


def test_leases_match_on_key_fence_and_holder(engine: sa.Engine) -> None:
    (lease,) = acquire(engine, where=Seat.id == 1, holder="cart-41")
    rebuilt = Lease(Seat, 1, lease.fence, "cart-41", lease.expires_at)  # from a cookie, say
    forged = rebuilt._replace(holder="cart-666")
    with Session(engine) as session, session.begin():
        assert renew_leases(session, [forged], duration=60) == [forged]
        assert release_leases(session, [rebuilt]) == []
    assert rows(engine, 1)[1][:2] == (None, 1)


def test_release_first_guards_the_holders_own_writes(engine: sa.Engine) -> None:
    (mine,) = acquire(engine, where=Seat.id == 1, holder="cart-41", duration=30)
    advance_clock(engine, Seat, 31)
    acquire(engine, where=Seat.id == 1, holder="cart-42")  # takes the expired lease over

    def sell() -> None:
        with Session(engine) as session, session.begin():
            release_lease(session, mine)
            session.get_one(Seat, 1).sold_to = "cart-41"  # never reached

    with pytest.raises(LeaseLostError):
        sell()
    with Session(engine) as session:
        seat = session.get_one(Seat, 1)
        assert (seat.sold_to, seat.lease_holder) == (None, "cart-42")


def test_composite_and_uuid_keys(engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        session.add_all([Address(pool="p", address=f"10.0.0.{n}") for n in range(3)])
        session.add_all([Licence(product="x") for _ in range(2)])
    with Session(engine) as session, session.begin():
        addresses = acquire_leases(session, Address, holder="host-a", duration=60, limit=2)
        licences = acquire_leases(session, Licence, holder="host-a", duration=60, limit=5)
    assert [lease.key for lease in addresses] == [("p", "10.0.0.0"), ("p", "10.0.0.1")]
    assert len(licences) == 2
    with Session(engine) as session, session.begin():
        assert session.get(Address, addresses[0].key) is not None
        assert renew_leases(session, addresses, duration=30) == []
        assert release_leases(session, licences) == []
        release_lease(session, addresses[1])
        with pytest.raises(LeaseLostError):
            renew_lease(session, addresses[1], duration=30)


def test_a_core_connection_works_too(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        (lease,) = acquire_leases(connection, Seat, where=Seat.id == 3, holder="c", duration=9)
        assert renew_lease(connection, lease, duration=60).fence == 1
        release_lease(connection, lease)
    assert rows(engine, 3)[3][:2] == (None, 1)


def test_empty_batches_run_no_sql(engine: sa.Engine) -> None:
    with count_statements(engine) as statements, Session(engine) as session:
        assert renew_leases(session, [], duration=60) == []
        assert release_leases(session, ()) == []
    assert statements == []


# -- lock-held use ----------------------------------------------------------------------------


def test_hold_keeps_the_rows_for_the_transaction_even_past_expiry(engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        (lease,) = acquire_leases(
            session, Seat, where=Seat.id == 1, holder="box-office", duration=0.2, hold=True
        )
        time.sleep(0.4)  # the lease has expired; the row lock holds
        with Session(engine) as other, other.begin():
            other.execute(sa.text("SET LOCAL lock_timeout = '1s'"))
            assert acquire_leases(other, Seat, where=Seat.id == 1, holder="x", duration=9) == []
        release_lease(session, lease)  # fence unchanged: still the holder's
        session.get_one(Seat, 1).sold_to = "box-office"
    with Session(engine) as session:
        seat = session.get_one(Seat, 1)
        assert (seat.sold_to, seat.lease_holder, seat.lease_fence) == ("box-office", None, 1)


def test_hold_commits_the_grant_first_so_a_fence_is_never_granted_twice(
    engine: sa.Engine,
) -> None:
    with Session(engine) as session:
        session.begin()
        (lease,) = acquire_leases(
            session, Seat, where=Seat.id == 1, holder="dies", duration=30, hold=True
        )
        assert rows(engine, 1)[1] == ("dies", 1, lease.expires_at)  # committed, seen outside
        session.rollback()  # as if the process died: the lock goes, the grant stands
    assert acquire(engine, where=Seat.id == 1) == []
    advance_clock(engine, Seat, 31)  # ... until it expires
    (after,) = acquire(engine, where=Seat.id == 1)
    assert after.fence == 2


def test_hold_refuses_a_transaction_that_is_not_read_committed(engine: sa.Engine) -> None:
    repeatable = engine.execution_options(isolation_level="REPEATABLE READ")
    with (
        Session(repeatable) as session,
        session.begin(),
        pytest.raises(ConfigurationError, match="READ COMMITTED"),
    ):
        acquire_leases(session, Seat, holder="h", duration=9, hold=True)
    assert all(fence == 0 for _, fence, _ in rows(engine).values())


def test_hold_with_nothing_to_acquire(engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        assert (
            acquire_leases(session, Seat, where=Seat.id == 99, holder="h", duration=9, hold=True)
            == []
        )


# -- async ------------------------------------------------------------------------------------


async def test_the_async_functions_are_the_sync_ones(engine: sa.Engine) -> None:
    async_engine = create_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with AsyncSession(async_engine) as session, session.begin():
            leases = await aio.acquire_leases(
                session, Seat, where=Seat.show_id == 7, holder="a", duration=60, limit=2
            )
            assert await aio.renew_leases(session, leases, duration=60) == []
            renewed = await aio.renew_lease(session, leases[0], duration=60)
            assert await aio.release_leases(session, leases[1:]) == []
            await aio.release_lease(session, renewed)
        async with AsyncSession(async_engine) as session, session.begin():
            (held,) = await aio.acquire_leases(
                session, Seat, where=Seat.id == 1, holder="h", duration=60, hold=True
            )
            assert held.fence == 2
    finally:
        await async_engine.dispose()
    for name in (
        "acquire_leases",
        "renew_lease",
        "renew_leases",
        "release_lease",
        "release_leases",
    ):
        assert getattr(aio, name).__wrapped__ is getattr(sqla_jobs, name)


# -- bad input --------------------------------------------------------------------------------


class count_statements:
    """Collect every SQL statement run on ``engine`` inside the block."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.seen: list[str] = []

    def _record(self, *args: Any) -> None:
        self.seen.append(args[2])

    def __enter__(self) -> list[str]:
        sa.event.listen(self.engine, "before_cursor_execute", self._record)
        return self.seen

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._record)


class Unmapped(LeaseMixin):
    pass


A_LEASE = Lease(Seat, 1, 1, "cart-1", datetime(2030, 1, 1, tzinfo=timezone.utc))
AN_ADDRESS = Lease(Address, ("p", "10.0.0.1"), 1, "h", A_LEASE.expires_at)
HUNDRED_YEARS_AND_A_DAY = timedelta(days=365 * 100 + 1)


def acquire_with(**options: Any) -> Callable[[Session], object]:
    arguments: dict[str, Any] = {"holder": "cart-1", "duration": 60} | options
    model = arguments.pop("model", Seat)
    return lambda session: acquire_leases(session, model, **arguments)


BAD_ACQUIRES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"model": object}, ConfigurationError, ""),
    ({"model": Show}, ConfigurationError, ""),
    ({"model": Unmapped}, ConfigurationError, ""),
    ({"model": EmailJob}, ConfigurationError, ""),
    ({"where": Show.id == 7}, InvalidLeaseError, "where"),
    ({"where": aliased(Seat).id == 1}, InvalidLeaseError, "where"),
    ({"where": sa.text("show_id = 7")}, InvalidLeaseError, "where"),
    ({"where": "show_id = 7"}, InvalidLeaseError, "where"),
    ({"where": True}, InvalidLeaseError, "where"),
    ({"where": Seat.number}, InvalidLeaseError, "where"),
    ({"where": Seat.number + 1}, InvalidLeaseError, "where"),
    # Raw SQL cannot be checked, and a column of no table is not the model's: refused.
    ({"where": sa.literal_column("show_id = 7", sa.Boolean)}, InvalidLeaseError, "where"),
    ({"where": sa.literal_column("true")}, InvalidLeaseError, "where"),
    ({"where": Seat.show_id == sa.literal_column("7")}, InvalidLeaseError, "where"),
    ({"where": (Seat.show_id == 7) & sa.text("true")}, InvalidLeaseError, "where"),
    ({"where": sa.column("show_id") == 7}, InvalidLeaseError, "where"),
    ({"where": sa.table("shows", sa.column("id")).c.id == 7}, InvalidLeaseError, "where"),
    ({"where": sa.func.coalesce(Show.on_sale, True)}, InvalidLeaseError, "where"),
    ({"order_by": sa.literal_column("number")}, InvalidLeaseError, "order_by"),
    ({"order_by": [Seat.number, sa.column("id").desc()]}, InvalidLeaseError, "order_by"),
    ({"order_by": Show.id}, InvalidLeaseError, "order_by"),
    ({"order_by": [Seat.number, Show.id.desc()]}, InvalidLeaseError, "order_by"),
    ({"order_by": []}, InvalidLeaseError, "order_by"),
    ({"order_by": "number"}, InvalidLeaseError, "order_by"),
    ({"limit": 0}, InvalidLeaseError, "limit"),
    ({"limit": -1}, InvalidLeaseError, "limit"),
    ({"limit": 10_001}, InvalidLeaseError, "limit"),
    ({"limit": True}, InvalidLeaseError, "limit"),
    ({"limit": 2.0}, InvalidLeaseError, "limit"),
    ({"limit": "2"}, InvalidLeaseError, "limit"),
    ({"holder": ""}, InvalidLeaseError, "holder"),
    ({"holder": None}, InvalidLeaseError, "holder"),
    ({"holder": 41}, InvalidLeaseError, "holder"),
    ({"holder": "cart 41"}, InvalidLeaseError, "holder"),
    ({"holder": "x" * 201}, InvalidLeaseError, "holder"),
    ({"duration": 0}, InvalidLeaseError, "duration"),
    ({"duration": -5}, InvalidLeaseError, "duration"),
    ({"duration": 1e-9}, InvalidLeaseError, "duration"),
    ({"duration": math.nan}, InvalidLeaseError, "duration"),
    ({"duration": math.inf}, InvalidLeaseError, "duration"),
    ({"duration": 10**400}, InvalidLeaseError, "duration"),
    ({"duration": HUNDRED_YEARS_AND_A_DAY}, InvalidLeaseError, "duration"),
    ({"duration": timedelta(0)}, InvalidLeaseError, "duration"),
    ({"duration": "30"}, InvalidLeaseError, "duration"),
    ({"duration": True}, InvalidLeaseError, "duration"),
    ({"duration": None}, InvalidLeaseError, "duration"),
    ({"hold": "yes"}, InvalidLeaseError, "hold"),
    ({"hold": 1}, InvalidLeaseError, "hold"),
]


def _stable_id(value: object) -> str:
    """A test id without memory addresses, the same in every process (pytest-xdist)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


@pytest.mark.parametrize(("options", "error", "field"), BAD_ACQUIRES, ids=_stable_id)
def test_bad_acquires_are_refused_before_any_sql(
    engine: sa.Engine, options: dict[str, Any], error: type[Exception], field: str
) -> None:
    with (
        count_statements(engine) as statements,
        Session(engine) as session,
        pytest.raises(error) as info,
    ):
        acquire_with(**options)(session)
    assert statements == []
    if isinstance(info.value, InvalidLeaseError):
        assert info.value.field == field
        assert isinstance(info.value, InvalidJobError | ValueError)
        assert str(info.value).startswith(f"{field}: ")


BAD_BATCHES: list[tuple[Callable[[Session], object], type[Exception], str]] = [
    (lambda s: renew_leases(s, A_LEASE, duration=9), InvalidLeaseError, "leases"),  # type: ignore[arg-type]
    (lambda s: release_leases(s, A_LEASE), InvalidLeaseError, "leases"),  # type: ignore[arg-type]
    (lambda s: release_leases(s, [object()]), InvalidLeaseError, "leases"),  # type: ignore[list-item]
    (lambda s: release_leases(s, [(Seat, 1, 1, "h", None)]), InvalidLeaseError, "leases"),  # type: ignore[list-item]
    (lambda s: release_leases(s, [A_LEASE, AN_ADDRESS]), InvalidLeaseError, "leases"),
    (lambda s: renew_leases(s, [AN_ADDRESS, A_LEASE], duration=9), InvalidLeaseError, "leases"),
    (
        lambda s: release_leases(s, [A_LEASE, A_LEASE._replace(model=Show)]),  # type: ignore[arg-type]
        InvalidLeaseError,
        "leases",
    ),
    (lambda s: release_leases(s, [A_LEASE._replace(model=Show)]), ConfigurationError, ""),  # type: ignore[arg-type]
    (
        lambda s: release_leases(s, [AN_ADDRESS._replace(key="10.0.0.1")]),
        InvalidLeaseError,
        "leases",
    ),
    (lambda s: release_leases(s, [A_LEASE._replace(key=(1, 2))]), InvalidLeaseError, "leases"),
    (lambda s: release_leases(s, [A_LEASE._replace(key=None)]), InvalidLeaseError, "leases"),
    (lambda s: release_leases(s, [A_LEASE._replace(fence=0)]), InvalidLeaseError, "leases"),
    (lambda s: release_leases(s, [A_LEASE._replace(fence=True)]), InvalidLeaseError, "leases"),
    (lambda s: release_leases(s, [A_LEASE._replace(fence="1")]), InvalidLeaseError, "leases"),  # type: ignore[arg-type]
    (lambda s: release_leases(s, [A_LEASE._replace(holder="")]), InvalidLeaseError, "holder"),
    (lambda s: renew_leases(s, [], duration=0), InvalidLeaseError, "duration"),
    (lambda s: renew_leases(s, [A_LEASE], duration=-1), InvalidLeaseError, "duration"),
    (lambda s: renew_lease(s, A_LEASE, duration="1m"), InvalidLeaseError, "duration"),  # type: ignore[arg-type]
    (lambda s: renew_lease(s, [A_LEASE], duration=9), InvalidLeaseError, "lease"),  # type: ignore[arg-type]
    (lambda s: release_lease(s, None), InvalidLeaseError, "lease"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("call", "error", "field"), BAD_BATCHES)
def test_bad_renewals_and_releases_are_refused_before_any_sql(
    engine: sa.Engine, call: Callable[[Session], object], error: type[Exception], field: str
) -> None:
    with (
        count_statements(engine) as statements,
        Session(engine) as session,
        pytest.raises(error) as info,
    ):
        call(session)
    assert statements == []
    if isinstance(info.value, InvalidLeaseError):
        assert info.value.field == field


def test_model_mistakes_are_refused_when_the_class_is_defined() -> None:
    class Base(DeclarativeBase):
        pass

    try:
        with pytest.raises(ConfigurationError, match="JobMixin and LeaseMixin"):

            class Both(JobMixin, LeaseMixin, Base):  # type: ignore[misc]
                __tablename__ = "both"

        with pytest.raises(ConfigurationError, match="'shwo_id', which is not a column"):

            class Typo(LeaseMixin, Base):
                __tablename__ = "typo"
                lease_index_columns = ("shwo_id",)
                id: Mapped[int] = mapped_column(primary_key=True)
                show_id: Mapped[int]

        with pytest.raises(ConfigurationError, match="must be a tuple of column names"):

            class Bare(LeaseMixin, Base):
                __tablename__ = "bare"
                lease_index_columns = "show_id"  # type: ignore[assignment]
                id: Mapped[int] = mapped_column(primary_key=True)
                show_id: Mapped[int]
    finally:
        Base.registry.dispose()  # the half-made mappers go with their registry


# -- the index --------------------------------------------------------------------------------


def test_the_lease_index_is_named_from_the_table_and_ends_with_the_key() -> None:
    seats: sa.Table = Seat.__table__  # type: ignore[assignment]
    indexes = {index.name: [c.name for c in index.columns] for index in seats.indexes}
    assert indexes == {"seats_lease_idx": ["show_id", "lease_expires_at", "id"]}
    assert lease_names("seats").index == "seats_lease_idx"
    addresses: sa.Table = Address.__table__  # type: ignore[assignment]
    (address_index,) = addresses.indexes
    assert [c.name for c in address_index.columns] == ["lease_expires_at", "pool", "address"]
    long = lease_names("t" * 80).index
    assert len(long) <= 63
    assert long.endswith("_lease_idx")


def test_acquire_reads_only_acquirable_rows_through_the_lease_index(engine: sa.Engine) -> None:
    from sqla_jobs._queries import leases as statements

    with engine.begin() as connection:
        # 200 shows of 500 seats, show 7 nearly sold out: 10 free seats left at its end.
        connection.execute(sa.text("TRUNCATE seats, shows CASCADE"))
        connection.execute(
            sa.text("INSERT INTO shows SELECT s, true FROM generate_series(1, 200) s")
        )
        connection.execute(
            sa.text(
                "INSERT INTO seats (id, show_id, number, lease_holder, lease_expires_at, "
                "lease_fence) SELECT s * 1000 + n, s, n, "
                "CASE WHEN s = 7 AND n > 490 THEN NULL ELSE 'h' END, "
                "CASE WHEN s = 7 AND n > 490 THEN now() - interval '1 minute' "
                "ELSE now() + interval '1 hour' END, 1 "
                "FROM generate_series(1, 200) s, generate_series(1, 500) n"
            )
        )
        connection.execute(sa.text("ANALYZE seats"))
    table = Seat.__table__
    statement = statements.acquire(
        table,  # type: ignore[arg-type]
        where=Seat.show_id == 7,
        order_by=(table.c.lease_expires_at, table.c.id),
    )
    for generic in (False, True):
        compiled = statement.compile(dialect=engine.dialect)
        params = compiled.params | {"limit": 2, "holder": "h", "duration_seconds": 9.0}
        plan = explain_rolled_back(engine, str(compiled), params, generic=generic)
        # The choice of rows; the statement's last step only sorts the rows it returns.
        every = list(plan_nodes(plan["Plan"]))
        (choice,) = [n for n in every if n.get("Subplan Name") == "CTE acquirable"]
        nodes = list(plan_nodes(choice))
        lease_scans = [n for n in nodes if n.get("Index Name") == "seats_lease_idx"]
        assert lease_scans, [n["Node Type"] for n in nodes]
        assert not [n for n in nodes if n["Node Type"] in ("Seq Scan", "Sort", "Incremental Sort")]
        assert not [n for n in every if n["Node Type"] == "Seq Scan"]
        # The 490 held seats of show 7 (and 99,500 of other shows) are never read.
        assert lease_scans[0]["Actual Rows"] <= 2
        assert (
            lease_scans[0]["Shared Hit Blocks"] + lease_scans[0].get("Shared Read Blocks", 0) < 20
        )


# -- migrations -------------------------------------------------------------------------------


def _differences(connection: sa.Connection) -> list[Any]:
    context = MigrationContext.configure(
        connection,
        opts={"compare_type": True, "compare_server_default": True},
    )
    return list(compare_metadata(context, LeaseBase.metadata))


def test_autogenerate_is_clean_and_the_helpers_add_what_the_mixin_declares(
    fresh_database: FreshDatabase,
) -> None:
    engine = sa.create_engine(fresh_database("sqla_jobs_lease_mig"), poolclass=sa.NullPool)
    try:
        LeaseBase.metadata.create_all(engine)
        with engine.begin() as connection:
            assert _differences(connection) == []  # create_all (and autogenerate) as declared
            connection.execute(sa.text("INSERT INTO shows VALUES (7, true)"))
            connection.execute(sa.text("INSERT INTO seats (id, show_id, number) VALUES (1, 7, 1)"))
        with (
            engine.begin() as connection,
            Operations.context(MigrationContext.configure(connection)),
        ):
            migrations.drop_lease_columns("seats")
        columns = {c["name"] for c in sa.inspect(engine).get_columns("seats")}
        assert columns == {"id", "show_id", "number", "sold_to"}
        indexes = {i["name"] for i in sa.inspect(engine).get_indexes("seats")}
        assert indexes == {"seats_show_number_key"}  # the model's own unique constraint

        # A table of yours without the columns, with rows: the helper adds them.
        with (
            engine.begin() as connection,
            Operations.context(MigrationContext.configure(connection)),
        ):
            migrations.add_lease_columns("seats", index_columns=("show_id",))
        with engine.begin() as connection:
            assert _differences(connection) == []
        (lease,) = acquire(engine, where=Seat.show_id == 7)  # the old row is free
        assert (lease.key, lease.fence) == (1, 1)

        with engine.connect() as connection:
            context = MigrationContext.configure(connection)
            with Operations.context(context), context.begin_transaction():
                migrations.drop_lease_index("seats", concurrently=True)
                migrations.create_lease_index(
                    "seats", index_columns=("show_id",), concurrently=True
                )
        with engine.begin() as connection:
            assert _differences(connection) == []
    finally:
        engine.dispose()


def test_autogenerate_sees_a_lease_index_that_differs(fresh_database: FreshDatabase) -> None:
    engine = sa.create_engine(fresh_database("sqla_jobs_lease_mig"), poolclass=sa.NullPool)
    try:
        LeaseBase.metadata.create_all(engine)
        with (
            engine.begin() as connection,
            Operations.context(MigrationContext.configure(connection)),
        ):
            migrations.drop_lease_index("seats")
            migrations.create_lease_index("seats")  # without the model's show_id
        with engine.begin() as connection:
            assert _differences(connection) != []
    finally:
        engine.dispose()


# -- docs/how-to/leasing.md ----------------------------------------------------------------------


def page_text() -> str:
    return PAGE.read_text(encoding="utf-8")


def test_docs_column_table_matches_the_mixin() -> None:
    rows_ = [
        [cell.strip().replace("`", "") for cell in line.strip("|").split("|")]
        for line in page_text().splitlines()
        if line.startswith("| `lease_")
    ]
    table = Seat.__table__
    described = []
    for name in lease_schema.LEASE_COLUMNS:
        column = table.c[name]
        sql_type = column.type.compile(dialect=sa.dialects.postgresql.dialect())  # type: ignore[no-untyped-call]
        sql_type = sql_type.lower().replace("timestamp with time zone", "timestamptz")
        described.append([name, sql_type + (", null" if column.nullable else "")])
    assert [row[:2] for row in rows_] == described


def test_docs_migration_block_runs(fresh_database: FreshDatabase) -> None:
    section = page_text()
    (code,) = re.findall(
        r"<!-- docs-test: not run, an Alembic revision[^>]*-->\n```python\n(.*?)```",
        section,
        re.DOTALL,
    )
    revision: dict[str, Any] = {}
    exec(compile(code, "docs/how-to/leasing.md (lease revision)", "exec"), revision)
    engine = sa.create_engine(fresh_database("sqla_jobs_lease_mig"), poolclass=sa.NullPool)
    try:
        LeaseBase.metadata.create_all(engine)
        with (
            engine.begin() as connection,
            Operations.context(MigrationContext.configure(connection)),
        ):
            migrations.drop_lease_columns("seats")
            revision["upgrade"]()
        with engine.begin() as connection:
            assert _differences(connection) == []
            with Operations.context(MigrationContext.configure(connection)):
                revision["downgrade"]()
        assert "lease_fence" not in {c["name"] for c in sa.inspect(engine).get_columns("seats")}
    finally:
        engine.dispose()


def test_a_lease_statement_returning_other_columns_fails_when_first_run() -> None:
    # The layer reads each lease statement's row as the primary key then the lease columns;
    # a statement that returns anything else fails the first time it runs on a table, not
    # as a value read from the wrong place.
    from sqla_jobs._queries import leases as statements

    table: sa.Table = Seat.__table__  # type: ignore[assignment]

    def key_only(table: sa.Table) -> sa.Select[Any]:
        return sa.select(*table.primary_key.columns)

    expected = r"returns \['id'\], not \['id', 'lease_fence'\]"
    with pytest.raises(statements.LeaseQueryError, match=expected):
        statements._checked(key_only(table), key_only, table, ("lease_fence",))
    lock = statements.lock(table)
    assert statements._checked(lock, statements.lock, table, ("lease_fence",)) is lock
