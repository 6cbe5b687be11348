"""The failover drill's short form (tests/failover.py): pg_auto_failover on this machine, the
primary SIGKILLed under load, its synchronous standby promoted; nothing lost, lock-held
effects exactly once, lease-mode duplicates only of jobs in flight, no job stuck.

A slow proof: the ``tests`` session runs it, the others leave it out (noxfile.SLOW_PROOFS);
``nox -s failover`` runs the long form. pg_auto_failover is installed with apt-get when it
is missing and the tests run as root; the test is skipped, saying why, where it cannot be.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from failover import DrillConfig, run_drill
from ha_cluster import FAST_KEEPER, FAST_MONITOR, pg_autoctl_missing

PAGE = Path(__file__).resolve().parents[1] / "docs" / "operations" / "failover.md"


def test_the_failover_page_quotes_the_drills_settings() -> None:
    text = PAGE.read_text()
    quoted = dict(re.findall(r"ALTER SYSTEM SET (\S+) = (\d+);", text))
    assert quoted == {name: str(value) for name, value in FAST_MONITOR.items()}
    for name, value in FAST_KEEPER.items():
        assert f"pg_autoctl config set {name} {value}`" in text


@pytest.mark.slow
def test_a_primary_killed_under_load_loses_no_job(tmp_path: Path) -> None:
    missing = pg_autoctl_missing()
    if missing is not None:
        pytest.skip(missing)
    lines: list[str] = []
    report = run_drill(
        DrillConfig(before=4.0, after=3.0, producers=2, rate=40.0, seed=1, directory=tmp_path),
        progress=lines.append,
    )
    shown = "\n".join([*lines, *report.lines(), f"logs: {report.log_dir}"])
    assert report.ok, shown
    assert [check.name for check in report.checks] == [
        "no_commit_lost",
        "no_order_twice",
        "every_job_ran",
        "lock_exactly_once",
        "lease_at_least_once",
        "workers_survived",
    ], shown
    (failover,) = report.failovers
    assert failover.first_completion_after is not None, shown
    assert failover.first_completion_after >= failover.writable_after - 1.0, shown
    assert report.jobs == report.orders_committed > 0, shown
