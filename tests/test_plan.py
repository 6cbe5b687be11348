"""The claim's plan stays flat: a few index pages per queue served, whatever the backlog.

Each test seeds a table, then reads the claim's own ``EXPLAIN (ANALYZE, BUFFERS)``, with a
custom plan and with a generic one (``plan_cache_mode = force_generic_plan``, as a prepared
statement may be planned once for any parameters: the partial indexes must still apply,
which is why the claim spells its statuses as literals). The claim runs in a transaction
that is rolled back. Buffers, not milliseconds, are asserted: they do not depend on the
machine's load.

The issue's history case is 10M finished rows; the suite seeds 200k, and a backlog of 100k
pending jobs: each far more pages than a claim may read (:data:`PAGES_PER_QUEUE`), so that a
plan reading them fails, and a fifth of what the suite seeded before (the whole module took 32 s of
PostgreSQL's CPU, the most of any module, run once per Python in CI). Finished rows are in
neither of the claim's indexes, so the claim reads the same pages at any size (measured on
PostgreSQL 15 at 10M: 858 buffers for a claim of 50 over two queues, as with no history at
all).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa
from models import EmailJob
from plans import explain_rolled_back, explain_sql, plan_nodes

import sqla_jobs
import sqla_jobs.queue
from sqla_jobs import _queries as statements
from sqla_jobs import names

PENDING = 100_000
IN_FLIGHT = 20_000
HISTORY = 200_000
LIMIT = 10
# A claim of LIMIT jobs from one queue reads ~20 pages; this leaves room for page splits and
# PostgreSQL versions, and none for reading the backlog, the jobs in flight or the history.
PAGES_PER_QUEUE = 60
TABLE: sa.Table = EmailJob.__table__  # type: ignore[assignment]
N = names("email_jobs")
CLAIM_INDEXES = {N.pending_index, N.running_index}


def seed(engine: sa.Engine, sql: str, **params: Any) -> None:
    """Fill email_jobs with one INSERT ... SELECT (the NOTIFY trigger off), then ANALYZE."""
    with engine.begin() as connection:
        connection.execute(sa.text("ALTER TABLE email_jobs DISABLE TRIGGER USER"))
        connection.execute(sa.text(sql), params)
        connection.execute(sa.text("ALTER TABLE email_jobs ENABLE TRIGGER USER"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text("VACUUM ANALYZE email_jobs"))


def seed_pending(engine: sa.Engine, queues: list[str], count: int) -> None:
    seed(
        engine,
        "INSERT INTO email_jobs (queue, task, priority, run_at) "
        "SELECT (CAST(:queues AS text[]))[1 + n % :queue_count], 'new', n % 3 - 1, "
        "now() - (n % 1000) * interval '1 second' FROM generate_series(1, :count) AS n",
        queues=queues,
        queue_count=len(queues),
        count=count,
    )


def seed_in_flight(engine: sa.Engine, queues: list[str], count: int, *, lease: str) -> None:
    """Running jobs that sort before every pending one (the highest priority, the oldest
    run_at), on leases that end after ``lease`` (negative: already expired)."""
    seed(
        engine,
        "INSERT INTO email_jobs (queue, task, status, priority, attempts, max_attempts, "
        "run_at, lease_expires_at, leased_by) "
        "SELECT (CAST(:queues AS text[]))[1 + n % :queue_count], 'busy', 'running', -100, 1, "
        "CASE WHEN n = 1 THEN 1 ELSE 5 END, now() - interval '1 day', "
        "now() + CAST(:lease AS interval), 'elsewhere:1' FROM generate_series(1, :count) AS n",
        queues=queues,
        queue_count=len(queues),
        count=count,
        lease=lease,
    )


def claim_plan(engine: sa.Engine, queues: list[str], *, generic: bool) -> dict[str, Any]:
    """The claim's EXPLAIN (ANALYZE, BUFFERS), run in a transaction that is rolled back."""
    compiled = statements.claim(TABLE, queue_count=min(len(queues), 2)).compile(
        dialect=engine.dialect
    )
    params: dict[str, Any] = {"limit": LIMIT, "lease_seconds": 30.0, "worker": "w"}
    if len(queues) == 1:
        params["queue_name"] = queues[0]
    else:
        params["queue_names"] = queues
    return explain_rolled_back(engine, str(compiled), params, generic=generic)


