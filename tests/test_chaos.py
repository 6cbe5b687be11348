"""The fault harness (tests/chaos.py), short form: about 35 s of faults, every check asserted.

Worker processes are SIGKILLed and replaced every few seconds, the server is restarted once
(on the embedded server the harness starts for itself; against an external server named by
``SQLA_JOBS_TEST_DATABASE_URL`` that fault is skipped and the report says so) and a worker
is SIGSTOPped past its leases. The harness runs once for the module; each check is a test of
its own, failing with the whole report. ``python3 -m nox -s chaos`` runs the long form.
"""

from __future__ import annotations

import pytest
from chaos import CHECKS, ChaosConfig, ChaosReport, run_chaos
from conftest import external_database_url

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chaos_report(tmp_path_factory: pytest.TempPathFactory) -> ChaosReport:
    url = external_database_url()
    config = ChaosConfig(
        duration=35.0,
        workers=3,
        concurrency=4,
        jobs=300,
        database_url=None if url is None else url.render_as_string(hide_password=False),
        drain_timeout=90.0,
        log_dir=tmp_path_factory.mktemp("chaos"),
    )
    return run_chaos(config)


@pytest.mark.parametrize("name", CHECKS)
def test_chaos_check(chaos_report: ChaosReport, name: str) -> None:
    check = chaos_report.check(name)
    assert check.ok, f"chaos check {name} failed: {check.summary}\n\n{chaos_report.render()}"
