"""``sqla-jobs bench`` runs end to end on a tiny size and writes well-formed JSON.

Not how fast anything is: only that every section ran and every number is sane.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import sqla_jobs
from sqla_jobs import bench
from sqla_jobs.bench.cpu import Meter, Usage, process_seconds

#: The sections of the quick bench, in groups, each run by a test of its own so that the
#: suite's workers share them (the ceiling, the drains and the history together took 86 to
#: 115 s of one worker on CI, the longest test of the suite). A figure measured against a
#: section of another group (a drain against its ceiling) names its ceiling and has no ratio
#: in its own group's run; the names are checked here, the ratios by `sqla-jobs bench`'s
#: full runs.
QUICK_GROUPS = (
    ("ceiling", "enqueue"),
    ("drain", "history"),
    ("pgbouncer", "processes", "memory", "latency"),
    ("hot", "keys", "fair", "async", "baseline", "workflows", "shape"),
)


def test_the_quick_groups_are_every_section_once() -> None:
    grouped = [section for group in QUICK_GROUPS for section in group]
    assert sorted(grouped) == sorted(bench.SECTIONS)


@pytest.mark.slow
@pytest.mark.parametrize("group", QUICK_GROUPS, ids=lambda group: "+".join(group))
def test_quick_bench_writes_every_section(
    server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], group: tuple[str, ...]
) -> None:
    out = tmp_path / "bench.json"
    only = ",".join(group)
    argv = ["--database-url", server_url, "--quick", "--only", only, "--json", str(out)]
    assert bench.main(argv) == 0

    table = capsys.readouterr().out
    assert "targets:" in table
    document = json.loads(out.read_text())
    machine = document["machine"]
    assert machine["cpus"] >= 1
    assert machine["fsync"] in ("on", "off")
    assert machine["server_version"]
    metrics = document["metrics"]
    sections = {name.split(".")[0] for name in metrics}
    # Every section ran, but the one whose PgBouncer is not installed and the one that needs
    # --baseline, which say why.
    assert set(document["skipped"]) <= {"pgbouncer", "baseline"}
    assert sections | set(document["skipped"]) == set(group)
    assert not sections & set(document["skipped"])
    for name, metric in metrics.items():
        assert metric["runs"], name
        for value in metric["runs"]:
            assert math.isfinite(value), name
            # rows: hot.*, may be none; a hot table's heap: vacuum truncates an emptied one
            # to no pages (the history run moves every job out).
            if metric["unit"] in ("fraction", "rows") or name.endswith(".heap_mib"):
                assert value >= 0, name
            else:
                assert value > 0, name
        ceiling = metric["ceiling"]
        if ceiling in metrics:
            assert metric["ceiling_median"] > 0, name
            assert metric["ratio"] == pytest.approx(metric["median"] / metric["ceiling_median"])
        elif ceiling is not None:  # measured by a section of another group
            assert ceiling.split(".")[0] not in group, name
            assert metric["ceiling_median"] is None, name
    for row in document["targets"]:  # every target of the sections run judged
        measured = row["metric"] in metrics and metrics[row["metric"]]["ceiling"] in (
            None,
            *metrics,
        )
        assert (row["met"] is not None) == measured, row
    if "ceiling" in sections:
        _check_ceiling(document, table)
    if "drain" in sections:
        _check_drain(metrics, table)
    if "memory" in sections:
        assert metrics["memory.drain_rate"]["ceiling"] == "memory.drain_rate.base"
    if "pgbouncer" in sections:
        for kind, procs in (("batched", 1), ("batched", 2), ("single", 1)):
            drain = metrics[f"pgbouncer.drain.lease.{kind}.{procs}p"]
            assert drain["ceiling"] == f"pgbouncer.direct.lease.{kind}.{procs}p"
    if "async" in sections:
        _check_async(metrics)
    if "keys" in sections:
        # Keyed claims behind one busy key's burst: every claim walks past it (walk_keys).
        assert metrics["keys.claim.behind_burst"]["ceiling"] == "keys.claim.plain"
        # Keyed claims from several connections at once, beside plain ones the same way.
        concurrent = metrics["keys.claim.keyed_concurrent"]
        assert concurrent["ceiling"] == "keys.claim.plain_concurrent"
    if "enqueue" in sections:
        assert metrics["enqueue.bulk"]["ceiling"] == "ceiling.insert"
        assert metrics["enqueue.add_all"]["ceiling"] == "ceiling.orm_add_all"
    if "history" in sections:
        for which in ("history", "mover"):  # the partitioned history, beside the plain drain
            drain = metrics[f"drain.lease.batched.1p.{which}"]
            assert drain["ceiling"] == "drain.lease.batched.1p"
        for which in ("history", "mover"):  # WAL per job, against the drain without a history
            wal = metrics[f"drain.wal_per_job.{which}"]
            assert (wal["unit"], wal["ceiling"]) == ("bytes", "drain.wal_per_job.nohist")
    if "shape" in sections:  # each part of the table, against the whole table
        for variant in (*bench.shape.VARIANTS, "seed"):
            drain = metrics[f"shape.{variant}"]
            assert drain["ceiling"] == (None if variant == "library" else "shape.library")
    if "hot" in sections:
        for label in ("history", "plain"):
            assert metrics[f"hot.{label}.total_mib"]["unit"] == "MiB"
        assert metrics["hot.history.live_rows"]["median"] == 0  # everything moved out


def _check_ceiling(document: dict[str, Any], table: str) -> None:
    # The ceiling on the seed table: every point of the sweep, and past its largest size
    # while the rate rose; B = 1 is one per claim, the best of the others is the batched
    # ceiling. Beside it, the same loops on the library's table.
    metrics = document["metrics"]
    sweep = document["config"]["sweep"]
    for mode in ("lease", "lock", "lock_counted"):
        for procs in (1, 2):
            tried = sorted(
                int(name.split(".")[3][1:])
                for name in metrics
                if name.startswith(f"ceiling.sweep.{mode}.b") and name.endswith(f".{procs}p")
            )
            assert tried[: len(sweep)] == list(sweep)
            points = {b: metrics[f"ceiling.sweep.{mode}.b{b}.{procs}p"]["runs"][0] for b in tried}
            for smaller, larger in itertools.pairwise(tried[len(sweep) - 1 :]):
                # Each size past --sweep doubles one whose rate was the best so far.
                assert larger == 2 * smaller
                assert points[smaller] == max(points[b] for b in tried if 1 < b <= smaller)
            assert metrics[f"ceiling.{mode}.single.{procs}p"]["runs"] == [points[1]]
            batched = metrics[f"ceiling.{mode}.batched.{procs}p"]
            assert batched["runs"] == [max(points[b] for b in tried if b > 1)]
            assert batched["best_batch"][0] in tried
            # The CPU per job of each loop, the server's where it runs on this machine.
            for kind in ("single", "batched"):
                library = metrics[f"ceiling.library.{mode}.{kind}.{procs}p"]
                assert library["ceiling"] == f"ceiling.{mode}.{kind}.{procs}p"
                client = metrics.get(f"ceiling.{mode}.{kind}.{procs}p.client_us")
                assert client is None or client["unit"] == "us/job"
    assert "best batch of each sweep" in table


def _check_drain(metrics: dict[str, Any], table: str) -> None:
    # Each drain names its ceiling (the ceiling section's loop of the same mode, kind and
    # processes), the lock-held one the counted loop too.
    assert "drain.lease.batched.1p" in table
    for mode in ("lease", "lock", "lock_counted"):
        for procs in (1, 2):
            for kind in ("single", "batched"):
                if mode == "lock_counted":  # the lock-held drain, against the counted loop
                    drain = metrics[f"drain.lock.{kind}.{procs}p.counted"]
                    assert drain["runs"] == metrics[f"drain.lock.{kind}.{procs}p"]["runs"]
                else:
                    drain = metrics[f"drain.{mode}.{kind}.{procs}p"]
                    # Its CPU, where the drain was long enough to count (clock ticks).
                    worker = metrics.get(f"drain.{mode}.{kind}.{procs}p.worker_us")
                    if worker is not None:
                        assert worker["ceiling"] == f"ceiling.{mode}.{kind}.{procs}p.client_us"
                assert drain["ceiling"] == f"ceiling.{mode}.{kind}.{procs}p"
            # What tuning nothing gets: the worker's defaults against the batched drain.
            default = metrics[f"drain.lease.default.{procs}p"]
            assert default["ceiling"] == f"drain.lease.batched.{procs}p"
    # Lock-held jobs that each write a row (the drain checks one row per job), against the
    # no-op lock-held drain, at the worker's default concurrency.
    writes = metrics["drain.lock.writes.1p"]
    assert (writes["ceiling"], writes["concurrency"]) == ("drain.lock.batched.1p", 4)
    assert writes["runs"][0] > 0


def _check_async(metrics: dict[str, Any]) -> None:
    for operation in ("add_all", "enqueue_many", "cycle.single", "cycle.batched"):
        # The async section: each path beside the one before it.
        assert metrics[f"async.{operation}.asyncpg"]["ceiling"] == f"async.{operation}.psycopg"
        assert metrics[f"async.{operation}.psycopg"]["ceiling"] == f"async.{operation}.session"
        cpu = metrics[f"async.cpu.{operation}.asyncpg"]
        assert (cpu["unit"], cpu["ceiling"]) == ("us/job", f"async.cpu.{operation}.psycopg")
        assert not cpu["higher_is_better"]
    assert metrics["async.cycle.single.session"]["ceiling"] == "async.cycle.single.connection"
    assert metrics["async.add_all.session"]["ceiling"] is None


def test_bad_arguments_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.main(["--only", "nonsense"])
    assert exited.value.code == 2
    assert "unknown sections" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--jobs", "0"])


@pytest.mark.slow
def test_the_baseline_section_runs_each_version_in_its_own_process(
    server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # This version against itself: the mechanism, not a comparison.
    checkout = Path(sqla_jobs.__file__).resolve().parent.parent
    out = tmp_path / "bench.json"
    argv = ["--database-url", server_url, "--quick", "--only", "baseline", "--json", str(out)]
    assert bench.main([*argv, "--baseline", str(checkout)]) == 0

    metrics = json.loads(out.read_text())["metrics"]
    for operation in ("claim", "enqueue_many", "add_all"):
        current, before = metrics[f"baseline.{operation}"], metrics[f"baseline.{operation}.before"]
        assert current["ceiling"] == f"baseline.{operation}.before"
        assert current["median"] > 0
        assert before["median"] > 0
        client = metrics[f"baseline.{operation}.client_us"]
        assert client["ceiling"] == f"baseline.{operation}.client_us.before"
        assert not client["higher_is_better"]
    assert "claim >= 0.95 of --baseline's" in capsys.readouterr().out


def test_a_baseline_without_sqla_jobs_is_refused_before_any_server_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        bench.main(["--only", "baseline", "--baseline", str(tmp_path)])
    assert raised.value.code == 2
    assert "no sqla_jobs package there" in capsys.readouterr().err


def test_the_fair_section_drains_every_job_and_serves_the_small_tenants_first(
    server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --quick: a backlog of 1,500 jobs of one tenant (--jobs 300 x 5), then 50 tenants with
    # 10 jobs each; claims of 50, so the 51 tenants' first jobs take two claims at least.
    out = tmp_path / "bench.json"
    argv = ["--database-url", server_url, "--quick", "--only", "fair", "--batch", "50"]
    assert bench.main([*argv, "--repeat", "2", "--json", str(out)]) == 0

    document = json.loads(out.read_text())
    metrics = document["metrics"]
    assert set(metrics) == {
        "fair.drain.plain",
        "fair.drain.fair",
        "fair.first_claims",
        "fair.first_claims.plain",
        "fair.drain.many_tenants",
        "fair.drain.many_tenants_plain",
    }
    for name in ("fair.drain.plain", "fair.drain.fair"):  # every job claimed and completed
        assert metrics[name]["jobs"] == 300 * 5 + 50 * 10, name
    for name in ("fair.drain.many_tenants", "fair.drain.many_tenants_plain"):
        assert metrics[name]["jobs"] == 300, name
    for name, metric in metrics.items():
        assert len(metric["runs"]) == 2, name
        assert all(math.isfinite(value) and value > 0 for value in metric["runs"]), name
    assert metrics["fair.drain.fair"]["ceiling"] == "fair.drain.plain"
    assert metrics["fair.drain.many_tenants"]["ceiling"] == "fair.drain.many_tenants_plain"
    assert metrics["fair.drain.fair"]["ratio"] > 0
    # Fair: every small tenant's first job in the first two claims. Plain: behind the
    # backlog's 30 claims, all 50 of them in the 31st.
    fair, plain = metrics["fair.first_claims"], metrics["fair.first_claims.plain"]
    assert fair["runs"] == [2, 2]
    assert plain["runs"] == [300 * 5 // 50 + 1] * 2
    assert fair["unit"] == plain["unit"] == "claims"
    assert not fair["higher_is_better"]
    (target,) = (row for row in document["targets"] if row["metric"] == "fair.first_claims")
    assert target["met"] is True
    assert "fair.drain.many_tenants_plain" in capsys.readouterr().out


def test_the_workflows_section_drains_every_step_beside_plain_jobs(
    server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --quick: a fan-out graph of 300 steps (--jobs; a root, 298 side by side, a merge), a
    # chain of 30 (--single-jobs), and 300 plain jobs on each table, five pairs per run.
    out = tmp_path / "bench.json"
    argv = ["--database-url", server_url, "--quick", "--only", "workflows"]
    assert bench.main([*argv, "--repeat", "2", "--json", str(out)]) == 0

    document = json.loads(out.read_text())
    metrics = document["metrics"]
    ceilings = {
        "workflows.create": "workflows.create.plain",
        "workflows.drain.fan_out": "workflows.drain.fan_out.plain",
        "workflows.drain.chain": "workflows.drain.chain.plain",
        "workflows.plain_on_step_table": "workflows.plain_on_job_table",
    }
    seconds = {"workflows.create.seconds", "workflows.create.plain.seconds"}
    paired = "workflows.plain_on_step_table.paired"  # each lockstep drain's own ratio
    assert set(metrics) == {*ceilings, *ceilings.values(), *seconds, paired}
    for name, ceiling in ceilings.items():  # each beside plain jobs measured the same way
        assert metrics[name]["ceiling"] == ceiling
        assert metrics[ceiling]["ceiling"] is None
        assert metrics[name]["ratio"] > 0
    for name in ("workflows.create.seconds", "workflows.create.plain.seconds"):
        assert metrics[name]["unit"] == "s"
        assert not metrics[name]["higher_is_better"]
        assert metrics[name]["jobs"] == 300
    # Every step claimed and completed: the trigger made each dependent pending in turn (the
    # drain checks the count, and the workflow ended succeeded with no step left).
    drained = {
        "workflows.drain.fan_out": (300, 10),
        "workflows.drain.fan_out.plain": (300, 10),
        "workflows.drain.chain": (30, 10),  # claims of --batch, each finding one step
        "workflows.drain.chain.plain": (30, 1),  # one job per claim, as the chain takes
    }
    for name, (jobs, batch) in drained.items():
        assert (metrics[name]["jobs"], metrics[name]["batch"]) == (jobs, batch), name
    for name, metric in metrics.items():
        pairs = name.startswith("workflows.plain_on_")
        assert len(metric["runs"]) == (10 if pairs else 2), name
        assert all(math.isfinite(value) and value > 0 for value in metric["runs"]), name
    step_table = metrics["workflows.plain_on_step_table"]["runs"]
    job_table = metrics["workflows.plain_on_job_table"]["runs"]
    ratios = [step / job for step, job in zip(step_table, job_table, strict=True)]
    assert metrics[paired]["runs"] == pytest.approx(ratios)
    assert (metrics[paired]["unit"], metrics[paired]["ceiling"]) == ("ratio", None)
    (target,) = (r for r in document["targets"] if r["metric"] == paired)
    assert target["value"] == pytest.approx(metrics[paired]["median"])
    assert target["met"] is not None
    assert "plain jobs on a step table >= 0.97 of plain" in capsys.readouterr().out


def test_cpu_figures_count_the_work_done(engine: sa.Engine) -> None:
    # A process's CPU and the server's grow by the work each did (clock ticks: 10 ms).
    spent = process_seconds(os.getpid())
    assert spent is not None
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = process_seconds(os.getpid())
    assert after is not None
    assert after - spent >= 0.2
    meter = Meter(engine)
    meter.start()
    with engine.connect() as connection:
        connection.execute(sa.text("SELECT count(*) FROM generate_series(1, 3000000)")).one()
    usage = meter.stop()
    assert usage.client is None  # no process named
    assert usage.server is not None  # the test server runs on this machine
    assert usage.server >= 0.1
    assert Usage(client=0.5, server=usage.server).per_job(1000)[0] == 500.0
    assert Usage(client=0.01, server=None).per_job(10) == (None, None)  # one tick: too coarse
