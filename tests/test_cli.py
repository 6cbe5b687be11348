"""The ``sqla-jobs`` command: admin commands, one-line errors, and the demo."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from sqlalchemy.pool import NullPool
from worker_harness import subprocess_env

from sqla_jobs import cli
from sqla_jobs.embedded import EmbeddedPostgres


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m sqla_jobs ARGS`` in a subprocess (the installed package)."""
    return subprocess.run(
        [sys.executable, "-m", "sqla_jobs", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def jobs_url(fresh_database: FreshDatabase) -> str:
    """A database with the default tables, created by the library's migrations."""
    from sqla_jobs.migrations import upgrade

    url = fresh_database("sqla_jobs_cli")
    upgrade(url)
    return url


@pytest.fixture
def jobs_engine(jobs_url: str) -> Iterator[sa.Engine]:
    from sqla_jobs.models import Job

    engine = sa.create_engine(jobs_url, poolclass=NullPool)
    with engine.begin() as connection:
        connection.execute(sa.delete(Job))
    try:
        yield engine
    finally:
        engine.dispose()


def main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_python_dash_m_help(tmp_path: Path) -> None:
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    for command in ("worker", "status", "retry", "cancel", "prune", "demo"):
        assert command in result.stdout


@pytest.mark.usefixtures("restore_root_logging")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status"], "no database URL: pass --database-url or set SQLA_JOBS_DATABASE_URL"),
        (["status", "--database-url", "mysql://x@y/z"], "needs PostgreSQL, not 'mysql'"),
        (["status", "--database-url", "not a url"], "is not a database URL"),
        # A password is never printed (issue 29, finding 9).
        (
            ["status", "--database-url", "postgresql+asyncpg://u:s3cret@h/db"],
            "not 'postgresql+asyncpg://u:***@h/db'",
        ),
        (
            ["status", "--database-url", "postgresql+psycopg2://u:s3cret@h/db"],
            "not 'postgresql+psycopg2://u:***@h/db'",
        ),
        (
            ["status", "--database-url", "postgresql://u:s3cret@h:abc/db"],
            "'postgresql://u:***@h:abc/db' is not a database URL",
        ),
        (
            ["status", "--database-url", "postgresql://nobody@127.0.0.1:1/x"],
            "cannot reach the database",
        ),
        (
            ["worker", "no_such_module_xyz:registry", "--database-url", "postgresql://x@y/z"],
            "cannot import 'no_such_module_xyz'",
        ),
        (["worker", "os:path", "--database-url", "postgresql://x@y/z"], "not a sqla_jobs Registry"),
        (["worker", "os", "--database-url", "postgresql://x@y/z"], "must look like module:name"),
        (
            # --processes reaches the worker's settings, which refuse it past --concurrency.
            [
                *("worker", "process_tasks:registry", "--concurrency", "2", "--processes", "3"),
                *("--database-url", "postgresql://x@y/z"),
            ],
            "processes must be an integer in [1, concurrency=2]",
        ),
        (["status", "--model", "os:getcwd", "--database-url", "postgresql://x@y/z"], "JobMixin"),
    ],
)
def test_mistakes_are_one_line_errors(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    message: str,
) -> None:
    monkeypatch.delenv(cli.DATABASE_URL_VARIABLE, raising=False)
    status, out, err = main(capsys, *args)
    assert status == 1
    assert out == ""
    assert err.startswith("sqla-jobs: error: ")
    assert message in err
    assert err.count("\n") == 1
    assert "Traceback" not in err
    assert "s3cret" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "m:r", "--concurrency", "0"],
        ["worker", "m:r", "--prefetch", "-1"],
        ["worker", "m:r", "--processes", "0"],
        ["worker", "m:r", "--no-listen", "--listen-url", "postgresql://x@y/z"],
        ["status", "--pooler", "session"],
        ["prune", "--older-than", "soon"],
        ["retry", "abc"],
        ["frobnicate"],
        # Past what the options take (issue 29, finding 9): one line, not a traceback.
        ["prune", "--older-than", "99999999999999d"],
        ["status", "--timeout", "99999999999999999999d"],
        ["worker", "m:r", "--grace", "99999999999999999999w"],
        ["status", "--dead", "99999999999999999999"],
        ["retry", "99999999999999999999"],
    ],
)
def test_bad_command_lines_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    # In this process (argparse exits with status 2): the entry point itself is proven by
    # the subprocess tests around this one, which cost a second of CPU each.
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    captured = capsys.readouterr()
    assert exited.value.code == 2
    assert captured.err.count("\n") == 1, captured.err
    assert "error:" in captured.err


