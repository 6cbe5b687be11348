"""Fair shares made visible (issue 24): how deep each tenant of a fairly shared queue is,
read from its fair index (``sqla_jobs.tenant_depths``), in the health gauges, the metrics
(``sqla_jobs_queue_tenants``, ``sqla_jobs_queue_tenant_pending`` for the deepest tenants
only), ``sqla-jobs status`` and the dashboard; exact counts from known jobs, the plan (an
index-only scan of the fair index, whatever the history), and bad input refused before any
SQL."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FreshDatabase
from in_process import enqueue
from models import EmailJob, Order, TenantJob
from no_sql import no_sql
from plans import explain_rolled_back, plan_nodes
from sqlalchemy import Uuid
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sqla_jobs
from sqla_jobs import FairShare, JobMixin, Registry, TenantDepths, cli
from sqla_jobs._queries.fair import tenant_depths as tenant_depths_statement
from sqla_jobs.errors import ConfigurationError, InvalidJobError
from sqla_jobs.health import GaugeCache, read_gauges
from sqla_jobs.queue.rating import MAX_TENANT_TEXT, NO_TENANT, tenant_text
from sqla_jobs.schema.fair import fair_index, fair_index_name

#: "default" is shared by tenant and has jobs; "empty" is shared and has none.
FAIR = {"default": FairShare("tenant"), "empty": FairShare("tenant")}
#: The registry ``sqla-jobs status --registry`` loads (this module, imported by name).
REGISTRY = Registry(TenantJob, fair_shares=FAIR)
#: The pending jobs without an ordering key of "default" that :func:`seed` adds, by tenant.
DEPTHS = {"acme": 5, "beta": 2, None: 1, "gamma": 1}


def insert(engine: sa.Engine, sql: str, **params: Any) -> None:
    with engine.begin() as connection:
        connection.execute(sa.text(sql), params)


def seed(engine: sa.Engine) -> None:
    """Known jobs: in "default", the pending jobs of :data:`DEPTHS` (5 of acme, 2 of beta,
    1 of gamma, 1 without a tenant), and beside them jobs that are not counted: running,
    succeeded and dead ones of those tenants and of another, pending jobs with an ordering
    key, and pending jobs of another queue."""
    enqueue(
        engine,
        *(
            TenantJob(task="t", tenant=tenant)
            for tenant, count in DEPTHS.items()
            for _ in range(count)
        ),
        TenantJob(task="t", tenant="delta", ordering_key="k"),
        TenantJob(task="t", tenant="acme", ordering_key="k"),
        TenantJob(task="t", tenant="acme", queue="other"),
        TenantJob(task="t", tenant="omega", queue="other"),
    )
    insert(
        engine,
        "INSERT INTO tenant_jobs (queue, task, tenant, status, attempts, lease_expires_at) "
        "VALUES ('default', 't', 'acme', 'running', 1, now() + interval '1 hour'), "
        "('default', 't', 'zeta', 'running', 1, now() + interval '1 hour')",
    )
    insert(
        engine,
        "INSERT INTO tenant_jobs (queue, task, tenant, status, attempts, finished_at) "
        "VALUES ('default', 't', 'gamma', 'succeeded', 1, now()), "
        "('default', 't', 'zeta', 'succeeded', 1, now()), "
        "('default', 't', 'zeta', 'dead', 1, now())",
    )


@pytest.fixture
def seeded(queue_engine: sa.Engine) -> sa.Engine:
    seed(queue_engine)
    return queue_engine


def depths_of(engine: sa.Engine, **options: Any) -> dict[str, TenantDepths]:
    with Session(engine) as session:
        return {d.queue: d for d in sqla_jobs.tenant_depths(session, TenantJob, FAIR, **options)}


# -- tenant_depths ----------------------------------------------------------------------------


def test_tenant_depths_counts_the_pending_jobs_without_a_key_by_tenant(seeded: sa.Engine) -> None:
    depths = depths_of(seeded)
    assert list(depths) == ["default", "empty"]  # by name; the empty queue is listed too
    assert depths["default"] == TenantDepths(
        queue="default",
        column="tenant",
        tenants=4,
        pending=9,
        # Most first; a tie in the column's order, NULL (the jobs without a tenant) first.
        deepest=(("acme", 5), ("beta", 2), (None, 1), ("gamma", 1)),
    )
    assert depths["default"].deepest_pending == 5
    assert depths["empty"] == TenantDepths("empty", "tenant", tenants=0, pending=0)
    assert depths["empty"].deepest_pending is None
    # Only the top ones are listed; the totals are the queue's all the same.
    top = depths_of(seeded, top=2)["default"]
    assert (top.tenants, top.pending, top.deepest) == (4, 9, (("acme", 5), ("beta", 2)))
    # From SQL: the counts are those of the pending rows without an ordering key.
    with seeded.connect() as connection:
        rows = connection.execute(
            sa.text(
                "SELECT tenant, count(*) FROM tenant_jobs WHERE queue = 'default' "
                "AND status = 'pending' AND ordering_key IS NULL GROUP BY tenant"
            )
        ).all()
        counted: dict[str | None, int] = {row[0]: row[1] for row in rows}
    assert counted == DEPTHS


def test_tenant_depths_with_no_fair_share_runs_no_sql(queue_engine: sa.Engine) -> None:
    with Session(queue_engine) as session, no_sql(queue_engine):
        assert sqla_jobs.tenant_depths(session, TenantJob, None) == []
        assert sqla_jobs.tenant_depths(session, TenantJob, {}) == []
        assert REGISTRY.fair_shares == FAIR


def test_a_tenant_comes_as_its_column_s_type_reads(
    queue_engine: sa.Engine, fresh_database: FreshDatabase
) -> None:
    # An integer column (EmailJob.order_id, without a fair index: still answered).
    enqueue(queue_engine, Order(id=7, customer="c"), Order(id=8, customer="d"))
    enqueue(queue_engine, *(EmailJob(task="t", order_id=n) for n in (7, 7, 8, 8, 8)))
    with Session(queue_engine) as session:
        (by_order,) = sqla_jobs.tenant_depths(session, EmailJob, {"default": FairShare("order_id")})
    assert (by_order.tenants, by_order.pending, by_order.deepest) == (2, 5, ((8, 3), (7, 2)))
    # A uuid column.
    engine = sa.create_engine(fresh_database("sqla_jobs_fair_uuid"))
    try:
        _UuidBase.metadata.create_all(engine)
        first, second = sorted([uuid.uuid4(), uuid.uuid4()])
        enqueue(engine, *(UuidTenantJob(task="t", tenant=t) for t in (first, second, second)))
        with Session(engine) as session:
            (by_uuid,) = sqla_jobs.tenant_depths(
                session, UuidTenantJob, {"default": FairShare("tenant")}
            )
    finally:
        engine.dispose()
    assert by_uuid.deepest == ((second, 2), (first, 1))
    assert isinstance(by_uuid.deepest[0][0], uuid.UUID)
    assert tenant_text(second) == str(second)


class _UuidBase(DeclarativeBase):
    pass


class UuidTenantJob(JobMixin, _UuidBase):
    """Jobs whose tenant is a uuid, with its fair index."""

    __tablename__ = "uuid_tenant_jobs"

    tenant: Mapped[uuid.UUID | None] = mapped_column(Uuid)


UUID_TENANT_FAIR_INDEX = fair_index(UuidTenantJob, "tenant")


def test_a_tenant_reads_as_text_where_it_is_shown() -> None:
    assert tenant_text(None) == NO_TENANT == "(none)"
    assert tenant_text("acme") == "acme"
    assert tenant_text(42) == "42"
    long = tenant_text("x" * 500)
    assert len(long) == MAX_TENANT_TEXT
    assert long.endswith("...")


@pytest.mark.parametrize(
    ("fair_shares", "top", "says"),
    [
        ([("default", FairShare("tenant"))], 10, "must be a mapping of queue names to FairShare"),
        ({"default": "tenant"}, 10, "must be a FairShare"),
        ({"bad queue!": FairShare("tenant")}, 10, "'bad queue!' is malformed"),
        ({"default": FairShare("customer")}, 10, "by column 'customer', which tenant_jobs has not"),
        ({"default": FairShare("queue")}, 10, "cannot share by 'queue'"),
        (FAIR, 0, r"top: must be an integer in \[1, 1000\]"),
        (FAIR, 1001, r"top: must be an integer in \[1, 1000\]"),
        (FAIR, True, "top"),
    ],
)
def test_bad_input_is_refused_before_any_sql(
    queue_engine: sa.Engine, fair_shares: Any, top: Any, says: str
) -> None:
    with Session(queue_engine) as session, no_sql(queue_engine):
        with pytest.raises(InvalidJobError, match=says):
            sqla_jobs.tenant_depths(session, TenantJob, fair_shares, top=top)
        if top == 10:
            with pytest.raises(InvalidJobError, match=says):
                read_gauges(session, TenantJob, fair_shares=fair_shares)
    if top == 10:  # settings: a ConfigurationError where they are given
        with pytest.raises(ConfigurationError, match=f"fair_shares: .*{says}"):
            GaugeCache(queue_engine, TenantJob, fair_shares=fair_shares)
        pytest.importorskip("starlette", reason="the dashboard extra")
        from sqla_jobs.dashboard import create_app

        with pytest.raises(ConfigurationError, match=f"fair_shares: .*{says}"):
            create_app(queue_engine, TenantJob, fair_shares=fair_shares)


# -- the plan: the fair index only, whatever the history --------------------------------------

HISTORY = 50_000


@pytest.fixture
def history(seeded: sa.Engine) -> sa.Engine:
    insert(
        seeded,
        "INSERT INTO tenant_jobs (queue, task, tenant, status, attempts, finished_at) "
        "SELECT 'default', 'done', 't' || (n % 100), 'succeeded', 1, now() "
        "FROM generate_series(1, :n) AS n",
        n=HISTORY,
    )
    with seeded.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text("VACUUM ANALYZE tenant_jobs"))
    return seeded


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_tenant_depths_reads_the_fair_index_only(history: sa.Engine, generic: bool) -> None:
    table: sa.Table = TenantJob.__table__  # type: ignore[assignment]
    compiled = tenant_depths_statement(table, column="tenant").compile(dialect=history.dialect)
    params = {"queue_name": "default", "top": 10}
    plan = explain_rolled_back(history, str(compiled), params, generic=generic)
    nodes = list(plan_nodes(plan["Plan"]))
    on_table = [n for n in nodes if n.get("Relation Name") == "tenant_jobs"]
    scans = {(n["Node Type"], n.get("Index Name")) for n in on_table}
    assert scans == {("Index Only Scan", fair_index_name("tenant_jobs", "tenant"))}, json.dumps(
        plan
    )
    assert all(n.get("Heap Fetches", 0) == 0 for n in on_table), json.dumps(plan)
    # A few pages, not the history's hundreds.
    assert plan["Plan"]["Shared Hit Blocks"] + plan["Plan"].get("Shared Read Blocks", 0) < 20
    (top,) = [n for n in nodes if n["Node Type"] == "Limit"]
    assert top["Actual Rows"] == 4  # the tenants of the pending jobs, none of the history's


# -- the health gauges ------------------------------------------------------------------------


def test_the_gauges_carry_each_fair_queue_s_tenants(seeded: sa.Engine) -> None:
    with Session(seeded) as session:
        gauges = {q.queue: q for q in read_gauges(session, TenantJob, fair_shares=FAIR).queues}
        plain = {q.queue: q for q in read_gauges(session, TenantJob).queues}
    default = gauges["default"]
    assert (default.pending, default.fair_column, default.fair_tenants) == (11, "tenant", 4)
    assert default.fair_deepest_pending == 5
    assert default.fair_deepest == (("acme", 5), ("beta", 2), (None, 1), ("gamma", 1))
    empty = gauges["empty"]  # shared, no job: listed all the same
    assert (empty.pending, empty.fair_tenants, empty.fair_deepest_pending) == (0, 0, None)
    other = gauges["other"]  # not shared
    assert (other.fair_column, other.fair_tenants, other.fair_deepest_pending) == (
        None,
        None,
        None,
    )
    assert "empty" not in plain
    assert plain["default"].fair_tenants is None
    assert plain["default"].fair_deepest == ()


# -- the metrics ------------------------------------------------------------------------------


def scrape(engine: sa.Engine, known: set[str]) -> dict[tuple[str, ...], float]:
    """The fair-share samples a collector of TenantJob's gauges serves: ``(name, queue)``
    or ``(name, queue, tenant)`` to its value."""
    pytest.importorskip("prometheus_client", reason="the metrics extra")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sqla_jobs.metrics import GaugeCollector, LabelValues

    registry = CollectorRegistry()
    cache = GaugeCache(engine, TenantJob, fair_shares=FAIR)
    registry.register(GaugeCollector(cache, LabelValues(queues=known)))
    text = generate_latest(registry).decode()
    return {
        (sample.name, sample.labels["queue"], *filter(None, [sample.labels.get("tenant")])): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("sqla_jobs_queue_tenant")
    }


def test_the_metrics_export_the_tenants_and_the_deepest_ones(seeded: sa.Engine) -> None:
    assert scrape(seeded, {"default", "empty", "other"}) == {
        ("sqla_jobs_queue_tenants", "default"): 4.0,
        ("sqla_jobs_queue_tenants", "empty"): 0.0,
        ("sqla_jobs_queue_tenant_pending", "default", "acme"): 5.0,
        ("sqla_jobs_queue_tenant_pending", "default", "beta"): 2.0,
        ("sqla_jobs_queue_tenant_pending", "default", NO_TENANT): 1.0,
        ("sqla_jobs_queue_tenant_pending", "default", "gamma"): 1.0,
    }


def test_only_the_deepest_tenants_have_series(queue_engine: sa.Engine) -> None:
    from sqla_jobs.metrics import TOP_TENANTS

    # 25 tenants: tenant n has n + 1 jobs, so the deepest are 24 down to 15.
    enqueue(
        queue_engine,
        *(TenantJob(task="t", tenant=f"t{n:02}") for n in range(25) for _ in range(n + 1)),
    )
    samples = scrape(queue_engine, {"default", "empty"})
    assert samples[("sqla_jobs_queue_tenants", "default")] == 25.0
    deepest = {
        key[2]: value for key, value in samples.items() if key[0].endswith("_tenant_pending")
    }
    assert len(deepest) == TOP_TENANTS == 10
    assert deepest == {f"t{n:02}": float(n + 1) for n in range(15, 25)}


# -- sqla-jobs status -------------------------------------------------------------------------


@pytest.mark.usefixtures("restore_root_logging")
def test_status_says_each_fair_queue_s_tenants(
    seeded: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    insert(
        seeded,
        "INSERT INTO tenant_jobs (queue, task, tenant) "
        "SELECT 'default', 't', 'acme' FROM generate_series(1, 1195)",
    )
    url = seeded.url.render_as_string(hide_password=False)
    common = ["status", "--database-url", url]
    assert cli.main([*common, "--registry", "test_fair_visibility:REGISTRY"]) == 0
    out = capsys.readouterr().out
    assert (
        "fair shares of default: by tenant, 4 tenants with pending jobs; "
        "deepest acme 1,200, beta 2, (none) 1\n"
    ) in out
    assert "fair shares of empty: by tenant, no pending jobs\n" in out
    assert "fair shares of other" not in out
    # With the model only, no fair share is known: no such line.
    assert cli.main([*common, "--model", "models:TenantJob"]) == 0
    assert "fair shares" not in capsys.readouterr().out


# -- the dashboard ----------------------------------------------------------------------------


def fair_cell(page: str, queue: str) -> str:
    row = re.search(rf'<tr data-queue="{queue}">(.*?)</tr>', page, re.S)
    assert row is not None, page
    cell = re.search(r'<td class="fair">(.*?)</td>', row.group(1), re.S)
    assert cell is not None, row.group(1)
    return cell.group(1)


def test_the_dashboard_shows_each_fair_queue_s_tenants(seeded: sa.Engine) -> None:
    pytest.importorskip("starlette", reason="the dashboard extra")
    from starlette.testclient import TestClient

    from sqla_jobs.dashboard import create_app

    enqueue(seeded, TenantJob(task="t", tenant="<b>bold</b>", queue="odd"))
    shares = {**FAIR, "odd": FairShare("tenant")}
    with TestClient(create_app(seeded, TenantJob, fair_shares=shares)) as client:
        page = client.get("/").text
    default = fair_cell(page, "default")
    assert "4 tenants</span>" in default
    assert 'title="tenants with pending jobs, by tenant"' in default
    shown = re.sub(r"<[^>]+>", "", default)
    # The 3 deepest only.
    assert shown == "4 tenants; deepest acme 5, beta 2, (none) 1"
    assert fair_cell(page, "empty") == '<span class="muted">by tenant: no pending jobs</span>'
    assert '<span class="tenant">&lt;b&gt;bold&lt;/b&gt;</span> 1' in fair_cell(page, "odd")
    assert fair_cell(page, "other") == ""  # not shared
    with TestClient(create_app(seeded, TenantJob)) as client:
        page = client.get("/").text
    assert fair_cell(page, "default") == ""
    assert 'data-queue="empty"' not in page


@pytest.mark.usefixtures("restore_root_logging")
def test_the_dashboard_command_takes_the_registry_s_fair_shares(
    seeded: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("starlette", reason="the dashboard extra")
    uvicorn = pytest.importorskip("uvicorn", reason="the dashboard extra")
    from starlette.testclient import TestClient

    pages: list[str] = []

    def serve(app: Any, **_: Any) -> None:
        # What uvicorn would serve, asked for while the command holds its engine.
        with TestClient(app, base_url="http://127.0.0.1") as client:  # a loopback name
            pages.append(client.get("/").text)

    monkeypatch.setattr(uvicorn, "run", serve)
    url = seeded.url.render_as_string(hide_password=False)
    command = ["dashboard", "--database-url", url, "--registry", "test_fair_visibility:REGISTRY"]
    assert cli.main(command) == 0
    (page,) = pages
    assert re.sub(r"<[^>]+>", "", fair_cell(page, "default")).startswith("4 tenants; deepest")
