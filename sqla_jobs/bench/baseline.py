"""The ``baseline`` section: this version against another, in the same run.

``sqla-jobs bench --only baseline --baseline PATH`` (PATH: a checkout of the commit to
compare with, the directory that holds its ``sqla_jobs`` package). The same probe
(:mod:`sqla_jobs.bench.probe`) runs in a subprocess once per version per round, the two
alternating which goes first, on the run's server: a bulk ``enqueue_many``, an ORM
``add_all``, and a plain claim loop (``claim`` + ``complete_many``, batches of
``--batch``), each version on a table made by its own ``create_all``. Each figure is
reported as this version's rate over the baseline's: a feature that costs nothing when
unused leaves the ratio at 1.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Final

import sqla_jobs
from sqla_jobs.bench import scratch
from sqla_jobs.bench.results import Config, Results

__all__ = ["OPERATIONS", "check_baseline", "run_baseline"]

OPERATIONS: Final = ("claim", "enqueue_many", "add_all")
_ROUNDS: Final = itertools.count()
#: Not imported here: run as a script under each version (its model is that version's).
_PROBE: Final = Path(__file__).with_name("probe.py")
#: Runs the probe file with an empty sys.path[0], so nothing beside it shadows a module.
_RUN_PROBE: Final = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def check_baseline(path: str) -> Path:
    """The checkout at ``path``; ValueError unless it holds a ``sqla_jobs`` package."""
    root = Path(path).expanduser().resolve()
    if not (root / "sqla_jobs" / "__init__.py").is_file():
        raise ValueError(f"--baseline {path}: no sqla_jobs package there (sqla_jobs/__init__.py)")
    return root


def _current() -> Path:
    return Path(sqla_jobs.__file__).resolve().parent.parent


def _probe(root: Path, cfg: Config) -> dict[str, float]:
    env = os.environ | {"PYTHONPATH": str(root)}
    argv = [sys.executable, "-c", _RUN_PROBE, str(_PROBE), cfg.url, str(cfg.jobs), str(cfg.batch)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed under {root}:\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    imported = Path(report["module"]).resolve()
    if not imported.is_relative_to(root):
        raise RuntimeError(f"the probe for {root} imported sqla_jobs from {imported}")
    return {name: float(value) for name, value in report["rates"].items()}


def run_baseline(cfg: Config, results: Results) -> None:
    if cfg.baseline is None:
        results.skipped["baseline"] = "give --baseline PATH (a checkout to compare with)"
        scratch.progress(f"baseline: skipped, {results.skipped['baseline']}")
        return
    sides = [("before", cfg.baseline), ("current", _current())]
    if next(_ROUNDS) % 2:
        sides.reverse()
    measured = {side: _probe(root, cfg) for side, root in sides}
    for operation in OPERATIONS:
        before = f"baseline.{operation}.before"
        results.add(before, measured["before"][operation], "jobs/s")
        results.add(f"baseline.{operation}", measured["current"][operation], "jobs/s", before)
        for cpu in ("client_us", "server_us"):
            name = f"{operation}.{cpu}"
            if name in measured["before"] and name in measured["current"]:
                results.add(f"baseline.{name}.before", measured["before"][name], "us/job")
                current = results.add(
                    f"baseline.{name}",
                    measured["current"][name],
                    "us/job",
                    f"baseline.{name}.before",
                )
                current.higher_is_better = False
    scratch.progress("baseline")
