"""The ``baseline`` section's probe: one version of sqla_jobs, measured on its own.

Run as a script by :mod:`sqla_jobs.bench.baseline` with ``PYTHONPATH`` naming the checkout
to measure, so ``import sqla_jobs`` is that version. It uses only what every version since
the claim's fast path has (``JobMixin``, ``enqueue_many``, ``claim``, ``complete_many``),
creates its own table with that version's ``create_all`` (its columns, indexes and
trigger), and prints one JSON object: jobs/s of a bulk ``enqueue_many``, of an ORM
``add_all``, and of a plain claim loop (``claim`` of ``batch`` jobs, then ``complete_many``
of them, a transaction each, on one connection: the library's statements, no worker); and
for each, the CPU per job of this process and of its server backend (``.client_us``,
``.server_us``; the backend's only when the server runs on this machine), which the load of
a shared machine disturbs less than the rates.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

import sqla_jobs


class _Base(DeclarativeBase):
    pass


class ProbeJob(sqla_jobs.JobMixin, _Base):
    __tablename__ = "bench_probe_jobs"


class _Cpu:
    """CPU seconds of this process and of the connection's server backend (read from
    /proc when the server runs on this machine, else None), over a ``with`` block."""

    def __init__(self, connection: sa.Connection) -> None:
        driver = connection.connection.driver_connection
        self.stat = Path(f"/proc/{driver.info.backend_pid}/stat")  # type: ignore[union-attr]

    def _server(self) -> float | None:
        try:
            fields = self.stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> _Cpu:
        self.client, self.server = time.process_time(), self._server()
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.client = time.process_time() - self.client
        server = self._server()
        self.server = None if server is None or self.server is None else server - self.server

    def figures(self, name: str, count: int) -> dict[str, float]:
        out = {name: count / self.wall, f"{name}.client_us": self.client / count * 1e6}
        if self.server is not None:
            out[f"{name}.server_us"] = self.server / count * 1e6
        return out


def _enqueue_many(engine: sa.Engine, count: int) -> dict[str, float]:
    with Session(engine) as session, session.begin(), _Cpu(session.connection()) as cpu:
        jobs = ({"task": "probe", "args": {"n": n}} for n in range(count))
        sqla_jobs.enqueue_many(session, ProbeJob, jobs)
    return cpu.figures("enqueue_many", count)


def _add_all(engine: sa.Engine, count: int, flush_every: int = 1000) -> dict[str, float]:
    with Session(engine) as session, session.begin(), _Cpu(session.connection()) as cpu:
        for first in range(0, count, flush_every):
            last = min(first + flush_every, count)
            jobs = [ProbeJob(task="probe", args={"n": n}) for n in range(first, last)]
            session.add_all(jobs)
            session.flush()
    return cpu.figures("add_all", count)


def _claim_loop(engine: sa.Engine, batch: int) -> dict[str, float]:
    done = 0
    with engine.connect() as connection, _Cpu(connection) as cpu:
        while True:
            with connection.begin():
                jobs = sqla_jobs.claim(connection, ProbeJob, limit=batch, lease=60)
            if not jobs:
                break
            with connection.begin():
                sqla_jobs.complete_many(connection, jobs)
            done += len(jobs)
    return cpu.figures("claim", done)


def main(url: str, count: int, batch: int) -> None:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    _Base.metadata.drop_all(engine)
    _Base.metadata.create_all(engine)
    try:
        rates = _enqueue_many(engine, count)
        rates |= _claim_loop(engine, batch)
        with engine.begin() as connection:
            connection.execute(sa.text(f"TRUNCATE {ProbeJob.__tablename__}"))
        rates |= _add_all(engine, count)
    finally:
        _Base.metadata.drop_all(engine)
        engine.dispose()
    print(json.dumps({"module": sqla_jobs.__file__, "rates": rates}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
