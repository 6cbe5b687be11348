"""The flow-control schema beside a job table: the rate table (``sqla_jobs.schema.rates``),
the recent starts of its rate-limited queues (:class:`sqla_jobs.RateLimit`), and the fair
index of a tenant column (``sqla_jobs.schema.fair``, :class:`sqla_jobs.FairShare`)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from sqla_jobs import ddl
from sqla_jobs.migrations.steps import _create_index, _drop_index, _execute
from sqla_jobs.schema import pending_predicate
from sqla_jobs.schema.fair import FAIR_INDEX_COLUMNS, fair_index_name
from sqla_jobs.schema.rates import rate_names

# A frozen copy of what sqla_jobs.schema.rates.rate_table declares: a change there needs a
# new helper, not an edit here.
_QUEUE_LENGTH = 200


def create_rate_table(table_name: str, *, schema: str | None = None) -> sa.Table:
    """Create the rate table of job table ``table_name`` (``<table>_rates``: ``queue``
    varchar(200), ``key`` text NOT NULL DEFAULT '', ``starts`` timestamptz[] and ``counts``
    integer[], both NOT NULL DEFAULT '{}', ``rate_limit`` integer and ``window_seconds``
    double precision, primary key ``(queue, key)``), empty. Needed by
    workers that rate-limit a queue of the table (``Registry(rate_limits=...)``): they
    refuse to start without it.

    A new, empty table: it takes no lock of the job table, and can run on a live one.
    ``IF NOT EXISTS``: re-runnable. A revision of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.create_rate_table("email_jobs")

        def downgrade() -> None:
            jobs.drop_rate_table("email_jobs")
    """
    n = rate_names(table_name)
    return op.create_table(
        n.table,
        sa.Column("queue", sa.String(_QUEUE_LENGTH), nullable=False),
        sa.Column("key", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column(
            "starts",
            sa.ARRAY(sa.DateTime(timezone=True)),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
        sa.Column("counts", sa.ARRAY(sa.Integer()), server_default=sa.text("'{}'"), nullable=False),
        sa.Column("rate_limit", sa.Integer(), nullable=True),
        sa.Column("window_seconds", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("queue", "key", name=n.primary_key),
        schema=schema,
        if_not_exists=True,
    )


def drop_rate_table(table_name: str, *, schema: str | None = None) -> None:
    """Drop the rate table of ``table_name`` (the recent starts with it: each limit's window
    starts empty again). ``IF EXISTS``: re-runnable."""
    _execute(f"DROP TABLE IF EXISTS {ddl.qualified_name(rate_names(table_name).table, schema)}")


def create_fair_index(
    table_name: str, column: str, *, schema: str | None = None, concurrently: bool = False
) -> None:
    """Create the fair index of job table ``table_name``'s tenant column ``column``
    (:func:`sqla_jobs.schema.fair.fair_index`: ``(queue, <column>, priority, run_at, id)
    WHERE status = 'pending' AND ordering_key IS NULL``), which a fair claim
    (:class:`sqla_jobs.FairShare`) reads; a worker with fair shares refuses to start without
    it. Re-runnable: an index of that name is dropped first (one that an interrupted
    concurrent build left invalid included), then built.

    ``concurrently``: ``CREATE INDEX CONCURRENTLY`` on a live table, without blocking its
    enqueues and claims. It cannot run in a transaction, so the helper runs it in Alembic's
    ``autocommit_block()``, which first commits whatever the revision did before. A revision
    of yours::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.create_fair_index("email_jobs", "customer_id", concurrently=True)

        def downgrade() -> None:
            jobs.drop_fair_index("email_jobs", "customer_id", concurrently=True)
    """
    name = fair_index_name(table_name, column)
    columns = tuple(part or column for part in FAIR_INDEX_COLUMNS)

    def build() -> None:
        _drop_index(name, table_name, schema=schema, concurrently=concurrently, if_exists=True)
        _create_index(
            name, table_name, columns, pending_predicate(), schema=schema, concurrently=concurrently
        )

    if concurrently:
        with op.get_context().autocommit_block():
            build()
    else:
        build()


def drop_fair_index(
    table_name: str, column: str, *, schema: str | None = None, concurrently: bool = False
) -> None:
    """Drop the fair index of ``table_name``'s column ``column`` (``IF EXISTS``;
    ``concurrently``: ``DROP INDEX CONCURRENTLY``, in ``autocommit_block()``)."""
    name = fair_index_name(table_name, column)
    if concurrently:
        with op.get_context().autocommit_block():
            _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)
    else:
        _drop_index(name, table_name, schema=schema, concurrently=False, if_exists=True)