def buffers(node: dict[str, Any]) -> int:
    return int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))


def candidate_scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The claim's reads of email_jobs, after checking that every read is one of the claim's
    indexes (or the primary key, where the UPDATE joins the chosen ids back), never the
    table or anything that filters rows out."""
    reads = [
        n
        for n in plan_nodes(plan["Plan"])
        if n.get("Relation Name") == "email_jobs" and n["Node Type"] != "ModifyTable"
    ]
    assert reads, "the claim did not read email_jobs?"
    for read in reads:
        assert read["Node Type"] in ("Index Scan", "Index Only Scan"), read["Node Type"]
        assert read["Index Name"] in CLAIM_INDEXES | {f"{TABLE.name}_pkey"}, read["Index Name"]
        assert read.get("Rows Removed by Filter", 0) == 0, read
    return [read for read in reads if read["Index Name"] in CLAIM_INDEXES]


def check_flat(engine: sa.Engine, queues: list[str], *, claimed: int) -> list[dict[str, Any]]:
    """Both plans read at most PAGES_PER_QUEUE pages per queue to find their candidates, and
    claim ``claimed`` jobs; returns the custom plan's candidate scans."""
    found = []
    for generic in (False, True):
        plan = claim_plan(engine, queues, generic=generic)
        scans = candidate_scans(plan)
        assert {scan["Index Name"] for scan in scans} == CLAIM_INDEXES
        pages = sum(buffers(scan) for scan in scans)
        assert pages <= PAGES_PER_QUEUE * len(queues), (generic, pages)
        assert plan["Plan"]["Actual Rows"] == claimed
        found.append(scans)
    return found[0]


@pytest.mark.parametrize("queue_count", [1, 2, 10])
def test_a_claim_over_several_queues_reads_a_few_pages_of_each(
    queue_engine: sa.Engine, queue_count: int
) -> None:
    # The backlog is spread over the claimed queues and one more, which is not read.
    queues = [f"q{i}" for i in range(queue_count)]
    seed_pending(queue_engine, [*queues, "other"], PENDING)
    scans = check_flat(queue_engine, queues, claimed=LIMIT)
    pending = [scan for scan in scans if scan["Index Name"] == N.pending_index]
    # Each queue's read stops at LIMIT rows (the LATERAL join runs it once per queue).
    assert sum(scan["Actual Rows"] * scan.get("Actual Loops", 1) for scan in pending) == (
        LIMIT * queue_count
    )


@pytest.mark.parametrize("queue_count", [1, 2])
def test_jobs_in_flight_on_live_leases_are_not_read(
    queue_engine: sa.Engine, queue_count: int
) -> None:
    # They sort before every pending job, which the version-1 claim index made it read.
    queues = [f"q{i}" for i in range(queue_count)]
    seed_in_flight(queue_engine, queues, IN_FLIGHT, lease="1 hour")
    seed_pending(queue_engine, queues, PENDING)
    scans = check_flat(queue_engine, queues, claimed=LIMIT)
    (running,) = [scan for scan in scans if scan["Index Name"] == N.running_index]
    assert running["Actual Rows"] == 0
    assert buffers(running) <= 4 * queue_count


def test_finished_history_is_not_read(queue_engine: sa.Engine) -> None:
    queues = ["q0", "q1"]
    seed(
        queue_engine,
        "INSERT INTO email_jobs (queue, task, status, attempts, finished_at) "
        "SELECT CASE WHEN n % 2 = 0 THEN 'q0' ELSE 'q1' END, 'old', 'succeeded', 1, now() "
        "FROM generate_series(1, :count) AS n",
        count=HISTORY,
    )
    seed_pending(queue_engine, queues, 1_000)
    check_flat(queue_engine, queues, claimed=LIMIT)


