"""The ``workflows`` section: what workflows (:mod:`sqla_jobs.workflows`) cost, each figure
beside plain jobs of the same table written or drained the same way, on bench-only models:
:class:`StepBenchJob` (a job model with :class:`~sqla_jobs.StepMixin`, so its table has the
step columns, the step index and the workflow trigger) and its workflows
(:class:`WorkflowBenchFlow`), and :class:`PlainBenchJob` (the same job table without
``StepMixin``). The drains are the library's batched claim + complete_many on a Core
connection, a transaction each, until a claim comes back empty (as in
:mod:`~sqla_jobs.bench.fair`): the transaction that completes a step's last dependency
makes the step pending (the workflow trigger), so the next claim finds it.

* ``workflows.create`` against ``workflows.create.plain``: a graph of
  :data:`_GRAPH_STEPS` steps (or ``--jobs``, if fewer) built with
  :class:`~sqla_jobs.Workflow` and written by :func:`~sqla_jobs.enqueue_workflow` in one
  transaction: a root, every other step but one side by side after it (a wide group), and
  a merge step after the whole group (its callback); against ``session.add_all`` of as many
  plain jobs of the same model in one transaction. Both as jobs/s from the jobs' construction to
  the commit, and the time (``workflows.create.seconds``, ``.plain.seconds``).
* ``workflows.drain.fan_out`` against ``workflows.drain.fan_out.plain``: the drain of that
  graph (one root, then the group in claims of ``--batch``, then the merge) and of those
  plain jobs, each vacuumed first; jobs/s.
* ``workflows.drain.chain`` against ``workflows.drain.chain.plain``: a chain of
  :data:`_CHAIN_STEPS` steps (or ``--single-jobs``, if fewer), drained by the same loop, in
  which only one step is ever runnable, so that each claim takes one; against as many plain
  jobs drained by the same loop one job per claim. What a step costs beyond a plain job
  when it is latency-bound: the drain is a commit after a commit, step by step.
* ``workflows.plain_on_step_table`` against ``workflows.plain_on_job_table``: ``--jobs``
  plain jobs (no workflow) in the step model's table and as many in the plain model's,
  drained in lockstep, a claim + complete_many cycle on one table then on the other
  (:func:`_lockstep`), :data:`_PAIRS` times per run: what the step columns, the step index
  and the trigger (whose ``WHEN`` clause skips a job with no workflow) cost a queue that
  uses no workflow. ``workflows.plain_on_step_table.paired``: each lockstep drain's ratio
  of the two rates (its median is the figure the target reads).

The other figures' two variants run side by side, the order rotating from run to run, each
on tables truncated first.
"""

from __future__ import annotations

import itertools
import time
from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs.bench import scratch
from sqla_jobs.bench import statements as bench_sql
from sqla_jobs.bench.results import Config, Results
from sqla_jobs.schema import JobMixin
from sqla_jobs.workflows import StepMixin, Workflow, WorkflowMixin, enqueue_workflow

__all__ = ["PlainBenchJob", "StepBenchJob", "WorkflowBenchFlow", "metadata", "run_workflows"]

_QUEUE: Final = "bench_workflows"
_TASK: Final = "bench_noop"
#: The steps of the created (and drained) fan-out graph, at most: the issue's 10,000.
_GRAPH_STEPS: Final = 10_000
#: The steps of the drained chain, at most.
_CHAIN_STEPS: Final = 200
#: Lockstep drains of the plain-jobs figure per run (its target is within 3%: more than one).
_PAIRS: Final = 5


class _Base(DeclarativeBase):
    pass


class WorkflowBenchFlow(WorkflowMixin, _Base):
    """The workflows of :class:`StepBenchJob`."""

    __tablename__ = "sqla_jobs_bench_workflows"


class StepBenchJob(StepMixin, JobMixin, _Base):
    """The section's step model: the library's job table, with the step columns, the step
    index and the workflow trigger."""

    __tablename__ = "sqla_jobs_bench_step_jobs"
    workflow_model = WorkflowBenchFlow


class PlainBenchJob(JobMixin, _Base):
    """The same job table without :class:`~sqla_jobs.StepMixin`: what a queue that uses no
    workflow had before."""

    __tablename__ = "sqla_jobs_bench_plain_jobs"


