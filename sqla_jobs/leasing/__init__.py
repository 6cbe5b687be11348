"""Leasing any row: seats, IP addresses, licences, ... of a model of your own.

SKIP LOCKED hands out any scarce item to concurrent consumers without collisions, not only
jobs. Mix :class:`LeaseMixin` into a model; :func:`acquire_leases` then leases up to N free
rows matching a filter to a holder for a duration (an expired lease is taken over by the
same statement), :func:`renew_leases` and :func:`release_leases` act on them, fenced by the
row's ``lease_fence`` as a job's transitions are by its attempt, and ``hold=True`` keeps
the rows locked for the caller's transaction.

* :mod:`~sqla_jobs.schema.leases`: the mixin and the lease index's name.
* :mod:`~sqla_jobs._queries.leases`: the SQL.
* :mod:`~sqla_jobs.leasing.leases`: the operations, and the :class:`Lease` record.

Everything here is also exported by :mod:`sqla_jobs` itself; the migration helpers are
``sqla_jobs.migrations.add_lease_columns`` and friends.
"""

from __future__ import annotations

from sqla_jobs.leasing.leases import (
    MAX_ACQUIRE_LIMIT,
    Lease,
    acquire_leases,
    release_lease,
    release_leases,
    renew_lease,
    renew_leases,
)
from sqla_jobs.schema.leases import LeaseMixin, LeaseNames, lease_names

__all__ = [
    "MAX_ACQUIRE_LIMIT",
    "Lease",
    "LeaseMixin",
    "LeaseNames",
    "acquire_leases",
    "lease_names",
    "release_lease",
    "release_leases",
    "renew_lease",
    "renew_leases",
]