def test_expired_leases_are_taken_over_by_the_claim_without_reading_live_ones(
    queue_engine: sa.Engine,
) -> None:
    queues = ["q0", "q1"]
    seed_in_flight(queue_engine, queues, IN_FLIGHT, lease="1 hour")
    seed_in_flight(queue_engine, queues, 4, lease="-1 minute")  # their workers died
    seed_pending(queue_engine, queues, PENDING)
    scans = check_flat(queue_engine, queues, claimed=LIMIT)
    running = [scan for scan in scans if scan["Index Name"] == N.running_index]
    assert sum(scan["Actual Rows"] * scan.get("Actual Loops", 1) for scan in running) == 4

    # And the claim itself (no leader, no reaper) takes them over first (they sort first):
    # a new attempt for three, dead for the one whose last attempt it was.
    with queue_engine.begin() as connection:
        claimed = sqla_jobs.claim(connection, EmailJob, queues=queues, limit=LIMIT)
        expired = connection.execute(
            sa.text(
                "SELECT id, status, attempts, last_error FROM email_jobs "
                "WHERE task = 'busy' AND leased_by IS DISTINCT FROM 'elsewhere:1'"
            )
        ).all()
    # The dead one took a place in the batch but is not handed out.
    assert len(claimed) == LIMIT - 1
    assert [job.task for job in claimed[:3]] == ["busy"] * 3
    assert {job.attempt for job in claimed[:3]} == {2}
    assert sorted(row.status for row in expired) == ["dead", "running", "running", "running"]
    assert all("attempt 1 lost its lease" in row.last_error for row in expired)


def test_vacuum_clears_the_claimed_jobs_from_the_head_of_the_pending_index(
    queue_engine: sa.Engine,
) -> None:
    # Each claimed job leaves a dead entry at the head of the pending index, which every
    # later claim steps over until a vacuum removes it. Autovacuum is kept out of the way.
    with queue_engine.begin() as connection:
        connection.execute(sa.text("ALTER TABLE email_jobs SET (autovacuum_enabled = false)"))
    try:
        seed_pending(queue_engine, ["q0"], 20_000)
        done = 0
        while done < 20_000:
            with queue_engine.begin() as connection:
                jobs = sqla_jobs.claim(connection, EmailJob, queues="q0", limit=500)
                sqla_jobs.complete_many(connection, jobs)
                done += len(jobs)
        # New jobs after all of those in claim order: the claim steps over every dead entry.
        with queue_engine.begin() as connection:
            connection.execute(
                sa.text(
                    "INSERT INTO email_jobs (queue, task, priority) "
                    "SELECT 'q0', 'new', 100 FROM generate_series(1, 100)"
                )
            )

        def pending_pages() -> int:
            plan = claim_plan(queue_engine, ["q0"], generic=False)
            scans = candidate_scans(plan)
            return sum(buffers(s) for s in scans if s["Index Name"] == N.pending_index)

        before = pending_pages()
        assert before > 50  # the dead entries of 20k claimed jobs: ~80 leaf pages
        assert not sqla_jobs.vacuum(queue_engine, EmailJob, min_dead_rows=10**12)
        assert sqla_jobs.vacuum(queue_engine, EmailJob, min_dead_rows=0)
        after = pending_pages()
        assert after <= 20, (before, after)
    finally:
        with queue_engine.begin() as connection:
            connection.execute(sa.text("ALTER TABLE email_jobs RESET (autovacuum_enabled)"))


def test_dead_rows_counts_what_the_claims_left(queue_engine: sa.Engine) -> None:
    seed_pending(queue_engine, ["q0"], 1_000)  # its VACUUM ANALYZE starts the count at 0
    with queue_engine.begin() as connection:
        # Else autovacuum may clean the 1,000 dead rows first (seen on a server's suite),
        # and the count goes back to 0 before it is read.
        connection.execute(sa.text(f"ALTER TABLE {TABLE.name} SET (autovacuum_enabled = off)"))
        jobs = sqla_jobs.claim(connection, EmailJob, queues="q0", limit=1_000)
        sqla_jobs.complete_many(connection, jobs)
    query = statements.dead_rows(TABLE)
    with queue_engine.connect() as connection:
        # The statistics arrive when the writing backend flushes them, within seconds of its
        # transaction's end; a transaction reads them once and keeps what it read.
        for _ in range(150):
            dead = connection.execute(query).scalar_one()
            connection.rollback()
            if dead >= 1_000:
                break
            time.sleep(0.1)
        assert dead >= 1_000
        missing = sa.table("no_such_table")
        assert connection.execute(statements.dead_rows(missing)).scalar_one() == 0  # type: ignore[arg-type]


