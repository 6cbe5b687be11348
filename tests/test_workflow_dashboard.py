"""Workflows on the dashboard and in the metrics, for a job model with steps (OrderJob):
the list of workflows, each one's page with its steps drawn as a graph, and the gauges of
workflows by status and of waiting steps. A model without steps (EmailJob) gets none of it:
no page, no series, no query.

The workflows are run part of the way with ``sqla_jobs.claim``, ``complete`` and ``fail``,
so the pages and gauges show real states, on a real database.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from dashboard_plans import Read, explain, summary
from models import Base, EmailJob, OrderJob, OrderJobResult, OrderWorkflow
from plans import plan_nodes
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool
from starlette.testclient import TestClient

import sqla_jobs
from sqla_jobs._queries import dashboard as statements
from sqla_jobs._queries.dashboard import WorkflowStepRow
from sqla_jobs.dashboard import app as dashboard_app
from sqla_jobs.dashboard import create_app
from sqla_jobs.dashboard.graph import MAX_BOXES, depths, layout
from sqla_jobs.health import GaugeCache
from sqla_jobs.metrics import OTHER, GaugeCollector, LabelValues
from sqla_jobs.workflows import Workflow, enqueue_workflow

# -- a few workflows, run part of the way ------------------------------------------------------


def step(task: str, queue: str = "orders") -> OrderJob:
    return OrderJob(task=task, queue=queue, args={}, max_attempts=3)


def order_flow(name: str) -> Workflow:
    """Charge, then reserve (queue orders) and email (queue mail) side by side, then ship."""
    flow = Workflow(name)
    charge = flow.add("charge", step("charge"))
    reserve = flow.add("reserve", step("reserve"), after=charge)
    email = flow.add("email", step("email", "mail"), after=charge)
    flow.add("ship", step("ship"), after=[reserve, email])
    return flow


def enqueue(engine: sa.Engine, flow: Workflow) -> dict[str, int]:
    with Session(engine) as session, session.begin():
        return dict(enqueue_workflow(session, flow).steps)


def claim_one(engine: sa.Engine, queue: str) -> sqla_jobs.ClaimedJob:
    with Session(engine) as session, session.begin():
        (attempt,) = sqla_jobs.claim(session, OrderJob, queues=queue)
    return attempt


def complete(engine: sa.Engine, attempt: sqla_jobs.ClaimedJob) -> None:
    with Session(engine) as session, session.begin():
        sqla_jobs.complete(session, attempt, result={"done": attempt.task})


@dataclass(frozen=True)
class Flows:
    """Three workflows: ``done`` succeeded; ``part`` running, one step of each state
    (charge succeeded, reserve dead, email running, ship cancelled by reserve's failure);
    ``new`` running, nothing run (charge pending, the others waiting)."""

    done: int
    part: int
    new: int
    part_steps: dict[str, int]
    new_steps: dict[str, int]


def flow_id(engine: sa.Engine, job_id: int) -> int:
    with Session(engine) as session:
        return int(session.get_one(OrderJob, job_id).workflow_id or 0)


@pytest.fixture
def flows(queue_engine: sa.Engine) -> Flows:
    engine = queue_engine
    short = Workflow("short")
    short.add("ship", step("ship", "done"), after=short.add("charge", step("charge", "done")))
    done_steps = enqueue(engine, short)
    for _ in range(2):
        complete(engine, claim_one(engine, "done"))
    part_steps = enqueue(engine, order_flow("order 7"))
    complete(engine, claim_one(engine, "orders"))  # charge: reserve and email are pending
    reserve = claim_one(engine, "orders")
    assert reserve.id == part_steps["reserve"]
    with Session(engine) as session, session.begin():
        sqla_jobs.fail(session, reserve, "Traceback ...\nValueError: out of stock", retry=False)
    assert claim_one(engine, "mail").id == part_steps["email"]  # running, left so
    new_steps = enqueue(engine, order_flow("order 8"))
    return Flows(
        done=flow_id(engine, done_steps["charge"]),
        part=flow_id(engine, part_steps["charge"]),
        new=flow_id(engine, new_steps["charge"]),
        part_steps=part_steps,
        new_steps=new_steps,
    )


@pytest.fixture
def client(queue_engine: sa.Engine) -> Iterator[TestClient]:
    with TestClient(create_app(queue_engine, OrderJob, result_model=OrderJobResult)) as client:
        yield client


def boxes(html: str) -> dict[int, dict[str, str]]:
    """The step boxes of a workflow's SVG: each one's attributes, by step id."""
    svg = html.split('<svg class="workflow"')[1].split("</svg>")[0]
    found = {}
    for match in re.finditer(r'<a class="step" ([^>]*)>(.*?)</a>', svg, re.S):
        attributes = dict(re.findall(r'([\w-]+)="([^"]*)"', match.group(1)))
        attributes["label"] = re.findall(r"<text [^>]*>([^<]*)</text>", match.group(2))[0]
        found[int(attributes["data-step-id"])] = attributes
    return found


def edges(html: str) -> list[tuple[int, int]]:
    svg = html.split('<svg class="workflow"')[1].split("</svg>")[0]
    return [
        (int(source), int(target))
        for source, target in re.findall(
            r'<path class="edge" data-from="(\d+)" data-to="(\d+)"', svg
        )
    ]


# -- the pages -----------------------------------------------------------------------------


def test_the_workflow_list_shows_the_running_first(client: TestClient, flows: Flows) -> None:
    page = client.get("/workflows")
    assert page.status_code == 200
    assert 'id="nav-workflows"' in page.text
    rows = re.findall(
        r'<tr data-workflow-id="(\d+)" data-status="(\w+)">(.*?)</tr>', page.text, re.S
    )
    assert [(int(i), status) for i, status, _ in rows] == [
        (flows.new, "running"),
        (flows.part, "running"),
        (flows.done, "succeeded"),
    ]

    def cell(pattern: str, body: str) -> str:
        found = re.search(pattern, body, re.S)
        assert found is not None, pattern
        return re.sub(r"<[^>]+>", "", found.group(1))

    cells = {
        int(i): (
            cell(r'<td class="name">([^<]*)</td>', body),
            cell(r'<td class="num steps">([^<]*)</td>', body),
            cell(r'<td class="num failed">(.*?)</td>', body),
        )
        for i, _, body in rows
    }
    # Steps done: ended ones (succeeded, dead, cancelled); failed: dead or cancelled.
    assert cells == {
        flows.new: ("order 8", "0/4", "0"),
        flows.part: ("order 7", "3/4", "2"),
        flows.done: ("short", "2/2", "0"),
    }
    assert f'href="/workflows/{flows.part}"' in page.text


def test_a_workflows_page_draws_its_steps_as_a_graph(client: TestClient, flows: Flows) -> None:
    page = client.get(f"/workflows/{flows.part}")
    assert page.status_code == 200
    assert 'id="workflow-status">running<' in page.text
    ids = flows.part_steps
    drawn = boxes(page.text)
    assert set(drawn) == set(ids.values())  # one box per step
    state = {name: drawn[ids[name]]["data-status"] for name in ids}
    assert state == {
        "charge": "succeeded",
        "reserve": "dead",
        "email": "running",
        "ship": "cancelled",
    }
    # Columns by depth; each box links to its job's page and names its step.
    column = {name: int(drawn[ids[name]]["data-column"]) for name in ids}
    assert column == {"charge": 0, "reserve": 1, "email": 1, "ship": 2}
    for name, job_id in ids.items():
        assert drawn[job_id]["href"] == f"/jobs/{job_id}"
        assert drawn[job_id]["label"] == name
    # One edge per dependency, from the dependency to the step after it.
    assert sorted(edges(page.text)) == sorted(
        [
            (ids["charge"], ids["reserve"]),
            (ids["charge"], ids["email"]),
            (ids["reserve"], ids["ship"]),
            (ids["email"], ids["ship"]),
        ]
    )
    counts = {
        status: int(n)
        for status, n in re.findall(r'data-status="(\w+)">(\d+) \w+</span>', page.text)
    }
    assert counts == {"running": 1, "succeeded": 1, "dead": 1, "cancelled": 1}
    # The steps' table says what cancelled ship: reserve, linked.
    ship = page.text.split(f'<tr data-step-id="{ids["ship"]}">')[1].split("</tr>")[0]
    assert f'by <a href="/jobs/{ids["reserve"]}">reserve</a>' in ship
    assert 'id="capped"' not in page.text
    assert 'id="truncated"' not in page.text

    waiting = client.get(f"/workflows/{flows.new}")
    by_id = {i: b["data-status"] for i, b in boxes(waiting.text).items()}
    assert by_id == {
        flows.new_steps["charge"]: "pending",
        flows.new_steps["reserve"]: "waiting",
        flows.new_steps["email"]: "waiting",
        flows.new_steps["ship"]: "waiting",
    }


def test_a_steps_job_page_links_its_workflow(client: TestClient, flows: Flows) -> None:
    waiting = flows.new_steps["ship"]
    page = client.get(f"/jobs/{waiting}")
    assert page.status_code == 200
    assert f'<a href="/workflows/{flows.new}" id="workflow-link">' in page.text
    assert '<span id="step-name">ship</span>' in page.text
    assert 'id="cancel"' in page.text  # a waiting step can be cancelled
    # The job list filters by the waiting status, for a model with steps.
    listed = client.get("/jobs?status=waiting")
    assert listed.status_code == 200
    assert sorted(int(i) for i in re.findall(r'<tr data-job-id="(\d+)">', listed.text)) == sorted(
        flows.new_steps[name] for name in ("reserve", "email", "ship")
    )
    assert '<option value="waiting"' in listed.text


def test_bad_workflow_requests_get_error_pages(client: TestClient, flows: Flows) -> None:
    assert client.get("/workflows/999999").status_code == 404
    assert client.get("/workflows/abc").status_code == 404
    assert client.get("/workflows/0").status_code == 404
    assert client.get("/workflows?status=running").status_code == 400
    assert client.get(f"/workflows/{flows.part}?x=1").status_code == 400


def test_the_list_of_an_empty_workflow_table(client: TestClient) -> None:
    page = client.get("/workflows")
    assert page.status_code == 200
    assert 'id="no-workflows"' in page.text


def test_a_large_workflow_draws_at_most_the_cap(
    client: TestClient, queue_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fan = Workflow("fan-out")
    root = fan.add("root", step("split"))
    for n in range(MAX_BOXES + 100):
        fan.add(f"part-{n:03}", step("part"), after=root)
    ids = enqueue(queue_engine, fan)
    workflow = flow_id(queue_engine, ids["root"])
    page = client.get(f"/workflows/{workflow}")
    assert page.status_code == 200
    drawn = boxes(page.text)
    assert len(drawn) == MAX_BOXES  # not 401: the first columns, then by id
    assert ids["root"] in drawn
    assert set(drawn) == set(sorted(ids.values())[:MAX_BOXES])
    assert len(edges(page.text)) == MAX_BOXES - 1  # the edges between drawn boxes
    assert page.text.count('<tr data-step-id="') == MAX_BOXES
    capped = re.search(r'<p class="error" id="capped">(.*?)</p>', page.text, re.S)
    assert capped is not None
    assert f"{MAX_BOXES} of the {MAX_BOXES + 101} steps are drawn" in capped.group(1)
    assert "101 are not" in capped.group(1)
    assert re.search(r'data-status="waiting">400 waiting<', page.text)  # counts: all read

    # Fewer steps read than the workflow has: the page says so.
    monkeypatch.setattr(dashboard_app, "STEPS_READ", 350)
    page = client.get(f"/workflows/{workflow}")
    assert 'id="truncated"' in page.text
    assert "Only the first 350 steps of the 401 were read" in page.text
    assert re.search(r'data-status="waiting">349 waiting<', page.text)


def test_a_model_without_steps_shows_and_reads_nothing_new(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, session.begin():
        session.add(EmailJob(task="send", queue="mail", args={}))
    sent: list[str] = []

    def record(*args: Any) -> None:
        sent.append(str(args[2]))

    sa.event.listen(queue_engine, "before_cursor_execute", record)
    try:
        with TestClient(create_app(queue_engine, EmailJob)) as client:
            for path in ("/", "/jobs", "/activity", "/failures"):
                page = client.get(path)
                assert page.status_code == 200, path
                assert "nav-workflows" not in page.text
                assert "workflow" not in page.text
            assert '<option value="waiting"' not in client.get("/jobs").text
            assert client.get("/workflows").status_code == 404
            assert client.get("/workflows/1").status_code == 404
            assert client.get("/jobs?status=waiting").status_code == 400
        collector = GaugeCollector(GaugeCache(queue_engine, EmailJob))
        samples = scrape(collector)
    finally:
        sa.event.remove(queue_engine, "before_cursor_execute", record)
    assert collector._workflows is None
    assert sent
    assert not [sql for sql in sent if "workflow" in sql]
    assert not [name for name, _ in samples if name == "sqla_jobs_workflows"]
    assert not [labels for _, labels in samples if ("status", "waiting") in labels]
    pending = (("queue", OTHER), ("status", "pending"), ("table", "email_jobs"))
    assert samples[("sqla_jobs_queue_jobs", pending)] == 1


# -- the metrics ---------------------------------------------------------------------------


def scrape(collector: GaugeCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_metrics_count_workflows_and_waiting_steps(
    queue_engine: sa.Engine, flows: Flows
) -> None:
    collector = GaugeCollector(
        GaugeCache(queue_engine, OrderJob), LabelValues(queues={"orders", "done"})
    )
    samples = scrape(collector)
    assert samples[("sqla_jobs_gauges_up", ())] == 1
    workflows = {
        dict(labels)["status"]: value
        for (name, labels), value in samples.items()
        if name == "sqla_jobs_workflows"
    }
    assert workflows == {"running": 2, "succeeded": 1, "failed": 0, "cancelled": 0}
    assert {
        dict(labels)["table"] for (name, labels) in samples if name == "sqla_jobs_workflows"
    } == {OrderWorkflow.__tablename__}
    jobs = {
        (dict(labels)["queue"], dict(labels)["status"]): value
        for (name, labels), value in samples.items()
        if name == "sqla_jobs_queue_jobs"
    }
    # Waiting: the new workflow's reserve and ship (orders) and email (mail: not a queue
    # the labels know, so under OTHER); the part-run one has none left.
    assert jobs[("orders", "waiting")] == 2
    assert jobs[(OTHER, "waiting")] == 1
    assert jobs[("orders", "pending")] == 1  # the new workflow's charge
    assert jobs[(OTHER, "running")] == 1  # the part-run workflow's email, in mail
    assert jobs[("orders", "dead")] == 1

    # The counts follow the table: the new workflow cancelled, its waiting steps with it.
    with Session(queue_engine) as session, session.begin():
        sqla_jobs.cancel_workflow(session, OrderJob, flows.new)
    collector = GaugeCollector(
        GaugeCache(queue_engine, OrderJob), LabelValues(queues={"orders", "done"})
    )
    samples = scrape(collector)
    cancelled = ("sqla_jobs_workflows", (("status", "cancelled"), ("table", "order_workflows")))
    assert samples[cancelled] == 1
    waiting = [v for (n, labels), v in samples.items() if ("status", "waiting") in labels]
    assert waiting
    assert set(waiting) == {0}


def test_a_failed_workflow_read_takes_the_gauges_down(
    queue_engine: sa.Engine, flows: Flows
) -> None:
    collector = GaugeCollector(GaugeCache(queue_engine, OrderJob))
    reads = collector._workflows
    assert reads is not None

    def broken(connection: sa.Connection) -> Any:
        raise RuntimeError("no workflow table here")

    reads._read = broken
    samples = scrape(collector)
    assert samples[("sqla_jobs_gauges_up", ())] == 0
    assert not [name for name, _ in samples if name == "sqla_jobs_workflows"]
    assert (
        "sqla_jobs_queue_jobs",
        (("queue", OTHER), ("status", "pending"), ("table", "order_jobs")),
    ) in samples


# -- the layout, without a database --------------------------------------------------------


def row(step_id: int, *depends_on: int, status: str = "waiting") -> WorkflowStepRow:
    return WorkflowStepRow(
        step_id, f"s{step_id}", "t", "q", status, 0, 3, list(depends_on) or None, None, None, None
    )


def test_depth_is_the_longest_path_from_a_root_whatever_the_ids() -> None:
    # 5 was added at run time and 2 waits for it too (then): 2 is right of 5.
    steps = [row(1), row(2, 1, 5), row(3, 2), row(4, 1), row(5, 4)]
    assert depths(steps) == {1: 0, 4: 1, 5: 2, 2: 3, 3: 4}
    # A dependency not read is ignored; a cycle (never made by sqla_jobs) does not hang.
    assert depths([row(7, 6), row(8, 7)]) == {7: 0, 8: 1}
    assert depths([row(1), row(2, 3), row(3, 2)]) == {1: 0, 2: 1, 3: 1}
    graph = layout(steps)
    assert [b.step.id for b in graph.boxes] == [1, 4, 5, 2, 3]
    assert graph.columns == 5
    assert graph.hidden == 0
    assert len(graph.edges) == 5
    assert all(
        b.x < c.x
        for e in graph.edges
        for b in graph.boxes
        for c in graph.boxes
        if b.step.id == e.source and c.step.id == e.target
    )  # every edge points right


# -- what the reads cost, on a seeded table ------------------------------------------------

FLOWS = 20_000  # workflows of 4 steps; the newest 1% running
SCAN = 2_000


@pytest.fixture(scope="module")
def many_flows(fresh_database: FreshDatabase) -> Iterator[sa.Engine]:
    engine = sa.create_engine(fresh_database("sqla_jobs_flowplan"), poolclass=NullPool)
    Base.metadata.create_all(engine)
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                """
                INSERT INTO order_workflows (id, name, status, steps_total, steps_left,
                                             created_at, finished_at)
                SELECT g, 'order ' || g, CASE WHEN running THEN 'running' ELSE 'succeeded' END,
                       4, CASE WHEN running THEN 3 ELSE 0 END, now(),
                       CASE WHEN NOT running THEN now() - (:n - g) * interval '1 second' END
                FROM generate_series(1, :n) AS g, LATERAL (SELECT g > :n * 0.99) AS r(running)
                """
            ),
            {"n": FLOWS},
        )
        connection.execute(
            sa.text(
                """
                INSERT INTO order_jobs (id, task, queue, args, status, workflow_id, step,
                                        depends_on, waiting_for, finished_at)
                SELECT w * 4 + s, 'task', 'q', '{}',
                       CASE WHEN NOT running THEN 'succeeded'
                            WHEN s = 0 THEN 'running' ELSE 'waiting' END,
                       w, 'step' || s, CASE WHEN s > 0 THEN ARRAY[w * 4::bigint] END,
                       CASE WHEN running AND s > 0 THEN 1 END,
                       CASE WHEN NOT running THEN now() END
                FROM generate_series(1, :n) AS w, generate_series(0, 3) AS s,
                     LATERAL (SELECT w > :n * 0.99) AS r(running)
                """
            ),
            {"n": FLOWS},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text("VACUUM ANALYZE order_workflows, order_jobs"))
    try:
        yield engine
    finally:
        engine.dispose()


def relations(plan: dict[str, Any]) -> dict[str, set[str]]:
    """Each table the plan reads, with how: its indexes, or "Seq Scan"."""
    found: dict[str, set[str]] = {}
    for node in plan_nodes(plan["Plan"]):
        if "Relation Name" not in node:
            continue
        how = found.setdefault(node["Relation Name"], set())
        if node["Node Type"] == "Bitmap Heap Scan":  # its index is in the node below
            how |= {n["Index Name"] for n in plan_nodes(node) if "Index Name" in n}
        else:
            how.add(node.get("Index Name", node["Node Type"]))
    return found


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_the_workflow_reads_keep_to_their_indexes(many_flows: sa.Engine, generic: bool) -> None:
    jobs = cast(sa.Table, OrderJob.__table__)
    flows = cast(sa.Table, OrderWorkflow.__table__)
    newest = FLOWS
    reads = {
        "running": Read("running", statements.running_workflows(flows, scan=SCAN, limit=51), {}),
        "finished": Read("finished", statements.finished_workflows(flows, limit=50), {}),
        "record": Read("record", statements.workflow(flows), {"flow_id": newest}),
        "graph": Read("graph", statements.workflow_graph(jobs, limit=10_000), {"flow_id": newest}),
        "gauges": Read("gauges", statements.workflow_gauges(jobs, workflow=flows), {}),
    }
    with many_flows.begin() as connection:
        plans = {name: explain(connection, read, generic=generic) for name, read in reads.items()}
    figures = {name: summary(plan) for name, plan in plans.items()}
    read = {name: relations(plan) for name, plan in plans.items()}
    assert read["running"] == {"order_workflows": {"order_workflows_pkey"}}
    assert figures["running"]["scanned_rows"] <= SCAN
    assert read["finished"] == {"order_workflows": {"order_workflows_finished_idx"}}
    assert figures["finished"]["scanned_rows"] <= 50
    assert read["record"] == {"order_workflows": {"order_workflows_pkey"}}
    # A workflow's steps: the step index only, never the primary key or the table.
    assert read["graph"] == {"order_jobs": {"order_jobs_step_idx"}}
    assert figures["graph"]["scanned_rows"] == 4
    # The gauges: the workflow table once (it has no index on status), and the steps of
    # the running workflows (200 of them, 4 steps each) through the step index.
    assert read["gauges"]["order_jobs"] == {"order_jobs_step_idx"}
    assert read["gauges"]["order_workflows"] <= {"Seq Scan", "Parallel Seq Scan"}
    step_rows = [
        node["Actual Rows"] * node.get("Actual Loops", 1)
        for node in plan_nodes(plans["gauges"]["Plan"])
        if node.get("Relation Name") == "order_jobs"
    ]
    assert sum(step_rows) <= FLOWS // 100 * 4