def test_a_bad_command_line_exits_2_with_one_line_from_the_entry_point(tmp_path: Path) -> None:
    result = run_cli("frobnicate", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "error:" in result.stderr


@pytest.mark.usefixtures("restore_root_logging")
def test_status_retry_cancel(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    jobs_url: str,
    jobs_engine: sa.Engine,
) -> None:
    from sqla_jobs.models import Job

    monkeypatch.setenv(cli.DATABASE_URL_VARIABLE, jobs_url)
    with jobs_engine.begin() as connection:
        pending = connection.execute(
            sa.insert(Job)
            .values(task="t", queue="mail", run_at=sa.func.now() - sa.text("interval '90 s'"))
            .returning(Job.id)
        ).scalar_one()
        dead = connection.execute(
            sa.insert(Job)
            .values(
                task="charge",
                queue="billing",
                status="dead",
                attempts=3,
                max_attempts=3,
                finished_at=sa.func.now(),
                last_error="Traceback (most recent call last):\n  ...\nValueError: card declined",
            )
            .returning(Job.id)
        ).scalar_one()

    status, out, _ = main(capsys, "status")
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "sqla_jobs"
    assert lines[1].split() == [
        "queue",
        "pending",
        "runnable",
        "running",
        "expired",
        "dead",
        "oldest",
        "runnable",
        "paused",
        "for",
    ]
    assert lines[2].split() == ["billing", "0", "0", "0", "0", "1", "-"]
    mail = lines[3].split()
    assert mail[:6] == ["mail", "1", "1", "0", "0", "0"]
    assert mail[6].endswith("s")
    assert float(mail[6][:-1]) >= 90
    assert "oldest snapshot holding back vacuum:" in out
    assert f"  {dead}  billing/charge  attempts=3" in out
    assert "ValueError: card declined" in out

    assert main(capsys, "retry", str(dead))[:2] == (0, f"job {dead} is pending again\n")
    assert main(capsys, "cancel", str(pending))[:2] == (0, f"job {pending} is cancelled\n")
    with jobs_engine.connect() as connection:
        statuses = {row.id: row.status for row in connection.execute(sa.select(Job.id, Job.status))}
    assert statuses == {dead: "pending", pending: "cancelled"}

    # Idempotent: cancelling a cancelled job again says so and changes nothing.
    assert main(capsys, "cancel", str(pending))[:2] == (0, f"job {pending} is cancelled\n")
    status, _, err = main(capsys, "retry", str(pending))
    assert status == 0
    # A running job: its worker is asked to cancel it (tests/test_cancel.py for the rest).
    with jobs_engine.begin() as connection:
        connection.execute(
            sa.update(Job)
            .where(Job.id == dead)
            .values(status="running", attempts=4, lease_expires_at=sa.func.now())
        )
    assert main(capsys, "cancel", str(dead))[:2] == (
        0,
        f"job {dead} is running: its worker was asked to cancel it\n",
    )
    status, _, err = main(capsys, "retry", "999999")
    assert (status, err) == (1, "sqla-jobs: error: Job has no job 999999\n")


@pytest.mark.usefixtures("restore_root_logging")
def test_prune_in_batches_with_progress(
    capsys: pytest.CaptureFixture[str], jobs_url: str, jobs_engine: sa.Engine
) -> None:
    from sqla_jobs.models import Job

    with jobs_engine.begin() as connection:
        connection.execute(
            sa.insert(Job).from_select(
                ["task", "status", "finished_at"],
                sa.select(
                    sa.literal("t"),
                    sa.literal("succeeded"),
                    sa.func.now() - sa.text("interval '2 days'"),
                ).select_from(sa.func.generate_series(1, 25)),
            )
        )
        connection.execute(
            sa.insert(Job).values(task="t", status="succeeded", finished_at=sa.func.now())
        )
        connection.execute(sa.insert(Job).values(task="t"))
    status, out, err = main(
        capsys, "prune", "--older-than", "1d", "--batch-size", "10", "--database-url", jobs_url
    )
    assert status == 0
    assert out == "pruned 25 finished jobs older than 24.0h\n"
    progress = [line.split(" (")[0] for line in err.splitlines()]
    assert progress == ["pruned 10 jobs", "pruned 20 jobs", "pruned 25 jobs"]
    with jobs_engine.connect() as connection:
        assert connection.execute(sa.select(sa.func.count()).select_from(Job)).scalar() == 2


def test_parse_duration() -> None:
    assert cli.parse_duration("90").total_seconds() == 90
    assert cli.parse_duration("15m").total_seconds() == 900
    assert cli.parse_duration("1.5h").total_seconds() == 5400
    assert cli.parse_duration("7d").days == 7


@pytest.mark.slow
def test_demo_on_a_database_url(fresh_database: FreshDatabase, tmp_path: Path) -> None:
    url = fresh_database("sqla_jobs_demo")
    result = run_cli(
        "demo", "--jobs", "300", "--workers", "2", "--database-url", url, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "throughput: " in result.stdout
    assert "verification passed" in result.stdout
    assert "FAILED" not in result.stdout
    assert "rolled back 1 transactions (50 orders and their jobs)" in result.stdout


@pytest.mark.slow
@pytest.mark.embedded_only
def test_demo_with_no_configuration(embedded_server: EmbeddedPostgres, tmp_path: Path) -> None:
    # The README's first command: no URL anywhere, a throwaway server of its own.
    env = subprocess_env("")
    env.pop("SQLA_JOBS_DATABASE_URL")
    result = run_cli("demo", "--jobs", "200", env=env, cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "started a throwaway PostgreSQL" in result.stdout
    assert "verification passed" in result.stdout
    assert "stopped and deleted the throwaway PostgreSQL" in result.stdout


def test_bench_is_a_command_with_its_own_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: sqla-jobs bench" in out
    assert "--history-rows" in out
    # Options the benchmark does not own are still refused for the other commands.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["status", "--no-such-option"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
