"""Moved to :mod:`sqla_jobs.schema.history`: the table definitions sit below the
statements that use them (docs/contributing.md). This module re-exports its names
for code that imported them from here."""

from sqla_jobs.schema.history import (
    PARTITION_KEY,
    RESULT_COLUMN,
    HistoryNames,
    attach_partition,
    create_default_partition,
    create_detached_partition,
    create_partition,
    day_bounds,
    drop_partition,
    has_history,
    history_names,
    history_table,
    is_history_partition,
    partition_day,
)

__all__ = [
    "PARTITION_KEY",
    "RESULT_COLUMN",
    "HistoryNames",
    "attach_partition",
    "create_default_partition",
    "create_detached_partition",
    "create_partition",
    "day_bounds",
    "drop_partition",
    "has_history",
    "history_names",
    "history_table",
    "is_history_partition",
    "partition_day",
]
