"""Moved to :mod:`sqla_jobs.schema.leases`: the table definitions sit below the
statements that use them (docs/contributing.md). This module re-exports its names
for code that imported them from here."""

from sqla_jobs.schema.leases import (
    LEASE_COLUMNS,
    LeaseMixin,
    LeaseNames,
    lease_index_elements,
    lease_names,
)

__all__ = [
    "LEASE_COLUMNS",
    "LeaseMixin",
    "LeaseNames",
    "lease_index_elements",
    "lease_names",
]
