"""The lease columns and index (:mod:`sqla_jobs.leasing`), added to a table of yours."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from sqla_jobs.schema.leases import lease_index_elements, lease_names

LEASE_SCHEMA_VERSION = 1
"""The version of the lease columns and index that the lease helpers below create."""

# Frozen copies of what LeaseMixin declares (lease version 1); tests/test_leasing.py proves
# that they still match the mixin.
_LEASE_HOLDER_LENGTH = 200


def _lease_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("lease_holder", sa.String(_LEASE_HOLDER_LENGTH), nullable=True),
        sa.Column(
            "lease_expires_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),
            nullable=False,
        ),
        sa.Column("lease_fence", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    ]


def add_lease_columns(
    table_name: str,
    *,
    index_columns: tuple[str, ...] = (),
    primary_key: tuple[str, ...] = ("id",),
    schema: str | None = None,
    concurrently: bool = False,
) -> None:
    """Add the :class:`~sqla_jobs.LeaseMixin` columns and the lease index to an existing
    table of yours, from your own revision.

    ``index_columns`` is your model's ``lease_index_columns`` and ``primary_key`` its
    primary-key column names (in order), which end the index: together they must give the
    index the model declares, which autogenerate then compares. Every existing row becomes
    free, acquirable at once (``lease_expires_at`` is the migration's time, ``lease_fence``
    0). On PostgreSQL 11 and later the columns are added without rewriting the table (their
    defaults are not volatile), under a brief ``ACCESS EXCLUSIVE`` lock; set a
    ``lock_timeout`` in the revision on a busy table. With ``concurrently=True`` the index
    is built as :func:`create_lease_index` says.

    A revision for ``Seat(LeaseMixin, Base)`` with ``lease_index_columns = ("show_id",)``::

        from sqla_jobs import migrations

        def upgrade() -> None:
            migrations.add_lease_columns("seats", index_columns=("show_id",))

        def downgrade() -> None:
            migrations.drop_lease_columns("seats")
    """
    for column in _lease_columns():
        op.add_column(table_name, column, schema=schema)
    create_lease_index(
        table_name,
        index_columns=index_columns,
        primary_key=primary_key,
        schema=schema,
        concurrently=concurrently,
    )


def drop_lease_columns(table_name: str, *, schema: str | None = None) -> None:
    """Drop the lease index and columns (:func:`add_lease_columns` undone)."""
    drop_lease_index(table_name, schema=schema)
    for column in reversed(_lease_columns()):
        op.drop_column(table_name, column.name, schema=schema)


def create_lease_index(
    table_name: str,
    *,
    index_columns: tuple[str, ...] = (),
    primary_key: tuple[str, ...] = ("id",),
    schema: str | None = None,
    concurrently: bool = False,
) -> None:
    """Create the lease index: ``index_columns``, ``lease_expires_at``, ``primary_key``
    (see :func:`~sqla_jobs.schema.leases.lease_index_elements`), named
    ``lease_names(table_name).index``.

    :func:`add_lease_columns` already creates it; call this to change a model's
    ``lease_index_columns`` (after :func:`drop_lease_index`). With ``concurrently=True`` it
    is built with ``CREATE INDEX CONCURRENTLY``, which does not block acquires on a live
    table but cannot run in a transaction: the helper runs it in Alembic's
    ``autocommit_block()``, which first commits everything the migration did before it. If
    that build fails it leaves an invalid index behind; drop it and try again.
    """
    name = lease_names(table_name).index
    columns = list(lease_index_elements(tuple(index_columns), tuple(primary_key)))
    if not concurrently:
        op.create_index(name, table_name, columns, schema=schema)
        return
    with op.get_context().autocommit_block():
        op.create_index(name, table_name, columns, schema=schema, postgresql_concurrently=True)


def drop_lease_index(
    table_name: str, *, schema: str | None = None, concurrently: bool = False
) -> None:
    """Drop the lease index (``concurrently`` as for :func:`create_lease_index`)."""
    name = lease_names(table_name).index
    if not concurrently:
        op.drop_index(name, table_name=table_name, schema=schema)
        return
    with op.get_context().autocommit_block():
        op.drop_index(name, table_name=table_name, schema=schema, postgresql_concurrently=True)