#: The models' tables (the job tables, the pause tables JobMixin adds beside them, the
#: workflow table).
metadata: Final = _Base.metadata
_STEPS: Final[sa.Table] = StepBenchJob.__table__  # type: ignore[assignment]
_PLAIN: Final[sa.Table] = PlainBenchJob.__table__  # type: ignore[assignment]
_FLOWS: Final[sa.Table] = WorkflowBenchFlow.__table__  # type: ignore[assignment]

_JobModel = type[StepBenchJob] | type[PlainBenchJob]


def _job(n: int) -> StepBenchJob:
    return StepBenchJob(task=_TASK, queue=_QUEUE, args={"n": n})


def _reset(engine: sa.Engine) -> None:
    """Empty the section's tables (their ids restart), for the next variant."""
    with engine.begin() as connection:
        connection.execute(sa.text(bench_sql.truncate(_STEPS, _FLOWS, _PLAIN)))


def _vacuum(engine: sa.Engine, table: sa.Table) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text(bench_sql.vacuum_analyze(table)))


def _fan_out(steps: int) -> Workflow:
    """A root, ``steps`` - 2 steps after it side by side, and a merge step after them all."""
    flow = Workflow("bench fan-out")
    root = flow.add("root", _job(0))
    group = flow.group({f"step{n}": _job(n) for n in range(1, steps - 1)}, after=root)
    flow.add("merge", _job(steps - 1), after=group)
    return flow


def _chain(steps: int) -> Workflow:
    """``steps`` steps, each after the one before."""
    flow = Workflow("bench chain")
    flow.chain(*((f"step{n}", _job(n)) for n in range(steps)))
    return flow


def _write_graph(engine: sa.Engine, steps: int, *, chain: bool) -> tuple[int, float]:
    """Build the graph and write it with enqueue_workflow in one transaction: its
    workflow's id, and the seconds from the first step's construction to the commit."""
    started = time.perf_counter()
    with Session(engine) as session, session.begin():
        flow = _chain(steps) if chain else _fan_out(steps)
        created = enqueue_workflow(session, flow)
    return created.id, time.perf_counter() - started


def _write_plain(engine: sa.Engine, count: int) -> float:
    """``session.add_all`` of ``count`` plain jobs of the step model in one transaction:
    the seconds from the first job's construction to the commit."""
    started = time.perf_counter()
    with Session(engine) as session, session.begin():
        session.add_all([_job(n) for n in range(count)])
    return time.perf_counter() - started


def _check_succeeded(engine: sa.Engine, workflow_id: int) -> None:
    """The drained workflow ended succeeded, with no step left: the trigger counted every
    step."""
    with Session(engine) as session:
        flow = session.get(WorkflowBenchFlow, workflow_id)
        if flow is None or (flow.status, flow.steps_left) != ("succeeded", 0):
            found = None if flow is None else (flow.status, flow.steps_left)
            raise RuntimeError(f"workflow {workflow_id}: {found}, not succeeded with none left")


def _create_and_drain(cfg: Config, results: Results, engine: sa.Engine, turn: int) -> None:
    """``workflows.create`` and ``workflows.drain.fan_out``, each beside plain jobs."""
    steps = max(min(_GRAPH_STEPS, cfg.jobs), 3)
    for graph in (False, True)[turn:] + (False, True)[:turn]:
        _reset(engine)
        if graph:
            workflow_id, seconds = _write_graph(engine, steps, chain=False)
        else:
            seconds = _write_plain(engine, steps)
        label = "" if graph else ".plain"
        ceiling = "workflows.create.plain" if graph else None
        results.add(f"workflows.create{label}", steps / seconds, "jobs/s", ceiling)
        timed = results.add(f"workflows.create{label}.seconds", seconds, "s")
        timed.higher_is_better = False
        timed.extra["jobs"] = steps
        _vacuum(engine, _STEPS)
        value = scratch.drain(engine, StepBenchJob, _QUEUE, cfg.batch, steps)
        if graph:
            _check_succeeded(engine, workflow_id)
        ceiling = "workflows.drain.fan_out.plain" if graph else None
        drained = results.add(f"workflows.drain.fan_out{label}", value, "jobs/s", ceiling)
        drained.extra.update(jobs=steps, batch=cfg.batch)


