"""The job table's schema version, which the worker checks at start.

This worker reads and writes every column of schema version 4 (what
:class:`~sqla_jobs.schema.JobMixin` declares), and its claims expect that version's partial
indexes. On an older table its first claim would fail on a missing column, and go on failing
between retries. So before it claims anything, :meth:`Worker.run()
<sqla_jobs.Worker.run>` reads the table's columns and valid indexes (one catalog
query, :func:`~sqla_jobs._queries.table_layout`) and, on an older layout, raises
:class:`~sqla_jobs.errors.SchemaVersionError`, whose one line names the migration helpers to
run, in order (:func:`upgrade_calls`).

The layouts, as told apart here (:mod:`sqla_jobs.migrations.tables` describes each version):

1. The version-1 claim index (``names(table).claim_index``) is there, or the pending or the
   running index of version 2 is not: :func:`~sqla_jobs.migrations.upgrade_job_table_to_v2`,
   then :func:`~sqla_jobs.migrations.upgrade_job_table_to_v3`.
2. Those are right, but a column or a partial index of version 3 is missing (or a version-3
   upgrade was interrupted): :func:`~sqla_jobs.migrations.upgrade_job_table_to_v3`, which
   can run again, then :func:`~sqla_jobs.migrations.upgrade_job_table_to_v4`.
3. Everything of version 3 is there, but a column version 4 adds is not, or its pause table
   (:mod:`sqla_jobs.schema.pauses`) is missing:
   :func:`~sqla_jobs.migrations.upgrade_job_table_to_v4`.
4. Everything the mixin declares is there.

The partial indexes are the model's indexes with a ``postgresql_where``
(:func:`partial_indexes`, the ones :func:`sqla_jobs.migrations.check_claim_indexes`
compares) that :func:`~sqla_jobs.schema.names` names; the model's own columns and indexes are
left to the application's migrations. ``check_claim_indexes`` names helpers the same way
(:func:`helper_call`), and compares predicates too, which this check leaves out: a pending
index with the predicate of version 2 still serves the claim (only more slowly).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields
from typing import Any, Final

from sqlalchemy import Table

from sqla_jobs import _queries as statements
from sqla_jobs.errors import ConfigurationError, InvalidJobError, SchemaVersionError
from sqla_jobs.queue.claiming import check_fair_columns
from sqla_jobs.registry import Registry
from sqla_jobs.schema import STEP_COLUMNS, names
from sqla_jobs.schema.fair import fair_index_name
from sqla_jobs.schema.workflows import check_step_model, workflow_names

__all__ = [
    "SCHEMA_VERSION",
    "check_table_version",
    "helper_call",
    "partial_indexes",
    "table_version",
    "upgrade_calls",
]

SCHEMA_VERSION: Final = 4
"""The schema version of the job table that this version of sqla_jobs declares and needs."""

# The helpers of sqla_jobs.migrations that each upgrade a table by one schema version: the
# version they bring it to, and the helper.
_UPGRADES: Final = (
    (2, "upgrade_job_table_to_v2"),
    (3, "upgrade_job_table_to_v3"),
    (4, "upgrade_job_table_to_v4"),
)

# Every column JobMixin declares (the model's own columns are the application's business).
_MIXIN_COLUMNS: Final = (
    frozenset(statements.ENQUEUE_COLUMNS)
    | statements.MANAGED_COLUMNS
    | statements.UNIQUE_COLUMNS
    | statements.ORDERING_COLUMNS
    | statements.CONTEXT_COLUMNS
)
# The columns version 4 adds (job control); a table with everything else is version 3.
_V4_COLUMNS: Final = frozenset(statements.CONTROL_COLUMNS)


def partial_indexes(table: Table) -> list[str]:
    """The names of the table's partial indexes (the ones with ``postgresql_where``), in
    name order: for a :class:`~sqla_jobs.schema.JobMixin` model, the claim's indexes and
    the others of its schema version."""
    return sorted(
        str(index.name)
        for index in table.indexes
        if index.dialect_options["postgresql"]["where"] is not None
    )


def table_version(
    table: Table, columns: Collection[str], indexes: Collection[str], *, pauses: bool = True
) -> int:
    """The schema version of the job table of the model whose table is ``table``, from the
    ``columns`` and valid ``indexes`` that :func:`~sqla_jobs._queries.table_layout` found:
    1, 2, 3 or :data:`SCHEMA_VERSION` (see the module's docstring); ``pauses``: whether its
    pause table exists (version 4)."""
    n = names(table.name)
    found = frozenset(indexes)
    if n.claim_index in found or not {n.pending_index, n.running_index} <= found:
        return 1
    # The mixin's columns and partial indexes, not the model's own (their migrations are
    # the application's business, and no helper of ours makes them).
    wanted_columns = _MIXIN_COLUMNS.intersection(c.name for c in table.columns)
    ours = {getattr(n, f.name) for f in fields(n) if f.name.endswith("_index")}
    wanted_indexes = ours.intersection(partial_indexes(table))
    present = frozenset(columns)
    if not wanted_indexes <= found or not wanted_columns - _V4_COLUMNS <= present:
        return 2
    return SCHEMA_VERSION if wanted_columns <= present and pauses else 3


def helper_call(helper: str, table: Table) -> str:
    """A call of the migration helper ``helper`` on ``table``, as a revision writes it:
    ``sqla_jobs.migrations.add_unique_keys('email_jobs', schema='jobs')``."""
    schema = "" if table.schema is None else f", schema={table.schema!r}"
    return f"sqla_jobs.migrations.{helper}({table.name!r}{schema})"


def upgrade_calls(table: Table, version: int) -> list[str]:
    """The helper calls that upgrade ``table`` from schema ``version`` to
    :data:`SCHEMA_VERSION`, in the order to run them (none from the latest)."""
    return [helper_call(helper, table) for to, helper in _UPGRADES if to > version]


def check_table_version(
    table: Table, columns: Collection[str], indexes: Collection[str], *, pauses: bool = True
) -> None:
    """Raise :class:`~sqla_jobs.errors.SchemaVersionError` unless the table that
    :func:`~sqla_jobs._queries.table_layout` read has the layout of :data:`SCHEMA_VERSION`."""
    version = table_version(table, columns, indexes, pauses=pauses)
    if version == SCHEMA_VERSION:
        return
    calls = upgrade_calls(table, version)
    raise SchemaVersionError(
        f"job table {table.fullname!r} has the layout of schema version {version} and this "
        f"worker needs version {SCHEMA_VERSION}: upgrade it from an Alembic revision with "
        f"{', then '.join(calls)}",
        table=table.fullname,
        version=version,
        helpers=tuple(calls),
    )


def check_flow_control(
    model_name: str,
    table: Table,
    registry: Registry,
    indexes: Collection[str],
    *,
    rates: bool,
) -> None:
    """What the registry's flow control needs of the job table, checked at the worker's
    start (:class:`~sqla_jobs.errors.ConfigurationError` naming the helper to run): the rate
    table for rate limits (``rates``: it exists), and for each fair share a column of the
    model's own (:func:`~sqla_jobs.queue.check_fair_columns`) and its fair index (one of
    ``indexes``: without it, each of the claim's descents would read the whole table)."""
    if registry.rate_limits and not rates:
        raise ConfigurationError(
            f"{model_name}'s table {table.name!r} has no rate table, which "
            f"its rate limits ({', '.join(sorted(registry.rate_limits))}) need: add it "
            f"with sqla_jobs.migrations.create_rate_table({table.name!r}) in a "
            "revision of yours (docs/how-to/rate-limits.md)"
        )
    try:
        shares = check_fair_columns(table, registry.fair_shares)
    except InvalidJobError as exc:
        raise ConfigurationError(f"fair_shares: {exc.reason}") from None
    for name, share in shares.items():
        index = fair_index_name(table.name, share.column)
        if index not in indexes:
            raise ConfigurationError(
                f"{model_name}'s table {table.name!r} has no fair index {index!r}, which "
                f"queue {name!r}'s fair share by {share.column!r} needs: declare it with "
                f"sqla_jobs.schema.fair.fair_index({model_name}, {share.column!r}) or add it "
                f"with sqla_jobs.migrations.create_fair_index({table.name!r}, "
                f"{share.column!r}) in a revision of yours (docs/how-to/fair-shares.md)"
            )


def check_steps(
    model: type[Any], table: Table, columns: Collection[str], triggers: Collection[str]
) -> None:
    """What a model with workflow steps needs of its job table, checked at the worker's start
    (:class:`~sqla_jobs.errors.ConfigurationError` naming the helper): the step columns and
    the workflow trigger, without which a step would wait for ever."""
    model_name = model.__name__
    workflow_table = check_step_model(model).name
    n = workflow_names(table.name, workflow_table)
    missing = [column for column in STEP_COLUMNS if column not in columns]
    if missing or n.trigger not in triggers or n.delete_trigger not in triggers:
        what = f"the step columns {missing}" if missing else "the workflow trigger"
        raise ConfigurationError(
            f"{model_name}'s table {table.name!r} lacks {what}, which its workflow steps "
            f"need: add them with sqla_jobs.migrations.add_workflow_steps({table.name!r}, "
            f"{workflow_table!r}) in a revision of yours (docs/how-to/workflows.md)"
        )
