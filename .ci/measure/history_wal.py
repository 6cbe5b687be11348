"""Run: python .ci/measure/history_wal.py URL JOBS ROUNDS, URL a server's postgres database
(postgresql+psycopg://postgres@127.0.0.1:5432/postgres), e.g. JOBS 20000, ROUNDS 3.

WAL bytes and time per job: plain completion vs move in the completion vs mover.

Claim 50 + complete 50 cycles (library calls, psycopg driver path on Core connections) over
N jobs, three variants interleaved, R rounds: plain (UPDATE to succeeded), history (the
completion statement moves), mover (UPDATE, then the mover sweeps the rows into a history
table in windows of 10k ids, its work counted in). WAL from pg_current_wal_lsn()."""

import datetime
import statistics
import sys
import time

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

import sqla_jobs
from sqla_jobs import history
from sqla_jobs.ddl import executable
from sqla_jobs.history import statements as hs
from sqla_jobs.history.schema import create_partition, history_table


class Base(DeclarativeBase):
    pass


class Plain(sqla_jobs.JobMixin, Base):
    __tablename__ = "w_plain"


class Hist(sqla_jobs.JobMixin, Base):
    __tablename__ = "w_hist"
    partitioned_history = True


class Moved(sqla_jobs.JobMixin, Base):
    __tablename__ = "w_moved"


history_table(Moved)

url, N, R = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
admin = sa.create_engine(url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
with admin.connect() as c:
    c.execute(sa.text("DROP DATABASE IF EXISTS hist_wal WITH (FORCE)"))
    c.execute(sa.text("CREATE DATABASE hist_wal"))
engine = sa.create_engine(url.rsplit("/", 1)[0] + "/hist_wal")
Base.metadata.create_all(engine)
history.create_partitions(engine, Hist, days_ahead=1)
with engine.begin() as c:
    c.execute(
        executable(create_partition("w_moved", datetime.datetime.now(datetime.timezone.utc).date()))
    )


def lsn(c):
    return c.execute(sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")).scalar()


def run(model, mover):
    with Session(engine) as s, s.begin():
        sqla_jobs.enqueue_many(s, model, ({"task": "t"} for _ in range(N)))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text(f"VACUUM ANALYZE {model.__tablename__}"))
        start = lsn(c)
    t = time.perf_counter()
    with engine.connect() as c:
        while True:
            with c.begin():
                jobs = sqla_jobs.claim(c, model, limit=50, lease=300)
            if not jobs:
                break
            with c.begin():
                sqla_jobs.complete_many(c, jobs)
        if mover:
            after = 0
            while True:
                with c.begin():
                    upto = c.execute(
                        hs.sweep_window(Moved.__table__), {"after": after, "scan": 10000}
                    ).scalar()
                    if upto is None:
                        break
                    c.execute(hs.sweep(Moved.__table__), {"after": after, "upto": upto})
                after = upto
    el = time.perf_counter() - t
    with engine.connect() as c:
        end = lsn(c)
        left = c.execute(sa.text(f"SELECT count(*) FROM {model.__tablename__}")).scalar()
    return (end - start) / N, N / el, left


res = {"plain": [], "history": [], "mover": []}
for _ in range(R):
    for name, model, mover in (
        ("plain", Plain, False),
        ("history", Hist, False),
        ("mover", Moved, True),
    ):
        res[name].append(run(model, mover))
for name, rows in res.items():
    wal = statistics.median(r[0] for r in rows)
    rate = statistics.median(r[1] for r in rows)
    print(
        f"{name:8} WAL/job {wal:7.0f} B   rate {rate:8.0f} jobs/s  "
        f"runs {[round(r[1]) for r in rows]}  rows left in the job table {rows[-1][2]}"
    )
engine.dispose()
with admin.connect() as c:
    c.execute(sa.text("DROP DATABASE IF EXISTS hist_wal WITH (FORCE)"))
