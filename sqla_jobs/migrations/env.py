"""The library's standalone Alembic environment (``script_location = sqla_jobs:migrations``).

It creates the default tables of :mod:`sqla_jobs.models` in a database that has no Alembic
environment of its own, e.g. the demo's throwaway server; :func:`sqla_jobs.migrations.upgrade`
runs it. The URL comes from ``Config.attributes["url"]``, ``-x url=...``, the environment
variable ``SQLA_JOBS_DATABASE_URL`` or ``sqlalchemy.url``, in that order. Alembic runs this
file; importing it does nothing useful. It never configures logging.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

from sqla_jobs.migrations.commands import VERSION_TABLE
from sqla_jobs.models import Base

config = context.config
url = (
    config.attributes.get("url")
    or context.get_x_argument(as_dictionary=True).get("url")
    or os.environ.get("SQLA_JOBS_DATABASE_URL")
    or config.get_main_option("sqlalchemy.url")
)
if not url:
    raise RuntimeError(
        "no database URL: pass -x url=..., set SQLA_JOBS_DATABASE_URL or sqlalchemy.url"
    )

if context.is_offline_mode():
    context.configure(
        url=url,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=Base.metadata,
                version_table=VERSION_TABLE,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()
