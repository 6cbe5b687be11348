"""CPU time of the processes a drain runs in: a worker's, a plain loop's, the server's.

Read from ``/proc`` (Linux), so the server's is known only when it runs on this machine (the
embedded server, a local service); elsewhere it is None and the figures that need it are
left out. Per job, in microseconds: what a shared machine's load disturbs less than a rate.

The server's CPU is the whole server's over the interval: the postmaster's own and the time
of the children it reaped (``cutime``/``cstime``: backends that exited), plus every live
child's (the backends of the drain, the WAL writer, the checkpointer, autovacuum). WAL and
vacuum are part of what a job costs the server, and a loop and a worker are measured alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import sqlalchemy as sa

from sqla_jobs.bench import statements as bench_sql

__all__ = ["Meter", "ServerCpu", "Usage", "process_seconds"]

_PROC: Path = Path("/proc")
#: The fewest clock ticks (10 ms each, usually) a CPU figure is divided by jobs from.
MIN_TICKS: Final = 20


def _fields(pid: int) -> list[str] | None:
    # The fields after the command name, which may hold spaces and parentheses: field 3
    # (state) is index 0 here, utime (14) index 11, stime 12, cutime 13, cstime 14.
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def process_seconds(pid: int) -> float | None:
    """CPU seconds (user and system, every thread) process ``pid`` has used, None when it
    cannot be read."""
    fields = _fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _ticks()


class ServerCpu:
    """The CPU seconds of a PostgreSQL server running on this machine, read on demand
    (:meth:`read`); None when it does not (or its processes cannot be read)."""

    def __init__(self, engine: sa.Engine) -> None:
        with engine.connect() as connection:
            backend = connection.execute(bench_sql.backend_pid()).scalar_one()
        fields = _fields(int(backend))
        self.postmaster: int | None = None if fields is None else int(fields[1])

    def read(self) -> float | None:
        if self.postmaster is None:
            return None
        own = _fields(self.postmaster)
        if own is None:
            return None
        total = sum(int(own[i]) for i in (11, 12, 13, 14))
        for child in _PROC.glob("[0-9]*"):
            fields = _fields(int(child.name))
            if fields is not None and fields[1] == str(self.postmaster):
                total += int(fields[11]) + int(fields[12])
        return total / _ticks()


@dataclass
class Usage:
    """CPU seconds over one drain: of the processes that ran the jobs (a worker's, a plain
    loop's; None when unknown) and of the server (None when it is not on this machine)."""

    client: float | None
    server: float | None

    def per_job(self, jobs: int) -> tuple[float | None, float | None]:
        """Microseconds per job: ``(client, server)``; None for a figure of fewer than
        :data:`MIN_TICKS` clock ticks, too coarse to divide (a tiny drain)."""

        def us(seconds: float | None) -> float | None:
            if seconds is None or jobs <= 0 or seconds * _ticks() < MIN_TICKS:
                return None
            return seconds / jobs * 1e6

        return us(self.client), us(self.server)


def _spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


class Meter:
    """The CPU of processes ``pids`` (a drain's workers; none for a loop that measures
    itself) and of the server, from :meth:`start` to :meth:`stop`."""

    def __init__(self, engine: sa.Engine, pids: list[int] | None = None) -> None:
        self.server = ServerCpu(engine)
        self.pids = pids or []

    def _read(self) -> tuple[float | None, float | None]:
        seconds = [process_seconds(pid) for pid in self.pids]
        known = [s for s in seconds if s is not None]
        clients = sum(known) if self.pids and len(known) == len(seconds) else None
        return clients, self.server.read()

    def start(self) -> None:
        self.started = self._read()

    def stop(self) -> Usage:
        client, server = self._read()
        return Usage(_spent(self.started[0], client), _spent(self.started[1], server))
