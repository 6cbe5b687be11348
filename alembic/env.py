"""The application's Alembic environment: its own models plus sqla_jobs' default tables."""

from __future__ import annotations

import os
from logging.config import fileConfig

import models  # the application's models: tests/models.py, on sys.path via prepend_sys_path
from alembic import context
from sqlalchemy import create_engine, pool

import sqla_jobs.models
from sqla_jobs.migrations import include_name

config = context.config

# A program that runs Alembic in-process (the tests) keeps its own logging.
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

# Both sets of tables, so that autogenerate compares them all.
target_metadata = [models.Base.metadata, sqla_jobs.models.metadata]

url = context.get_x_argument(as_dictionary=True).get("url") or os.environ.get("DATABASE_URL")
if not url:
    raise RuntimeError("no database URL: pass -x url=... or set DATABASE_URL")

if context.is_offline_mode():
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            # include_name: history partitions are made by the maintenance, not declared.
            context.configure(
                connection=connection, target_metadata=target_metadata, include_name=include_name
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()
