"""The versions the README claims are the ones declared and the ones this run is on.

The README's "Tested versions" table has a column for the lowest versions, which must be the
floors the installed wheel declares (``Requires-Python`` and ``Requires-Dist``), and one for
the newest. The ``tests_lowest`` nox session sets ``SQLA_JOBS_EXPECT_LOWEST=1``: then the
run itself must be on those floors. Whatever the session, the Python and the PostgreSQL server
of the run must be ones the README names in that session's column; off CI, a run on another
one is skipped, not failed. The Pythons of the table's row (``| Python | 3.10 | 3.11, 3.12 and
3.13 |``: the lowest in its column, the others in the newest) are the wheel's classifiers,
each in one column: noxfile.py runs the suite once on each classified Python.

And the ``asyncio`` extra: ``import sqla_jobs.aio`` without greenlet names it; and the
``asyncpg`` extra.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import REPO_ROOT
from packaging.requirements import Requirement
from packaging.version import Version

from sqla_jobs.embedded import EmbeddedPostgres

DISTRIBUTION = "sqla-jobs"
EXPECT_LOWEST = os.environ.get("SQLA_JOBS_EXPECT_LOWEST") == "1"
# A run on a version the README does not name fails on CI, and is skipped elsewhere.
STRICT = os.environ.get("CI") == "true"
_TABLE_HEADING = "**Tested versions.**"
_ROW = re.compile(r"\|\s*(?P<name>[^|]*?)\s*\|\s*(?P<lowest>[^|]*?)\s*\|\s*(?P<newest>[^|]*?)\s*\|")


def readme_table() -> dict[str, tuple[str, str]]:
    """The README's table: ``{"SQLAlchemy": ("2.0.30", "the newest release ..."), ...}``."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert _TABLE_HEADING in text, f"README.md has no {_TABLE_HEADING} table"
    lines = text.split(_TABLE_HEADING, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows: dict[str, tuple[str, str]] = {}
    for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start:]):
        match = _ROW.fullmatch(line)
        # Not the header row (no name) nor the separator row (---).
        if match and match["name"] and not match["name"].startswith("-"):
            rows[match["name"]] = (match["lowest"], match["newest"])
    return rows


def declared_floors() -> dict[str, Version]:
    """The installed wheel's ``>=`` floor of each dependency: ``{"sqlalchemy": 2.0.30, ...}``."""
    floors = {}
    for line in metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(line)
        if requirement.marker is not None:  # an extra's
            continue
        (floor,) = (spec.version for spec in requirement.specifier if spec.operator == ">=")
        floors[requirement.name.lower()] = Version(floor)
    return floors


def declared_extra_floor(extra: str, name: str) -> Version:
    """The ``>=`` floor of ``name`` in the installed wheel's extra ``extra``."""
    for line in metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if requirement.name.lower() == name and marker and marker.evaluate({"extra": extra}):
            (floor,) = (spec.version for spec in requirement.specifier if spec.operator == ">=")
            return Version(floor)
    raise AssertionError(f"the extra {extra!r} has no floor for {name}")


def declared_python() -> str:
    """``3.10`` for ``Requires-Python: >=3.10``."""
    requires_python = metadata.metadata(DISTRIBUTION)["Requires-Python"]
    match = re.fullmatch(r">=\s*(3\.\d+)", requires_python)
    assert match is not None, requires_python
    return match.group(1)


def versions_in(cell: str) -> list[str]:
    """The versions a cell names: ``["3.11", "3.12", "3.13"]`` for ``3.11, 3.12 and 3.13``."""
    return re.findall(r"(?<![\d.])\d+(?:\.\d+)*(?![\d.])", cell)


def classified_pythons() -> list[str]:
    """The installed wheel's ``Programming Language :: Python :: 3.X`` classifiers' Pythons."""
    classifiers = metadata.metadata(DISTRIBUTION).get_all("Classifier") or []
    pattern = re.compile(r"Programming Language :: Python :: (3\.\d+)")
    return [match[1] for line in classifiers if (match := pattern.fullmatch(line))]


def claimed(what: str, value: str, cell: str) -> None:
    """Check that ``value`` is a version ``cell`` of the README names."""
    if value in versions_in(cell):
        return
    message = f"this run is on {what} {value}, which the README's table does not name ({cell!r})"
    if STRICT:
        pytest.fail(message)
    pytest.skip(message)


