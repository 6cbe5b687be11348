"""``sqla-jobs bench``: sqla_jobs measured against the simplest correct queue SQL, run bare.

Every figure is a ratio to a **ceiling** measured in the same run on the same server. The
drains' ceiling is not the library's own statements: it is the SQL of the articles that made
``SKIP LOCKED`` queues popular (a CTE that selects ``FOR UPDATE SKIP LOCKED`` feeding an
``UPDATE ... RETURNING``, the lease folded in; a completion fenced by attempt; in lock-held
mode, the lock and the completion in one transaction), in a plain psycopg 3 loop with
prepared statements, at the best of several batch sizes (:mod:`~sqla_jobs.bench.ceiling`).
Shared machines drift; ratios measured side by side do not drift with them. Sections
(``--only``):

``ceiling``  the plain loops, lease and lock-held, 1 and 2 processes, on the seed articles'
             own table (ten columns, one index), over a sweep of batch sizes (``--sweep``,
             and on past its largest while the rate rises; every point printed): B = 1 is
             the one-job-per-claim ceiling, the best B > 1 the batched one; the same loops
             on the library's job table beside them (``ceiling.library.*``), and the CPU
             per job of each loop and of the server (:mod:`~sqla_jobs.bench.cpu`). And the
             bulk INSERT of
             :func:`sqla_jobs.enqueue_many` by psycopg alone, and ORM ``add_all`` of a bare
             class mapped onto the same job table (``ceiling.orm_add_all``).
``enqueue``  ORM ``session.add_all`` with a flush per 1000 jobs, and
             :func:`sqla_jobs.enqueue_many`, both in one transaction; what the NOTIFY
             trigger costs.
``drain``    no-op jobs through the real :class:`~sqla_jobs.worker.Worker`, in 1 and 2
             worker processes, interleaved with the ceiling's sweep: batched is
             ``Worker(registry, engine, concurrency=--concurrency)`` with every other
             setting at its default; one job per claim is ``concurrency=1``; lease and
             lock-held mode. Workers wait idle; the jobs arrive in one committed INSERT,
             whose NOTIFY wakes them; the figure is jobs / (last ``finished_at`` - commit),
             both by the database's clock.
``latency``  enqueue commit -> handler start on an idle worker (LISTEN/NOTIFY), p50/p99, and
             under load (a steady rate of 200 ms jobs on 16 slots).
``history``  claim throughput (library claim + complete_many, batched) with 10k and with
             ``--history-rows`` finished rows in the table; and the same on a model with
             ``partitioned_history``, with the rows in its history table
             (:mod:`~sqla_jobs.bench.partitioned`). The ``drain`` section adds the batched
             drain of that model, and of the mover alternative, beside the plain one.
``hot``      a steady flow of ``--memory-jobs`` jobs (10k at a time) through a worker, on
             the history model and on the plain one: the job table's size and dead rows.
``memory``   a worker's RSS and rate over a drain of ``--memory-jobs`` jobs, against the rate
             of a ``--memory-base-jobs`` drain through the same worker; the peak RSS of a
             process that bulk-enqueues ``--memory-jobs`` jobs from a generator (against one
             that enqueues a tenth of them).
``pgbouncer`` lease-mode drains with the workers' engine through a PgBouncer in transaction
             mode started in front of the server (``prepare_threshold=None``, LISTEN on a
             direct connection), against the same drains direct, side by side. Skipped,
             saying why, when the ``pgbouncer`` binary is not installed.
``async``    :mod:`sqla_jobs.aio` on an ``AsyncSession`` of psycopg 3 and of asyncpg, beside
             the sync ``Session`` and the sync Core ``Connection`` (the queue's psycopg fast
             path): ``add_all`` and ``enqueue_many`` of ``--jobs`` jobs, and claim +
             complete cycles (one per claim, and batched). Each figure's ratio is to the
             path before it: ``session`` to ``connection``, ``psycopg`` to ``session``,
             ``asyncpg`` to ``psycopg`` (:mod:`~sqla_jobs.bench.drivers`). Skipped without
             ``pip install "sqla-jobs[asyncpg]"``.
``keys``     ordering keys and limits: the library's batched claim + complete_many of
             ``--jobs`` plain jobs (``keys.claim.plain``), beside the same with
             ``keys=True`` on plain jobs, on keyed jobs over 1,000 keys with ``key_limit``
             1 and 3, and with a queue limit as large as the batch (``queue_limit``, and
             ``keyed_limit3_queue_limit`` with keyed jobs); ratios to the plain claim.
``fair``     fair shares (:class:`~sqla_jobs.FairShare`): the library's batched claim +
             complete_many, plain and with ``fair_shares``, over one tenant's backlog of
             ``--jobs`` x 5 jobs enqueued before 50 tenants with 10 jobs each
             (``fair.drain.fair``, its ratio to ``fair.drain.plain``), the claims it took
             until every small tenant's first job started (``fair.first_claims``, and
             ``.plain``), and over 50 tenants with ``--jobs`` / 50 jobs each
             (``fair.drain.many_tenants``, its ratio to ``many_tenants_plain``).
``workflows`` workflows (:mod:`sqla_jobs.workflows`), each beside plain jobs of the same
             table: a graph of 10,000 steps (a root, a wide group after it, a merge after
             the group; fewer if ``--jobs`` is) written by ``enqueue_workflow`` in one
             transaction, against ``add_all`` of as many jobs (``workflows.create``, and
             its time in ``.seconds``); the drain of that graph by the batched claim +
             complete_many (``workflows.drain.fan_out``); of a chain of 200 steps (fewer if
             ``--single-jobs`` is; one runnable at a time), against plain jobs one per
             claim (``workflows.drain.chain``); and ``--jobs`` plain jobs drained from a
             table with steps (its columns, index and trigger) against a plain job table,
             the two drained in lockstep (``workflows.plain_on_step_table``, and the
             median of each drain's own ratio in ``.paired``).
``shape``    what each part of the library's job table costs the ceiling's lease loop: the
             loop on copies of the table, each without one index or without its checks,
             against the whole table, and on the seed table
             (:mod:`~sqla_jobs.bench.shape`).

Runs on a throwaway embedded PostgreSQL by default (``pip install 'sqla-jobs[embedded]'``),
or on the server of ``--database-url``, where it creates a scratch database
``sqla_jobs_bench_<hex>`` and drops it afterwards (the role needs CREATEDB).

The package, one module per concern: :mod:`~sqla_jobs.bench.runner` (the command line),
:mod:`~sqla_jobs.bench.results` (what is asked and what was measured),
:mod:`~sqla_jobs.bench.scratch` (the scratch database), :mod:`~sqla_jobs.bench.tasks` and
:mod:`~sqla_jobs.bench.workers` (the jobs and the worker processes), one module per section
(:mod:`~sqla_jobs.bench.ceiling`, :mod:`~sqla_jobs.bench.drain`,
:mod:`~sqla_jobs.bench.enqueue`, :mod:`~sqla_jobs.bench.latency`,
:mod:`~sqla_jobs.bench.history` with :mod:`~sqla_jobs.bench.partitioned`,
:mod:`~sqla_jobs.bench.memory`,
:mod:`~sqla_jobs.bench.bouncer`, :mod:`~sqla_jobs.bench.asynchronous` with
:mod:`~sqla_jobs.bench.drivers`, :mod:`~sqla_jobs.bench.keys`, :mod:`~sqla_jobs.bench.fair`,
:mod:`~sqla_jobs.bench.workflows`, :mod:`~sqla_jobs.bench.shape`),
:mod:`~sqla_jobs.bench.report` (targets, table, JSON) and
:mod:`~sqla_jobs.bench.statements` (the SQL only the benchmark runs, the ceiling's
included). Nothing of sqla_jobs' runtime imports it: the ``sqla-jobs bench`` command
imports it when it runs.
"""

from sqla_jobs.bench.runner import SECTIONS, main

__all__ = ["SECTIONS", "main"]
