"""Private since 0.1.0: the statements are in :mod:`sqla_jobs._queries.leases`
(the query layer)."""

from sqla_jobs._moved import private_since

__getattr__ = private_since("sqla_jobs.leasing.statements", "sqla_jobs._queries.leases")
