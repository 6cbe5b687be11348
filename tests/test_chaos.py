"""The fault harness (tests/chaos.py), short form: about 35 s of faults, every check asserted.

Worker processes are SIGKILLed and replaced every few seconds, the server is restarted once
(on the embedded server the harness starts for itself; against an external server named by
``SQLA_JOBS_TEST_DATABASE_URL`` that fault is skipped and the report says so) and a worker
is SIGSTOPped past its leases; time-limited and snoozing jobs are in the mix (checks
``timed_*`` and ``snoozed_succeeded``), and a dozen workflows of every shape, four of them
with a failing step (checks ``steps_after_dependencies``, ``workflows_*``, ``workflow_*``
and ``step_lock_effect_exactly_once``). The harness runs once, in one test that asserts every
check (of CHECKS, each by name) and fails naming each failed one, with the whole report: one
test, not one per check, so that pytest-xdist does not run the 35 s harness once per process.
``python3 -m nox -s chaos`` runs the long form.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chaos import CHECKS, ChaosConfig, run_chaos
from conftest import external_database_url

pytestmark = pytest.mark.slow


def test_every_chaos_check_holds(tmp_path: Path) -> None:
    url = external_database_url()
    config = ChaosConfig(
        duration=35.0,
        workers=3,
        concurrency=4,
        jobs=300,
        workflows=12,
        database_url=None if url is None else url.render_as_string(hide_password=False),
        drain_timeout=90.0,
        log_dir=tmp_path,
    )
    report = run_chaos(config)
    assert sorted(check.name for check in report.checks) == sorted(CHECKS)
    failed = [f"{check.name}: {check.summary}" for check in report.checks if not check.ok]
    assert not failed, "chaos checks failed:\n" + "\n".join(failed) + f"\n\n{report.render()}"
