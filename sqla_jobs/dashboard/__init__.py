"""A web dashboard for a job table: ``sqla-jobs dashboard``, or :func:`create_app` mounted
in an ASGI application of your own; :func:`create_multi_app` for the jobs of several
databases (the same tables in each) in one dashboard.

Needs the ``dashboard`` extra (Starlette, Jinja2, uvicorn): ``pip install
'sqla-jobs[dashboard]'``. Nothing in the rest of sqla_jobs imports this package.
"""

from sqla_jobs.dashboard.app import create_app, create_multi_app, database_name

__all__ = ["create_app", "create_multi_app", "database_name"]
