"""What the drills (tests/chaos.py, tests/failover.py, tests/shards.py) and the worker
harness share: a check's result, waiting for a condition, a worker process's environment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DATABASE_URL_VARIABLE",
    "TESTS_DIR",
    "Check",
    "spawn_worker",
    "wait_until",
    "worker_env",
]

TESTS_DIR = Path(__file__).resolve().parent
#: The variable ``sqla-jobs worker`` reads its database URL from (the handlers too).
DATABASE_URL_VARIABLE = "SQLA_JOBS_DATABASE_URL"


@dataclass
class Check:
    """One check of a drill: its name, whether it held, and what it found."""

    name: str
    ok: bool
    summary: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.summary}"


def wait_until(
    predicate: Callable[[], Any], *, timeout: float, message: str, interval: float = 0.05
) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that; fail
    (AssertionError) after ``timeout`` seconds, saying what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {message}")
        time.sleep(interval)


def worker_env(url: str) -> dict[str, str]:
    """The environment of a worker process: ``tests/`` first on ``PYTHONPATH`` (its
    registry's module), the URL, no other ``SQLA_JOBS_*`` variable, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_JOBS_")}
    path = [str(TESTS_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env[DATABASE_URL_VARIABLE] = url
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn_worker(
    directory: Path, label: str, url: str, *worker_args: str, log_level: str | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``sqla-jobs --log-format json worker *worker_args`` (its registry, queues and
    options) as a process of its own with :func:`worker_env`, its output in
    ``directory/<label>.log``; returns the process and that log.

    The log directory is its working directory: ``python -m`` puts that first on sys.path,
    so the worker imports the installed sqla_jobs, never a source tree."""
    log = directory / f"{label}.log"
    level = [] if log_level is None else ["--log-level", log_level]
    command = [sys.executable, "-m", "sqla_jobs", "--log-format", "json", *level, "worker"]
    with log.open("wb") as handle:
        popen = subprocess.Popen(
            [*command, *worker_args],
            cwd=directory,
            env=worker_env(url),
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    return popen, log
