"""Run the library's own Alembic environment, and find its revisions for yours."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import URL

__all__ = [
    "SCRIPT_LOCATION",
    "VERSION_LOCATION",
    "VERSION_TABLE",
    "downgrade",
    "upgrade",
    "versions_path",
]

SCRIPT_LOCATION = "sqla_jobs:migrations"
"""``script_location`` of the library's standalone environment (this package's directory)."""

VERSION_LOCATION = "sqla_jobs.migrations:versions"
"""The revisions of the default tables, as an entry of your ``version_locations``."""

VERSION_TABLE = "sqla_jobs_alembic_version"
"""Where the standalone environment records its revision: never your ``alembic_version``."""

_PACKAGE_DIR = Path(__file__).resolve().parent


def versions_path() -> Path:
    """The directory of the revisions that create the default tables (:mod:`sqla_jobs.models`).

    For a programmatic :class:`alembic.config.Config` of your own; in ``alembic.ini`` or
    ``pyproject.toml`` write :data:`VERSION_LOCATION` instead.
    """
    return _PACKAGE_DIR / "versions"


def _config(url: str | URL) -> Config:
    config = Config(attributes={"url": url})
    config.set_main_option("script_location", str(_PACKAGE_DIR))
    return config


def upgrade(url: str | URL, revision: str = "heads") -> None:
    """Create or upgrade the default tables (``sqla_jobs``, ``sqla_jobs_results``) at ``url``.

    Runs the library's standalone Alembic environment, which records its revision in its own
    table (:data:`VERSION_TABLE`). For a database with an Alembic environment of your own,
    add :data:`VERSION_LOCATION` to its ``version_locations`` instead, so that one
    ``alembic upgrade heads`` does everything. Commits; does not configure logging.
    """
    command.upgrade(_config(url), revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Downgrade the standalone environment at ``url`` (``"base"`` drops the default tables)."""
    command.downgrade(_config(url), revision)