# -- ordering keys (schema version 3) ------------------------------------------------------

KEYED_INDEXES = {N.keyed_pending_index, N.key_index}
KEYS = 10_000


def seed_keyed(engine: sa.Engine, queues: list[str], count: int, *, running: int) -> None:
    """``count`` pending jobs over KEYS keys, and ``running`` running ones on live leases
    (one per key), so that most keys are busy and the claim must look past them."""
    seed(
        engine,
        "INSERT INTO email_jobs (queue, task, priority, run_at, ordering_key) "
        "SELECT (CAST(:queues AS text[]))[1 + n % :queue_count], 'keyed', n % 3 - 1, "
        "now() - (n % 1000) * interval '1 second', 'customer:' || (n % :keys) "
        "FROM generate_series(1, :count) AS n",
        queues=queues,
        queue_count=len(queues),
        count=count,
        keys=KEYS,
    )
    seed(
        engine,
        "INSERT INTO email_jobs (queue, task, status, attempts, run_at, lease_expires_at, "
        "leased_by, ordering_key) "
        "SELECT (CAST(:queues AS text[]))[1 + n % :queue_count], 'busy', 'running', 1, "
        "now() - interval '1 day', now() + interval '1 hour', 'elsewhere:1', "
        "'customer:' || n FROM generate_series(0, :running - 1) AS n",
        queues=queues,
        queue_count=len(queues),
        running=running,
    )


