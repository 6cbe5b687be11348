"""Tasks whose handlers run in child processes (``process=True``), for
tests/test_process_handlers.py: at the top level of this module, which the children import
by its name (the tests' folder is on ``sys.path``, which spawned children inherit)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

from models import EmailJob, EmailJobResult

from sqla_jobs import JobContext, Registry, RetryPolicy, Snooze

registry = Registry(
    EmailJob,
    result_model=EmailJobResult,
    default_queue="processes",
    default_retry=RetryPolicy(base=timedelta(milliseconds=10), cap=timedelta(milliseconds=10)),
)


@registry.task(process=True)
def square(ctx: JobContext) -> dict[str, Any]:
    """The square of ``x``, the child's pid, and a progress report."""
    x = ctx.args["x"]
    ctx.report_progress(1.0, f"squared {x}")
    return {"square": x * x, "pid": os.getpid(), "parent": os.getppid()}


@registry.task(process=True, max_attempts=1)
def fail(ctx: JobContext) -> None:
    raise ValueError(f"boom from the child of job {ctx.id}")


@registry.task(process=True, max_attempts=2)
def die_on_first_attempt(ctx: JobContext) -> int:
    """Killed by its own SIGKILL mid-job on its first attempt; its pid on the next."""
    if ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


@registry.task(process=True, max_attempts=1)
def exit_mid_job(ctx: JobContext) -> None:
    os._exit(3)


@registry.task(process=True, max_attempts=1, time_limit=0.5)
def spin(ctx: JobContext) -> str:
    """A pure-Python loop that never checks ctx.cancelled: killed at its time limit."""
    if ctx.args.get("forever", True):
        while True:
            pass
    return "quick"


@registry.task(process=True, max_attempts=1)
def sleep_long(ctx: JobContext) -> None:
    time.sleep(60)


@registry.task(process=True, max_attempts=1)
def snooze_once(ctx: JobContext) -> Any:
    if ctx.attempt == 1:
        raise Snooze(timedelta(milliseconds=50))
    if ctx.attempt == 2:
        return Snooze(timedelta(milliseconds=50))
    return "woke"


class _OddError(Exception):
    """An exception whose constructor takes other arguments than its args: it does not
    survive a pickle round trip."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"odd {code}: {detail}")


@registry.task(process=True, max_attempts=1)
def raise_odd(ctx: JobContext) -> None:
    raise _OddError(7, "not picklable as it is")


@registry.task(process=True, max_attempts=1)
def unpicklable_result(ctx: JobContext) -> Any:
    return lambda: None


@registry.task(process=True, max_attempts=1)
def read_columns(ctx: JobContext) -> Any:
    return ctx.columns


def crunch(n: int) -> int:
    """A CPU-bound loop of pure Python."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


@registry.task(process=True, name="crunch")
def crunch_task(ctx: JobContext) -> int:
    return crunch(ctx.args["n"])


@registry.task(name="thread_square")
def thread_square(ctx: JobContext) -> int:
    """A thread handler beside the process ones."""
    x: int = ctx.args["x"]
    return x * x