def _chain_drain(cfg: Config, results: Results, engine: sa.Engine, turn: int) -> None:
    """``workflows.drain.chain``, beside plain jobs drained one per claim."""
    steps = min(_CHAIN_STEPS, cfg.single_jobs)
    for chain in (False, True)[turn:] + (False, True)[:turn]:
        _reset(engine)
        if chain:
            workflow_id, _ = _write_graph(engine, steps, chain=True)
        else:
            _write_plain(engine, steps)
        _vacuum(engine, _STEPS)
        batch = cfg.batch if chain else 1
        value = scratch.drain(engine, StepBenchJob, _QUEUE, batch, steps)
        if chain:
            _check_succeeded(engine, workflow_id)
        label, ceiling = ("", "workflows.drain.chain.plain") if chain else (".plain", None)
        drained = results.add(f"workflows.drain.chain{label}", value, "jobs/s", ceiling)
        drained.extra.update(jobs=steps, batch=batch)


def _fill(engine: sa.Engine, table: sa.Table, count: int) -> None:
    """``count`` pending no-op jobs in the section's queue of ``table``, in one INSERT."""
    with engine.begin() as connection:
        connection.execute(bench_sql.fill(table), {"queue": _QUEUE, "task": _TASK, "count": count})


def _lockstep(engine: sa.Engine, batch: int, count: int) -> dict[_JobModel, float]:
    """Both tables' jobs drained in lockstep on one Core connection: a claim of ``batch``
    and the complete_many of what it took (a transaction each) on one table, then the same
    on the other, which goes first alternating, until both claims come back empty; each
    table's jobs/s over the time its own cycles took (all ``count`` of each must be done).
    The machine's drift, which moves a drain's rate from one round to the next on a shared
    machine, falls on both tables alike, a cycle apart."""
    models: tuple[_JobModel, _JobModel] = (PlainBenchJob, StepBenchJob)
    spent = dict.fromkeys(models, 0.0)
    done = dict.fromkeys(models, 0)
    with engine.connect() as connection:
        for turn in itertools.count():
            claimed = 0
            for model in models if turn % 2 == 0 else models[::-1]:
                started = time.perf_counter()
                took, completed = scratch.claim_cycle(connection, model, _QUEUE, batch)
                spent[model] += time.perf_counter() - started
                done[model] += completed
                claimed += took
            if not claimed:
                break
    for model in models:
        if done[model] != count:
            raise RuntimeError(f"claimed and completed {done[model]} of {count} jobs")
    return {model: count / spent[model] for model in models}


def _plain_jobs(cfg: Config, results: Results, engine: sa.Engine) -> None:
    """``workflows.plain_on_step_table`` against ``workflows.plain_on_job_table``:
    :data:`_PAIRS` lockstep drains (:func:`_lockstep`) of ``--jobs`` plain jobs in each
    table, filled and vacuumed alike."""
    for _ in range(_PAIRS):
        _reset(engine)
        for table in (_PLAIN, _STEPS):
            _fill(engine, table, cfg.jobs)
            _vacuum(engine, table)
        rates = _lockstep(engine, cfg.batch, cfg.jobs)
        base = results.add("workflows.plain_on_job_table", rates[PlainBenchJob], "jobs/s")
        base.extra.update(jobs=cfg.jobs, batch=cfg.batch)
        ceiling = "workflows.plain_on_job_table"
        steps = results.add("workflows.plain_on_step_table", rates[StepBenchJob], "jobs/s", ceiling)
        steps.extra.update(jobs=cfg.jobs, batch=cfg.batch)
        # Each lockstep drain's own ratio: its median is what the target reads, where the
        # ratio of the two medians can pair a slow round of one with a fast one of the other.
        paired = rates[StepBenchJob] / rates[PlainBenchJob]
        results.add("workflows.plain_on_step_table.paired", paired, "ratio")


def run_workflows(cfg: Config, engine: sa.Engine, results: Results) -> None:
    """One run of each figure, its two variants side by side, on the models' tables,
    created here and dropped at the end; each run starts with another variant (the order
    rotates), so that neither is always first."""
    metadata.create_all(engine)
    try:
        created = results.metrics.get("workflows.create.plain")
        turn = (len(created.runs) if created is not None else 0) % 2
        _create_and_drain(cfg, results, engine, turn)
        _chain_drain(cfg, results, engine, turn)
        _plain_jobs(cfg, results, engine)
    finally:
        metadata.drop_all(engine)
    scratch.progress("workflows")
