"""Alembic migrations for job tables: helpers for your revisions, and the library's own.

Importing ``sqla_jobs`` does not import this package (nor Alembic); import it from your
revisions and your ``env.py``.

**Your own job tables.** Your Alembic environment creates the tables of your
:class:`~sqla_jobs.schema.JobMixin` models by calling these helpers from your own revision,
which renders them exactly as the mixins declare them (columns, defaults, constraints, the
partial claim index, the NOTIFY trigger and the storage parameters)::

    \"\"\"email jobs\"\"\"

    import sqlalchemy as sa

    from sqla_jobs import migrations as jobs

    revision = "3f1c0a9e2b7d"
    down_revision = "0001_orders"


    def upgrade() -> None:
        jobs.create_job_table(
            "email_jobs",
            sa.Column("order_id", sa.Integer, sa.ForeignKey("orders.id")),
            version=4,
        )
        jobs.create_result_table("email_job_results")


    def downgrade() -> None:
        jobs.drop_result_table("email_job_results")
        jobs.drop_job_table("email_jobs")

``version=4`` is the schema version to build: the one the mixins declare today. A table an
earlier revision built without it is version 1; a new revision upgrades it in place, with
indexes built concurrently on the live table::

    def upgrade() -> None:
        jobs.upgrade_job_table_to_v2("email_jobs")


    def downgrade() -> None:
        jobs.downgrade_job_table_to_v1("email_jobs")

A version-2 table becomes version 3 with each feature's in-place helper (the trace context:
:func:`add_trace_context` / :func:`drop_trace_context`), and a version-3 table version 4
with :func:`upgrade_job_table_to_v4` (job control: :func:`add_job_control`).

**Lease columns** (:class:`~sqla_jobs.LeaseMixin`) on a table of yours that already exists:
:func:`add_lease_columns` / :func:`drop_lease_columns` from your revision. For a new table,
autogenerate writes them itself (the lease index is a plain one, which it compares).

Alembic's autogenerate does not compare an index's ``WHERE`` predicate, and does not see
triggers (a job table it creates has no wake-up trigger): :func:`check_job_tables` checks
both, for a test or CI.

**The default tables** of :mod:`sqla_jobs.models` come with revisions of their own (branch
label ``sqla_jobs``) in this package. Add them to your environment's ``version_locations``
and add ``sqla_jobs.models.metadata`` to your ``target_metadata`` list; Alembic resolves
``package:directory`` entries with :mod:`importlib.resources`. In ``alembic.ini``, with a
separator that cannot occur in a path::

    [alembic]
    script_location = %(here)s
    path_separator = newline
    version_locations =
        %(here)s/versions
        sqla_jobs.migrations:versions

or in ``pyproject.toml``: ``[tool.alembic] version_locations = ["%(here)s/alembic/versions",
"sqla_jobs.migrations:versions"]``. Then ``alembic upgrade heads`` applies both branches
(``alembic upgrade sqla_jobs@head`` only the library's). With two branches, create a
revision of your own with ``alembic revision --head <your head> ...``.

A database without an Alembic environment (the demo's throwaway server) gets the default
tables from :func:`upgrade`, which runs the library's standalone environment
(``script_location = sqla_jobs:migrations``).
"""

from __future__ import annotations

from sqla_jobs.migrations.check import check_claim_indexes, check_job_tables, include_name
from sqla_jobs.migrations.commands import (
    SCRIPT_LOCATION,
    VERSION_LOCATION,
    VERSION_TABLE,
    downgrade,
    upgrade,
    versions_path,
)
from sqla_jobs.migrations.history_table import add_history, drop_history
from sqla_jobs.migrations.leases import (
    LEASE_SCHEMA_VERSION,
    add_lease_columns,
    create_lease_index,
    drop_lease_columns,
    drop_lease_index,
)
from sqla_jobs.migrations.pauses import create_pause_table, drop_pause_table
from sqla_jobs.migrations.rates import (
    create_fair_index,
    create_rate_table,
    drop_fair_index,
    drop_rate_table,
)
from sqla_jobs.migrations.tables import (
    SCHEMA_VERSION,
    create_job_table,
    create_schedule_table,
    drop_job_table,
    drop_schedule_table,
)
from sqla_jobs.migrations.v1 import (
    create_claim_index,
    create_notify_trigger,
    create_result_table,
    drop_claim_index,
    drop_notify_trigger,
    drop_result_table,
)
from sqla_jobs.migrations.v2 import downgrade_job_table_to_v1, upgrade_job_table_to_v2
from sqla_jobs.migrations.v3 import (
    add_cancel,
    add_dead_index,
    add_ordering_keys,
    add_trace_context,
    add_unique_keys,
    create_claim_indexes,
    downgrade_job_table_to_v2,
    drop_cancel,
    drop_claim_indexes,
    drop_dead_index,
    drop_ordering_keys,
    drop_trace_context,
    drop_unique_keys,
    upgrade_job_table_to_v3,
)
from sqla_jobs.migrations.v4 import (
    add_job_control,
    downgrade_job_table_to_v3,
    drop_job_control,
    upgrade_job_table_to_v4,
)
from sqla_jobs.migrations.workflows import (
    add_history_steps,
    add_workflow_steps,
    create_workflow_table,
    drop_history_steps,
    drop_workflow_steps,
    drop_workflow_table,
)

__all__ = [
    "LEASE_SCHEMA_VERSION",
    "SCHEMA_VERSION",
    "SCRIPT_LOCATION",
    "VERSION_LOCATION",
    "VERSION_TABLE",
    "add_cancel",
    "add_dead_index",
    "add_history",
    "add_history_steps",
    "add_job_control",
    "add_lease_columns",
    "add_ordering_keys",
    "add_trace_context",
    "add_unique_keys",
    "add_workflow_steps",
    "check_claim_indexes",
    "check_job_tables",
    "create_claim_index",
    "create_claim_indexes",
    "create_fair_index",
    "create_job_table",
    "create_lease_index",
    "create_notify_trigger",
    "create_pause_table",
    "create_rate_table",
    "create_result_table",
    "create_schedule_table",
    "create_workflow_table",
    "downgrade",
    "downgrade_job_table_to_v1",
    "downgrade_job_table_to_v2",
    "downgrade_job_table_to_v3",
    "drop_cancel",
    "drop_claim_index",
    "drop_claim_indexes",
    "drop_dead_index",
    "drop_fair_index",
    "drop_history",
    "drop_history_steps",
    "drop_job_control",
    "drop_job_table",
    "drop_lease_columns",
    "drop_lease_index",
    "drop_notify_trigger",
    "drop_ordering_keys",
    "drop_pause_table",
    "drop_rate_table",
    "drop_result_table",
    "drop_schedule_table",
    "drop_trace_context",
    "drop_unique_keys",
    "drop_workflow_steps",
    "drop_workflow_table",
    "include_name",
    "upgrade",
    "upgrade_job_table_to_v2",
    "upgrade_job_table_to_v3",
    "upgrade_job_table_to_v4",
    "versions_path",
]
