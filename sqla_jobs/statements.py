"""Private since 0.1.0: the statements are in :mod:`sqla_jobs._queries`
(the query layer)."""

from sqla_jobs._moved import private_since

__getattr__ = private_since("sqla_jobs.statements", "sqla_jobs._queries")
