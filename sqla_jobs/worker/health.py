"""The worker's liveness: :class:`WorkerHealth`, and how it is judged from what the roles
report (:func:`assess`), a pure function of that report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqla_jobs.worker.state import Attempt

__all__ = ["WorkerHealth", "assess"]


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    """A snapshot of the worker's liveness.

    ``healthy`` means the worker runs, every role thread is alive, the fetch loop went
    round within ``stuck_after`` seconds, no claimed attempt waited that long for a handler
    thread, and no outcome waited that long to be written; ``problems`` says which of these
    failed. ``database_ok`` is whether the last database call succeeded: a worker waiting
    out an outage is alive (restarting it would not help), but not doing work.
    ``oldest_attempt_age`` is how long ago the oldest attempt still held was claimed (a
    long-running handler shows here), ``outcomes_waiting`` how many finished attempts wait
    for the outcome writer, and ``oldest_outcome_age`` how long the oldest of them waited.
    ``unreadable_jobs`` counts the jobs this worker ended dead because their row could not
    be read (args that Python's json cannot decode, written by another program): each is
    logged (``action="unreadable_row"``) with its job id, and the row's ``last_error`` says
    why. They leave the worker healthy (a restart would not help), but a monitor can alert
    on them. ``overrunning`` lists ``(job id, seconds)`` for each handler still running past
    its time limit (its attempt failed at the limit, but a thread cannot be stopped: it
    keeps its slot until it returns); each takes a slot, and they leave the worker healthy.
    """

    healthy: bool
    fetch_loop_age: float
    database_ok: bool
    listening: bool
    in_flight: int
    dead_threads: tuple[str, ...]
    oldest_attempt_age: float | None = None
    outcomes_waiting: int = 0
    oldest_outcome_age: float | None = None
    problems: tuple[str, ...] = ()
    unreadable_jobs: int = 0
    overrunning: tuple[tuple[int, float], ...] = ()


def assess(
    *,
    now: float,
    running: bool,
    started: bool,
    stopping: bool,
    fetch_loop_age: float,
    stuck_after: float,
    dead: tuple[str, ...],
    held: Sequence[Attempt],
    database_ok: bool,
    listening: bool,
    unreadable_jobs: int = 0,
    overrunning: Sequence[tuple[int, float]] = (),
) -> WorkerHealth:
    """The health of a worker that ``running`` (and whose roles have ``started``, the
    fetch loop among them), whose fetch loop last went round ``fetch_loop_age`` seconds
    ago, whose role threads named in ``dead`` died, and which holds the attempts ``held``
    (:meth:`~sqla_jobs.worker.state.State.snapshot`) at ``now`` (``time.monotonic()``)."""
    waiting = [a for a in held if a.outcome is None and not a.started_at]
    settled = [a for a in held if a.outcome is not None]
    problems = []
    if not running:
        problems.append("not running")
    elif not started:
        problems.append("starting: waiting for the database")
    if dead:
        problems.append(f"dead threads: {', '.join(dead)}")
    if fetch_loop_age >= stuck_after and not stopping:
        problems.append(f"the fetch loop has not gone round for {fetch_loop_age:.0f}s")
    oldest_waiting = _oldest(now, [a.claimed_at for a in waiting])
    if oldest_waiting is not None and oldest_waiting >= stuck_after:
        problems.append(f"a claimed job waited {oldest_waiting:.0f}s for a handler thread")
    oldest_outcome = _oldest(now, [a.settled_at for a in settled])
    if oldest_outcome is not None and oldest_outcome >= stuck_after:
        problems.append(f"an outcome has waited {oldest_outcome:.0f}s to be written")
    return WorkerHealth(
        healthy=not problems,
        fetch_loop_age=fetch_loop_age,
        database_ok=database_ok,
        listening=listening,
        in_flight=len(held),
        dead_threads=dead,
        oldest_attempt_age=_oldest(now, [a.claimed_at for a in held]),
        outcomes_waiting=len(settled),
        oldest_outcome_age=oldest_outcome,
        problems=tuple(problems),
        unreadable_jobs=unreadable_jobs,
        overrunning=tuple(overrunning),
    )


def _oldest(now: float, times: list[float]) -> float | None:
    return now - min(times) if times else None
