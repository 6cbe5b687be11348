"""Run: python .ci/measure/history_locks.py URL, URL a server's postgres database
(postgresql+psycopg://postgres@127.0.0.1:5432/postgres).

How long partition DDL holds the history table, and what claims and completions see.

A loop claims and completes batches of 50 on a history model (one process), while another
thread runs create_partitions / drop_partitions cycles. Reports: DDL transaction times,
the max claim latency and the max completion latency during DDL vs without."""

import sys
import threading
import time
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

import sqla_jobs
from sqla_jobs import history
from sqla_jobs.ddl import executable
from sqla_jobs.history.schema import create_partition, drop_partition, history_names


class Base(DeclarativeBase):
    pass


class LockJob(sqla_jobs.JobMixin, Base):
    __tablename__ = "lock_jobs"
    partitioned_history = True


url = sys.argv[1]
admin = sa.create_engine(url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
with admin.connect() as c:
    c.execute(sa.text("DROP DATABASE IF EXISTS hist_locks WITH (FORCE)"))
    c.execute(sa.text("CREATE DATABASE hist_locks"))
engine = sa.create_engine(url.rsplit("/", 1)[0] + "/hist_locks", pool_size=5)
Base.metadata.create_all(engine)
history.create_partitions(engine, LockJob, days_ahead=1)
with Session(engine) as s, s.begin():
    sqla_jobs.enqueue_many(s, LockJob, ({"task": "t"} for _ in range(200_000)))
n = history_names("lock_jobs")
stop = threading.Event()
ddl_times = []
claims, completes = [], []


def ddl() -> None:
    day = __import__("datetime").date(2020, 1, 1)
    i = 0
    while not stop.is_set():
        d = day + timedelta(days=i % 50)
        t = time.perf_counter()
        with engine.begin() as c:
            c.execute(sa.text("SET LOCAL lock_timeout = '200ms'"))
            c.execute(executable(create_partition("lock_jobs", d)))
        t2 = time.perf_counter()
        with engine.begin() as c:
            c.execute(sa.text("SET LOCAL lock_timeout = '200ms'"))
            c.execute(executable(drop_partition(n.partition(d))))
        ddl_times.append((t2 - t, time.perf_counter() - t2))
        i += 1
        time.sleep(0.05)


def work(during: list) -> None:
    end = time.monotonic() + 15
    while time.monotonic() < end:
        t = time.perf_counter()
        with Session(engine) as s, s.begin():
            jobs = sqla_jobs.claim(s, LockJob, limit=50)
        t1 = time.perf_counter()
        with Session(engine) as s, s.begin():
            sqla_jobs.complete_many(s, jobs)
        t2 = time.perf_counter()
        during.append((t1 - t, t2 - t1))


base: list = []
work(base)
th = threading.Thread(target=ddl)
th.start()
loaded: list = []
work(loaded)
stop.set()
th.join()


def q(xs, p):
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))] * 1000


for label, rows in (("without DDL", base), ("with DDL cycles", loaded)):
    c = [r[0] for r in rows]
    k = [r[1] for r in rows]
    print(
        f"{label}: {len(rows)} cycles; claim ms p50 {q(c, 0.5):.2f} p99 {q(c, 0.99):.2f} "
        f"max {max(c) * 1000:.1f}; complete ms p50 {q(k, 0.5):.2f} p99 {q(k, 0.99):.2f} "
        f"max {max(k) * 1000:.1f}"
    )
cr = [a for a, _ in ddl_times]
dr = [b for _, b in ddl_times]
print(
    f"DDL: {len(ddl_times)} create+drop pairs; create ms p50 {q(cr, 0.5):.2f} "
    f"max {max(cr) * 1000:.1f}; drop ms p50 {q(dr, 0.5):.2f} max {max(dr) * 1000:.1f}"
)
engine.dispose()
with admin.connect() as c:
    c.execute(sa.text("DROP DATABASE IF EXISTS hist_locks WITH (FORCE)"))
