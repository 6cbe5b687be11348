"""What one assignment of the claim's UPDATE costs: the plain claim statement as sqla_jobs
builds it, against the same statement without ``SET column = ...``, interleaved on one
table of the default model (``sqla_jobs.models.Job``).

Each round refills the table with ``claims * batch`` pending jobs (``VACUUM ANALYZE``d), then
times ``claims`` claims of ``batch`` jobs, one transaction each, ``synchronous_commit`` off
so that the commit's fsync does not drown the statement; the two statements take turns in
going first. Printed: the median time per claimed job of each, and the median of the rounds'
ratios with a bootstrap 95% interval. It drops and creates the default model's tables in the
database given: use a database of its own.

    python .ci/claim_ab.py postgresql+psycopg://postgres@127.0.0.1:5432/abbench \\
        --without attempted_at --rounds 100
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from sqla_jobs import _queries
from sqla_jobs.models import Base, Job
from sqla_jobs.schema.pauses import pause_table


def statements(column: str) -> tuple[str, str]:
    """The claim's text, and the same without the assignment of ``column`` (``none``: the
    same text, a control of the method: its ratio should be 1)."""
    table = Job.__table__
    text = str(_queries.claims.claim(table, queue_count=1).compile(dialect=postgresql.dialect()))
    if column == "none":
        return text, text + " "
    # Each assignment is `, name=CASE WHEN ... END` up to the next one, FROM or RETURNING.
    pattern = rf", {column}=CASE WHEN .*? END(?=, \w+=| FROM | RETURNING )"
    without = re.sub(pattern, "", text, count=1, flags=re.S)
    if without == text:
        raise SystemExit(f"the claim assigns no {column!r}")
    return text, without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--without", default="attempted_at", help="the column (attempted_at)")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--claims", type=int, default=50)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    full, reduced = statements(args.without)
    engine = sa.create_engine(args.url)
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    pause_table(Job).create(engine, checkfirst=True)
    engine.dispose()
    name = Job.__table__.name
    params = {"queue_name": "default", "limit": args.batch, "lease_seconds": 60, "worker": "w"}
    times: dict[str, list[float]] = {"full": [], "reduced": []}
    url = sa.make_url(args.url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for round_ in range(args.rounds):
            order = [("full", full), ("reduced", reduced)]
            for kind, text in order if round_ % 2 == 0 else order[::-1]:
                conn.execute(f"TRUNCATE {name}")
                conn.execute(
                    f"INSERT INTO {name} (task) SELECT 't' FROM generate_series(1, %s)",
                    (args.claims * args.batch,),
                )
                conn.execute(f"VACUUM ANALYZE {name}")
                claimed = 0
                start = time.perf_counter()
                for _ in range(args.claims):
                    with conn.transaction():
                        claimed += len(conn.execute(text, params).fetchall())
                elapsed = time.perf_counter() - start
                assert claimed == args.claims * args.batch, claimed
                times[kind].append(elapsed / claimed * 1e6)
    ratios = [a / b for a, b in zip(times["full"], times["reduced"], strict=True)]
    random.seed(1)
    medians = sorted(statistics.median(random.choices(ratios, k=len(ratios))) for _ in range(5000))
    low, high = medians[int(0.025 * 5000)], medians[int(0.975 * 5000) - 1]
    print(
        f"claim: {statistics.median(times['full']):.1f} us/job; without {args.without}: "
        f"{statistics.median(times['reduced']):.1f} us/job"
    )
    print(
        f"with/without, median of {len(ratios)} rounds' ratios: "
        f"{statistics.median(ratios):.3f} (95% {low:.3f}-{high:.3f})"
    )


if __name__ == "__main__":
    main()