def keyed_claim_plans(
    engine: sa.Engine, queues: list[str], *, generic: bool
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The keyed claim's two statements' EXPLAIN (ANALYZE, BUFFERS) and how many keys the
    first locked, in one transaction that is rolled back."""
    lock_params, lock_options = sqla_jobs.queue.key_lock_params(queues, LIMIT)
    lock_sql = str(statements.lock_keys(TABLE, **lock_options).compile(dialect=engine.dialect))
    claim_sql = str(statements.claim_keyed(TABLE).compile(dialect=engine.dialect))
    with engine.connect() as connection:
        transaction = connection.begin()
        cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
        if generic:
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        lock_plan = explain_sql(cursor, lock_sql, lock_params, generic=generic)
        # The locks are the transaction's: running it again locks and hands over the same keys.
        cursor.execute(lock_sql, lock_params, prepare=generic)
        (keys,) = cursor.execute(
            "SELECT cardinality(CAST(current_setting(%s) AS text[]))", [statements.LOCKED_KEYS]
        ).fetchone()
        params = {
            "queue_names": queues,
            "limit": LIMIT,
            "per_key": sqla_jobs.queue.KEY_CLAIM_MAX,
            "lease_seconds": 30.0,
            "worker": "w",
        }
        claim_plan_ = explain_sql(cursor, claim_sql, params, generic=generic)
        transaction.rollback()
    return lock_plan, claim_plan_, keys


def summary(reads: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each read's index (none for a TID scan), loops, rows and buffers: an assertion's message."""
    return [
        (r.get("Index Name"), r.get("Actual Loops"), r["Actual Rows"], buffers(r)) for r in reads
    ]


def index_reads(plan: dict[str, Any], max_filtered: int = 0) -> list[dict[str, Any]]:
    reads = [
        n
        for n in plan_nodes(plan["Plan"])
        if n.get("Relation Name") == "email_jobs" and n["Node Type"] != "ModifyTable"
    ]
    assert reads
    allowed = CLAIM_INDEXES | KEYED_INDEXES | {f"{TABLE.name}_pkey"}
    for read in reads:
        assert read.get("Rows Removed by Filter", 0) <= max_filtered, read
        if read["Node Type"] == "Tid Scan":  # the keyed claim's chosen rows, by address
            continue
        assert read["Node Type"] in ("Index Scan", "Index Only Scan"), read["Node Type"]
        assert read["Index Name"] in allowed, read["Index Name"]
    return reads


@pytest.mark.parametrize("queue_count", [1, 2])
def test_the_keyed_claim_reads_a_few_pages_per_key_whatever_the_backlog(
    queue_engine: sa.Engine, queue_count: int
) -> None:
    queues = [f"q{i}" for i in range(queue_count)]
    seed_pending(queue_engine, queues, PENDING)  # plain jobs: never read by the keyed claim
    running = 30
    seed_keyed(queue_engine, queues, PENDING, running=running)
    for generic in (False, True):
        lock_plan, claim_plan_, keys = keyed_claim_plans(queue_engine, queues, generic=generic)
        reads = index_reads(lock_plan)
        assert {r["Index Name"] for r in reads} == {N.keyed_pending_index, N.running_index}
        assert sum(buffers(r) for r in reads) <= PAGES_PER_QUEUE * queue_count
        scan = LIMIT + sqla_jobs.queue.KEY_SCAN_EXTRA
        assert LIMIT <= keys <= scan  # the keys of the first ``scan`` jobs in claim order
        # PostgreSQL 15 may filter the locked keys' jobs in progress out of a key-index range
        # instead of bounding the range with them: rows of the keys in progress, never of
        # the backlog (PostgreSQL 18 filters none).
        reads = index_reads(claim_plan_, max_filtered=running * queue_count)
        assert N.key_index in {r.get("Index Name") for r in reads}
        # Two ranges of the key index per key (~3 pages each, and the rows of up to
        # KEY_CLAIM_MAX new jobs), and per chosen job its row found again by address, to
        # lock it and to update it: so many pages per key and per job, none per job of the
        # backlog.
        assert sum(buffers(r) for r in reads) <= 16 * keys + 9 * LIMIT, summary(reads)
        assert claim_plan_["Plan"]["Actual Rows"] == LIMIT


@pytest.mark.parametrize("key_limit", [1, 3])
def test_the_keyed_claim_locks_the_keys_it_needs_for_its_batch(
    queue_engine: sa.Engine, key_limit: int
) -> None:
    # Keys whose limit is 3 can each start 3 jobs: a third as many keys fill the batch, and
    # the claim reads a third as many keys' rows; which jobs it takes is the same.
    seed(
        queue_engine,
        "INSERT INTO email_jobs (queue, task, run_at, ordering_key, key_limit) "
        "SELECT 'q0', 'keyed', now() - interval '1 hour' + n * interval '1 ms', "
        "'customer:' || (n % 500), :key_limit FROM generate_series(1, 5000) AS n",
        key_limit=key_limit,
    )
    _, claim_plan_, keys = keyed_claim_plans(queue_engine, ["q0"], generic=False)
    wanted = LIMIT + sqla_jobs.queue.KEY_SCAN_EXTRA
    assert keys == -(-wanted // key_limit)  # the keys whose capacity reaches ``wanted``
    assert claim_plan_["Plan"]["Actual Rows"] == LIMIT


def seed_burst(engine: sa.Engine, burst: int, others: int, *, together: bool) -> None:
    """``burst`` jobs of the key ``hot`` first in line in q0, enqueued ``together`` (one
    run_at) or one at a time (a run_at each), then ``others`` jobs of as many keys."""
    run_at = "greatest(n - :burst, 0)" if together else "n"
    seed(
        engine,
        "INSERT INTO email_jobs (queue, task, run_at, ordering_key) "
        f"SELECT 'q0', 'keyed', now() - interval '1 hour' + {run_at} * interval '1 ms', "
        "CASE WHEN n <= :burst THEN 'hot' ELSE 'customer:' || n END "
        "FROM generate_series(1, :burst + :others) AS n",
        burst=burst,
        others=others,
    )


def test_the_walk_jumps_over_a_burst_and_reads_nothing_behind_the_keys_it_needs(
    queue_engine: sa.Engine,
) -> None:
    # One key's 5,000 jobs (enqueued together: one run_at) come first in claim order, then
    # 20,000 jobs of as many other keys: the lock statement's window holds one key, so the
    # walk goes on, jumps over the rest of the burst (to its last job, found through an
    # index, not read job by job), to the next keys, and stops as soon as they could start
    # ``scan`` jobs: a few pages per key, none per job of the burst or of the backlog.
    burst = 5_000
    seed_burst(queue_engine, burst, 20_000, together=True)
    lock_params, lock_options = sqla_jobs.queue.key_lock_params(["q0"], LIMIT)
    lock_sql = str(
        statements.lock_keys(TABLE, **lock_options).compile(dialect=queue_engine.dialect)
    )
    walk = statements.walk_keys(TABLE, rows=lock_options["rows"], queue_count=1)
    walk_sql = str(walk.compile(dialect=queue_engine.dialect))
    walk_params = {name: lock_params[name] for name in ("queue_name", "scan", "per_key")}
    walk_params["keep"] = True
    scan = LIMIT + sqla_jobs.queue.KEY_SCAN_EXTRA
    for generic in (False, True):
        with queue_engine.connect() as connection:
            transaction = connection.begin()
            cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
            if generic:
                cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            locked, _, _, capacity, full = cursor.execute(lock_sql, lock_params).fetchone()
            assert (locked, capacity, full) == (1, 1, True)  # the hot key only: walk on
            walk_params["capacity"] = capacity
            plan = explain_sql(cursor, walk_sql, walk_params, generic=generic)
            (keys,) = cursor.execute(
                "SELECT CAST(current_setting(%s) AS text[])", [statements.LOCKED_KEYS]
            ).fetchone()
            transaction.rollback()
        assert keys == ["hot", *(f"customer:{n}" for n in range(burst + 1, burst + scan))]
        reads = index_reads(plan)
        assert {r["Index Name"] for r in reads} <= {N.keyed_pending_index, N.key_index}
        assert sum(buffers(r) for r in reads) <= PAGES_PER_QUEUE + 12 * scan, summary(reads)


@pytest.mark.parametrize("busy", [False, True], ids=["walk", "busy_walk"])
def test_the_walk_reads_a_bounded_number_of_jobs_per_claim(
    queue_engine: sa.Engine, busy: bool
) -> None:
    # A burst enqueued one job per transaction (a run_at each) cannot be jumped over: the
    # walk reads it a step at a time, and gives up after WALK_STEPS steps, so that a claim
    # behind a long one (or a key alone with a deep backlog) costs a bounded read. The walk
    # after a short claim (busy) also reads each new key's jobs in progress: at most one
    # range per key, a step's keys at most WALK_STEP_ROWS.
    burst = 5_000
    seed_burst(queue_engine, burst, 100, together=False)
    lock_params, lock_options = sqla_jobs.queue.key_lock_params(["q0"], LIMIT)
    walk = statements.walk_keys(TABLE, rows=lock_options["rows"], queue_count=1, busy=busy)
    params = {name: lock_params[name] for name in ("queue_name", "scan", "per_key")}
    params |= {"capacity": 1, "keep": True}
    sql = str(walk.compile(dialect=queue_engine.dialect))
    for generic in (False, True):
        plan = explain_rolled_back(queue_engine, sql, params, generic=generic)
        reads = index_reads(plan)
        read = sum(r["Actual Rows"] * r.get("Actual Loops", 1) for r in reads)
        limit = statements.WALK_STEPS * statements.WALK_STEP_ROWS + lock_options["rows"]
        probes = statements.WALK_STEPS * statements.WALK_STEP_ROWS if busy else 0
        assert read <= limit + 2 * statements.WALK_STEPS + probes, summary(reads)


def test_the_keyed_claim_reads_no_other_keys_in_flight_whatever_the_statistics(
    queue_engine: sa.Engine,
) -> None:
    # Statistics taken while no job ran (a fresh backlog) say the running index is empty;
    # then 3,000 jobs of other keys run. Each locked key's jobs in progress must still be
    # one range of the key index: reading the running index once per key and filtering it
    # by key read every job in flight per key (198,000 rows for a claim of 66 keys).
    seed_keyed(queue_engine, ["q0"], 20_000, running=0)
    with queue_engine.begin() as connection:  # no ANALYZE after this
        connection.execute(
            sa.text(
                "INSERT INTO email_jobs (queue, task, status, attempts, run_at, "
                "lease_expires_at, leased_by, ordering_key) "
                "SELECT 'q0', 'busy', 'running', 1, now() - interval '1 day', "
                "now() + interval '1 hour', 'elsewhere:1', 'other:' || n "
                "FROM generate_series(1, 3000) AS n"
            )
        )
    for generic in (False, True):
        _, claim_plan_, keys = keyed_claim_plans(queue_engine, ["q0"], generic=generic)
        reads = index_reads(claim_plan_)
        assert sum(buffers(r) for r in reads) <= 16 * keys + 9 * LIMIT, summary(reads)
        assert claim_plan_["Plan"]["Actual Rows"] == LIMIT


def test_the_keyed_claim_is_planned_once_per_connection(queue_engine: sa.Engine) -> None:
    # Prepared (psycopg, after prepare_threshold runs) and left to PostgreSQL's default
    # plan_cache_mode, both statements of a keyed claim get a generic plan: planned once, not
    # on every claim (the lock statement's LIMIT and queue used to make its generic plan's
    # estimate lose to a fresh custom plan every time, which took as long as running it).
    seed_keyed(queue_engine, ["q0"], 5_000, running=0)
    runs = 15
    with queue_engine.connect() as connection:
        # psycopg prepares a statement on its prepare_threshold-th run (5), PostgreSQL plans
        # its first five runs as custom plans, then chooses; committed, as psycopg
        # deallocates its prepared statements on rollback.
        for _ in range(runs):
            with connection.begin():
                claimed = sqla_jobs.claim(connection, EmailJob, queues="q0", limit=LIMIT, keys=True)
                assert len(claimed) == LIMIT
                sqla_jobs.complete_many(connection, claimed)
        plans = connection.execute(
            sa.text(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE '%pg_try_advisory_xact_lock%' "
                "OR statement LIKE '%member AS MATERIALIZED%'"
            )
        ).all()
    assert len(plans) == 2, plans  # lock_keys and claim_keyed
    for statement, generic, custom in plans:
        assert custom <= 5, (statement[:60], generic, custom)
        assert generic >= runs - 10, (statement[:60], generic, custom)


def claimed_in_flight(engine: sa.Engine, count: int) -> list[sqla_jobs.ClaimedJob]:
    """``count`` jobs running on 300 s leases, claimed from a backlog of 40,000 whose
    statistics were taken while none ran (:func:`seed_pending` analyzes)."""
    seed_pending(engine, ["q0"], 40_000)
    with engine.begin() as connection:
        return sqla_jobs.claim(connection, EmailJob, queues="q0", limit=count, lease=300)


def fenced_plans(
    engine: sa.Engine, builder: Any, jobs: list[sqla_jobs.ClaimedJob]
) -> list[tuple[bool, dict[str, Any]]]:
    """``(generic, plan)`` of a fenced statement over the attempts ``jobs`` (each with a
    300 s lease where it takes one), custom then generic, each rolled back."""
    fence = {
        "fence_ids": ",".join(str(job.id) for job in jobs),
        "fence_attempts": ",".join(str(job.attempt) for job in jobs),
        "fence_leases": ",".join("300" for _ in jobs),
    }
    sql = str(builder(TABLE).compile(dialect=engine.dialect))
    params = {name: value for name, value in fence.items() if f"%({name})s" in sql}
    return [
        (generic, explain_rolled_back(engine, sql, params, generic=generic))
        for generic in (False, True)
    ]


@pytest.mark.parametrize("builder", [statements.complete, statements.heartbeat, statements.release])
def test_the_writer_and_heartbeat_batches_stay_linear_whatever_the_statistics(
    queue_engine: sa.Engine, builder: Any
) -> None:
    # The worker's own connections plan generically (plan_cache_mode = force_generic_plan,
    # sqla_jobs.worker.link), where PostgreSQL cannot see how many pairs a batch holds.
    # Under statistics that say no job runs, a batch of 700 must still be one hash join of
    # its pairs with the running index (the heartbeat then locks each row by primary key):
    # a nested loop that unnests the pairs again for each row would compare 490,000.
    claimed = claimed_in_flight(queue_engine, 700)
    for generic, plan in fenced_plans(queue_engine, builder, claimed):
        repeated = [
            (node["Node Type"], node.get("Index Name"), node.get("Actual Loops"))
            for node in plan_nodes(plan["Plan"])
            if node.get("Actual Loops", 1) > 1
            and (node["Node Type"], node.get("Index Name")) != ("Index Scan", f"{TABLE.name}_pkey")
        ]
        assert not repeated, (generic, repeated)
        assert plan["Plan"]["Actual Rows"] == len(claimed)


@pytest.mark.parametrize("builder", [statements.lock, statements.complete_held])
def test_a_lock_held_group_finds_its_rows_by_primary_key_whatever_the_statistics(
    queue_engine: sa.Engine, builder: Any
) -> None:
    # Statistics taken while every job was pending say that none runs; then 3,000 run. A
    # group's lock and completion of 300 of them must still go through the primary key:
    # neither the whole running index nor, worse, the whole table once per job.
    chunk = claimed_in_flight(queue_engine, 3_000)[:300]
    for _, plan in fenced_plans(queue_engine, builder, chunk):
        reads = [n for n in plan_nodes(plan["Plan"]) if n.get("Relation Name") == "email_jobs"]
        assert [
            (r["Node Type"], r.get("Index Name")) for r in reads if r["Node Type"] != "ModifyTable"
        ] == [("Index Scan", f"{TABLE.name}_pkey")]
        assert plan["Plan"]["Actual Rows"] == len(chunk)
        # Nothing runs once per row: a join with the fence pairs was planned as a nested
        # loop that unnested them again for each row (90,000 pairs compared for 300 jobs).
        assert all(node.get("Actual Loops", 1) == 1 for node in plan_nodes(plan["Plan"])), [
            (node["Node Type"], node.get("Actual Loops")) for node in plan_nodes(plan["Plan"])
        ]


def test_the_plain_claim_does_not_read_keyed_jobs(queue_engine: sa.Engine) -> None:
    queues = ["q0", "q1"]
    seed_keyed(queue_engine, queues, PENDING, running=0)  # they sort before every plain job
    seed_pending(queue_engine, queues, 1_000)
    check_flat(queue_engine, queues, claimed=LIMIT)


def limited_claim_plan(engine: sa.Engine, slots: int, *, generic: bool) -> dict[str, Any]:
    """The plain claim of a limited queue q0 (it counts its free slots,
    :func:`statements.limited_count`): its EXPLAIN (ANALYZE, BUFFERS), rolled back."""
    sql = str(statements.claim(TABLE, queue_count=1, limited=True).compile(dialect=engine.dialect))
    params = {
        "queue_name": "q0",
        "queue_slots": slots,
        "limit": LIMIT,
        "lease_seconds": 30.0,
        "worker": "w",
    }
    return explain_rolled_back(engine, sql, params, generic=generic)


def test_the_limited_claim_counts_live_attempts_from_the_running_index(
    queue_engine: sa.Engine,
) -> None:
    # The limited queue q0: 300 in flight on live leases, 5 whose leases ran out. Around it,
    # jobs in flight in other queues, a backlog and a history, none of which it may read.
    live, expired = 300, 5
    seed_in_flight(queue_engine, ["q0"], live, lease="1 hour")
    seed_in_flight(queue_engine, ["q0"], expired, lease="-1 minute")
    seed_in_flight(queue_engine, ["q1", "q2"], IN_FLIGHT, lease="1 hour")
    seed_pending(queue_engine, ["q0", "q1"], PENDING)
    seed(
        queue_engine,
        "INSERT INTO email_jobs (queue, task, status, attempts, finished_at) "
        "SELECT 'q0', 'old', 'succeeded', 1, now() FROM generate_series(1, :count) AS n",
        count=HISTORY // 10,
    )
    free = 3
    for generic in (False, True):
        # The claim rolled back before left dead versions of the rows it claimed, and their
        # index entries (VACUUM skips the indexes for a few dead rows unless told).
        with queue_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(sa.text("VACUUM (INDEX_CLEANUP ON) email_jobs"))
        plan = limited_claim_plan(queue_engine, live + free, generic=generic)
        reads = index_reads(plan)
        assert {r["Index Name"] for r in reads} <= CLAIM_INDEXES | {f"{TABLE.name}_pkey"}
        counts = [r for r in reads if r["Node Type"] == "Index Only Scan"]
        # All of the queue's running jobs counted from the index alone (VACUUM set the
        # visibility map); the expired ones read (and locked) from the oldest lease end up.
        assert [(r["Index Name"], r["Actual Rows"]) for r in counts] == [
            (N.running_index, live + expired)
        ]
        assert counts[0].get("Heap Fetches", 0) == 0
        assert sum(buffers(r) for r in reads) <= 2 * PAGES_PER_QUEUE, [buffers(r) for r in reads]
        assert plan["Plan"]["Actual Rows"] == free  # its free slots, fewer than LIMIT