def test_the_lowest_column_is_the_declared_floors() -> None:
    rows = readme_table()
    by_name = {name.lower(): lowest for name, (lowest, _) in rows.items()}
    floors = declared_floors()
    assert set(floors) == {"sqlalchemy", "psycopg", "alembic", "cronsim"}
    for name, floor in floors.items():
        assert name in by_name, f"the README's table has no row for {name}"
        assert Version(by_name[name]) == floor, f"{name}: README {by_name[name]}, declared {floor}"
    assert rows["Python"][0] == declared_python()
    assert "PostgreSQL" in rows
    # The asyncpg extra's floor, which the lowest sessions pin too.
    (asyncpg_lowest,) = (lowest for name, lowest in by_name.items() if name.startswith("asyncpg"))
    assert Version(asyncpg_lowest) == declared_extra_floor("asyncpg", "asyncpg")


def test_the_python_row_is_the_classifiers() -> None:
    lowest, newest = readme_table()["Python"]
    assert versions_in(lowest) == [declared_python()]
    assert versions_in(newest), f"the README's newest Python cell names no version: {newest!r}"
    # Each Python in one column: the lowest runs on the floors, the others on the newest.
    assert declared_python() not in versions_in(newest)
    named = [*versions_in(lowest), *versions_in(newest)]
    assert sorted(named, key=Version) == sorted(classified_pythons(), key=Version)


def test_this_run_is_on_claimed_versions(engine: sa.Engine) -> None:
    rows = readme_table()
    column = 0 if EXPECT_LOWEST else 1
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    claimed("Python", python, rows["Python"][column])
    with engine.connect() as connection:
        number = int(connection.execute(sa.text("SHOW server_version_num")).scalar_one())
    claimed("PostgreSQL", str(number // 10000), rows["PostgreSQL"][column])


@pytest.mark.skipif(not EXPECT_LOWEST, reason="SQLA_JOBS_EXPECT_LOWEST=1 (nox -s tests_lowest)")
def test_the_lowest_session_runs_on_the_floors(pg_server: EmbeddedPostgres | None) -> None:
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == declared_python()
    for name, floor in declared_floors().items():
        assert Version(metadata.version(name)) == floor, name
    assert Version(metadata.version("asyncpg")) == declared_extra_floor("asyncpg", "asyncpg")
    assert pg_server is not None, "the lowest session runs on the embedded server"


def test_the_asyncio_extra_is_declared() -> None:
    assert "asyncio" in (metadata.metadata(DISTRIBUTION).get_all("Provides-Extra") or [])
    requirements = [Requirement(line) for line in metadata.requires(DISTRIBUTION) or []]
    extra = [
        (r.name.lower(), r.extras)
        for r in requirements
        if r.marker is not None and r.marker.evaluate({"extra": "asyncio"})
    ]
    assert extra == [("sqlalchemy", {"asyncio"})]


def test_the_asyncpg_extra_is_declared() -> None:
    # sqla_jobs.aio on asyncpg: SQLAlchemy's asyncio extension (greenlet) and asyncpg.
    assert "asyncpg" in (metadata.metadata(DISTRIBUTION).get_all("Provides-Extra") or [])
    requirements = [Requirement(line) for line in metadata.requires(DISTRIBUTION) or []]
    extra = {
        r.name.lower(): r.extras
        for r in requirements
        if r.marker is not None and r.marker.evaluate({"extra": "asyncpg"})
    }
    assert extra == {"sqlalchemy": {"asyncio"}, "asyncpg": set()}


def test_aio_without_greenlet_names_the_extra(tmp_path: Path) -> None:
    # A None in sys.modules makes `import greenlet` raise ImportError, as when it is not
    # installed. The cwd keeps the source tree off sys.path: the installed package is tested.
    code = (
        "import sys\n"
        "sys.modules['greenlet'] = None\n"
        "try:\n"
        "    import sqla_jobs.aio\n"
        "except ImportError as exc:\n"
        "    print(exc.name)\n"
        "    print(exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    name, message = result.stdout.splitlines()
    assert name == "greenlet"
    assert 'pip install "sqla-jobs[asyncio]"' in message
