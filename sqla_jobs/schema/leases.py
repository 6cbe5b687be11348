"""The lease columns, as a declarative mixin for a model of your own (seats, addresses, ...).

Mix :class:`LeaseMixin` into any mapped class; it adds three columns and one index, named
from the table name by :func:`lease_names` (the migration helpers use the same function)::

    class Seat(LeaseMixin, Base):
        __tablename__ = "seats"
        lease_index_columns = ("show_id",)  # what acquire usually filters on

        id: Mapped[int] = mapped_column(primary_key=True)
        show_id: Mapped[int]
        number: Mapped[int]
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import BigInteger, DateTime, Index, String, Table, event, func, text
from sqlalchemy.orm import Mapped, Mapper, mapped_column

from sqla_jobs import validation
from sqla_jobs.errors import ConfigurationError
from sqla_jobs.naming import identifier
from sqla_jobs.schema import JobMixin

__all__ = ["LEASE_COLUMNS", "LeaseMixin", "LeaseNames", "lease_index_elements", "lease_names"]

#: The columns :class:`LeaseMixin` adds, which the lease functions alone write.
LEASE_COLUMNS = ("lease_holder", "lease_expires_at", "lease_fence")


@dataclass(frozen=True)
class LeaseNames:
    """The names of the schema objects the lease columns bring to one table."""

    table: str
    index: str


def lease_names(table: str) -> LeaseNames:
    """Derive the lease index's name from a table name (``<table>_lease_idx``, hashed
    like :func:`sqla_jobs.names` when it would pass PostgreSQL's 63-byte limit)."""
    return LeaseNames(table=table, index=identifier(table, "lease_idx"))


def lease_index_elements(
    index_columns: tuple[str, ...], primary_key: tuple[str, ...]
) -> tuple[str, ...]:
    """The lease index's key columns, in order: the columns acquire usually filters on by
    equality, then ``lease_expires_at``, then the primary key.

    Acquire's condition is one range, ``lease_expires_at <= now``, which holds for free
    rows too (a free row's ``lease_expires_at`` is when it became free), so after the
    equality columns the index holds exactly the acquirable rows first, in the default
    acquire order (free the longest first, then by primary key): the scan reads no held
    row, however many there are, and needs no sort.
    """
    return (*index_columns, "lease_expires_at", *primary_key)


class LeaseMixin:
    """Lease columns for a model of your own: any row can then be leased to one holder at a
    time, for a duration, with a fencing token (see :func:`sqla_jobs.acquire_leases`).

    ``lease_holder``
        Who holds the row (``None``: free). Kept after the lease expires, until the next
        acquire takes the row or the holder releases it.
    ``lease_expires_at``
        When the current lease ends, in database time; for a free row, when it became free
        (its insertion, its release). A row whose ``lease_expires_at`` has passed is
        acquirable: free rows and expired leases alike.
    ``lease_fence``
        The fencing token: grows by one on every acquire of the row and never otherwise, so
        ``(primary key, lease_fence)`` names one grant. Renew and release match on it.

    The lease functions alone write these columns, with Core statements: an instance
    already loaded in a session keeps the values it was loaded with until refreshed.

    Class-level option (set it on your subclass):

    ``lease_index_columns``
        Column names that lead the lease index (default none): the columns your acquire
        filters compare for equality (``("show_id",)`` for ``where=Seat.show_id == 7``),
        so that acquire reads only acquirable rows of that show. The index continues with
        ``lease_expires_at`` and the primary key (:func:`lease_index_elements`); it is
        named ``lease_names(table).index``.
    """

    lease_index_columns: ClassVar[tuple[str, ...]] = ()

    lease_holder: Mapped[str | None] = mapped_column(String(validation.MAX_NAME_LENGTH))
    # NOT NULL, with the row's insertion time as its first value: then "acquirable" is one
    # range condition (lease_expires_at <= now) for free and expired rows alike, which one
    # index range serves, instead of "IS NULL OR <= now", which no btree scan does.
    lease_expires_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    lease_fence: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))


def _attach_lease_index(mapper: Mapper[Any], class_: type[Any]) -> None:
    # Here rather than in __table_args__: the index ends with the primary key, known only
    # once the table is built, and a model's own __table_args__ stays its own (a mixin's
    # declared __table_args__ is replaced by the model's, and its index silently lost).
    if issubclass(class_, JobMixin):
        raise ConfigurationError(
            f"{class_.__name__} mixes in both JobMixin and LeaseMixin; they are for different "
            "tables (both have a lease_expires_at column): lease rows of a table of their own"
        )
    table = mapper.local_table
    if not isinstance(table, Table) or table.info.get("sqla_jobs_lease_index"):
        return  # a single-table subclass shares its parent's table, which has the index
    wanted = class_.lease_index_columns
    if isinstance(wanted, str) or not isinstance(wanted, tuple | list):
        raise ConfigurationError(
            f"{class_.__name__}.lease_index_columns must be a tuple of column names, not {wanted!r}"
        )
    for name in wanted:
        if not isinstance(name, str) or name not in table.c or name in LEASE_COLUMNS:
            raise ConfigurationError(
                f"{class_.__name__}.lease_index_columns names {name!r}, which is not a column "
                f"of {table.name} of your own (its columns: {', '.join(table.c.keys())})"
            )
    primary_key = tuple(column.name for column in table.primary_key.columns)
    elements = lease_index_elements(tuple(wanted), primary_key)
    table.info["sqla_jobs_lease_index"] = True
    Index(lease_names(table.name).index, *(table.c[name] for name in elements))


event.listen(LeaseMixin, "after_mapper_constructed", _attach_lease_index, propagate=True)
