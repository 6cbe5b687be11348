"""Models a user of leasing would write: rows of their own that are handed out by lease."""

from __future__ import annotations

import uuid

from sqlalchemy import ForeignKey, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import LeaseMixin


class LeaseBase(DeclarativeBase):
    pass


class Show(LeaseBase):
    __tablename__ = "shows"

    id: Mapped[int] = mapped_column(primary_key=True)
    on_sale: Mapped[bool] = mapped_column(default=True)


class Seat(LeaseMixin, LeaseBase):
    """The seed article's "next free seat": leased per show, sold for good."""

    __tablename__ = "seats"
    # The model's own table arguments stay its own; the lease index is added beside them.
    __table_args__ = (UniqueConstraint("show_id", "number", name="seats_show_number_key"),)
    lease_index_columns = ("show_id",)

    id: Mapped[int] = mapped_column(primary_key=True)
    show_id: Mapped[int] = mapped_column(ForeignKey("shows.id"))
    number: Mapped[int]
    sold_to: Mapped[str | None] = mapped_column(String(100))


class Address(LeaseMixin, LeaseBase):
    """An IP pool: a composite primary key of another type, no index columns of its own."""

    __tablename__ = "addresses"

    pool: Mapped[str] = mapped_column(String(20), primary_key=True)
    address: Mapped[str] = mapped_column(String(45), primary_key=True)


class Licence(LeaseMixin, LeaseBase):
    """A UUID primary key."""

    __tablename__ = "licences"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    product: Mapped[str] = mapped_column(String(50))
