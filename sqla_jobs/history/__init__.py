"""Finished jobs out of the hot table: a history table partitioned by day.

A job model with ``partitioned_history = True`` keeps only the jobs still to run in its
table; each job that finishes moves, in the statement that finishes it, into the model's
history table (:func:`history_table`), partitioned by ``finished_at``, one partition per
UTC day. Retention drops whole partitions. :mod:`sqla_jobs.schema.history` derives the
table, :mod:`sqla_jobs._queries.history` holds its SQL and
:mod:`sqla_jobs.history.maintenance` its upkeep (see each module's docstring).
"""

from sqla_jobs.history.maintenance import (
    DEFAULT_DAYS_AHEAD,
    DEFAULT_LOCK_TIMEOUT,
    JobRecord,
    MaintenanceReport,
    Partition,
    create_partitions,
    drop_partitions,
    job_record,
    list_partitions,
    maintain,
    move_finished,
)
from sqla_jobs.schema.history import (
    has_history,
    history_names,
    history_table,
    is_history_partition,
)

__all__ = [
    "DEFAULT_DAYS_AHEAD",
    "DEFAULT_LOCK_TIMEOUT",
    "JobRecord",
    "MaintenanceReport",
    "Partition",
    "create_partitions",
    "drop_partitions",
    "has_history",
    "history_names",
    "history_table",
    "is_history_partition",
    "job_record",
    "list_partitions",
    "maintain",
    "move_finished",
]
