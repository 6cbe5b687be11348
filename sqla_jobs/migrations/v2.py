"""Schema version 2: the pending index and the running index instead of the claim index, and
the in-place upgrade of a live version-1 table.

They are frozen copies of what the mixins declared in that version: tests/test_migrations.py
proves that the latest still matches the mixins; a change to the mixins needs a new version,
not an edit here.
"""

from __future__ import annotations

from alembic import op

from sqla_jobs.migrations.steps import _create_index, _drop_index
from sqla_jobs.migrations.v1 import CLAIM_INDEX_COLUMNS, CLAIM_INDEX_PREDICATE
from sqla_jobs.schema import names

# Version 2: the pending index and the running index, instead of the claim index.
PENDING_INDEX_COLUMNS = ("queue", "priority", "run_at", "id")
PENDING_INDEX_PREDICATE = "status = 'pending'"
RUNNING_INDEX_COLUMNS = ("queue", "lease_expires_at")
RUNNING_INDEX_PREDICATE = "status = 'running'"


def _v2_indexes(table_name: str) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    n = names(table_name)
    return (
        (n.pending_index, PENDING_INDEX_COLUMNS, PENDING_INDEX_PREDICATE),
        (n.running_index, RUNNING_INDEX_COLUMNS, RUNNING_INDEX_PREDICATE),
    )


def upgrade_job_table_to_v2(table_name: str, *, schema: str | None = None) -> None:
    """Upgrade a version-1 job table to version 2 in place, without blocking its users.

    Builds the pending index and the running index with ``CREATE INDEX CONCURRENTLY``, then
    drops the version-1 claim index with ``DROP INDEX CONCURRENTLY``: enqueues, claims and
    outcomes go on meanwhile. Neither can run in a transaction, so all of it runs in
    Alembic's ``autocommit_block()``, which first commits whatever the revision did before.
    The columns, constraints, trigger and storage parameters are the same in both versions.

    Each build waits for the transactions already running when it starts (a lock-held
    worker's long handler transaction included), and reads the whole table. It can be run
    again after a failure: an index that an interrupted build left invalid is dropped and
    built again. Until the revision has run, a claim of the new code works on the old index
    (and an old worker's claim on the new ones), only more slowly: deploy both together.

    A revision of yours for tables your earlier revisions created with
    :func:`create_job_table` (``revision`` identifiers left out)::

        from sqla_jobs import migrations as jobs

        def upgrade() -> None:
            jobs.upgrade_job_table_to_v2("email_jobs")

        def downgrade() -> None:
            jobs.downgrade_job_table_to_v1("email_jobs")
    """
    with op.get_context().autocommit_block():
        for name, columns, predicate in _v2_indexes(table_name):
            _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)
            _create_index(name, table_name, columns, predicate, schema=schema, concurrently=True)
        _drop_index(
            names(table_name).claim_index,
            table_name,
            schema=schema,
            concurrently=True,
            if_exists=True,
        )


def downgrade_job_table_to_v1(table_name: str, *, schema: str | None = None) -> None:
    """Undo :func:`upgrade_job_table_to_v2`: build the version-1 claim index concurrently,
    then drop the pending and running indexes concurrently (re-runnable in the same way)."""
    n = names(table_name)
    with op.get_context().autocommit_block():
        _drop_index(n.claim_index, table_name, schema=schema, concurrently=True, if_exists=True)
        _create_index(
            n.claim_index,
            table_name,
            CLAIM_INDEX_COLUMNS,
            CLAIM_INDEX_PREDICATE,
            schema=schema,
            concurrently=True,
        )
        for name, _, _ in _v2_indexes(table_name):
            _drop_index(name, table_name, schema=schema, concurrently=True, if_exists=True)
