"""The test harness itself: the installed wheel is tested, databases are fresh."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import EXPECT_INSTALLED_VARIABLE, SOURCE_PACKAGE_DIR, FreshDatabase
from sqlalchemy.ext.asyncio import AsyncEngine

import sqla_jobs


@pytest.mark.skipif(
    os.environ.get(EXPECT_INSTALLED_VARIABLE) != "1",
    reason=f"{EXPECT_INSTALLED_VARIABLE}=1 is set by nox, which tests the installed wheel",
)
def test_installed_wheel_is_tested() -> None:
    package_dir = Path(sqla_jobs.__file__).resolve().parent
    assert package_dir != SOURCE_PACKAGE_DIR
    assert "site-packages" in package_dir.parts
    assert (package_dir / "py.typed").is_file()


def test_database_is_fresh(engine: sa.Engine, database_url: str) -> None:
    with engine.connect() as conn:
        name = conn.execute(sa.text("SELECT current_database()")).scalar_one()
    assert name == sa.make_url(database_url).database
    assert name.startswith("sqla_jobs_test_")


def test_fresh_database_is_another_database(
    fresh_database: FreshDatabase, database_url: str
) -> None:
    url = fresh_database("sqla_jobs_extra")
    assert url != database_url
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        name = conn.execute(sa.text("SELECT current_database()")).scalar_one()
    engine.dispose()
    assert name == sa.make_url(url).database
    assert name.startswith("sqla_jobs_extra_")


async def test_async_engine(async_engine: AsyncEngine, database_url: str) -> None:
    async with async_engine.connect() as conn:
        name = (await conn.execute(sa.text("SELECT current_database()"))).scalar_one()
    assert name == sa.make_url(database_url).database
