"""The worker's settings: five groups, each setting's default and check written once on its
field (sqla_jobs/worker/settings.py), given whole or flat, refused before any SQL."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import worker_tasks
from no_sql import no_sql

from sqla_jobs import (
    ClaimSettings,
    ConfigurationError,
    MaintenanceSettings,
    ObservabilitySettings,
    SessionSettings,
    TimingSettings,
    Worker,
    WorkerOptions,
    cli,
)
from sqla_jobs.worker.settings import GROUPS, HOMES, WorkerSettings

registry = worker_tasks.registry


@pytest.fixture
def engine() -> Iterator[sa.Engine]:
    # An engine that cannot connect: every check must come before the first connection.
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    try:
        with no_sql(engine):
            yield engine
    finally:
        engine.dispose()


def test_the_flat_keywords_are_exactly_the_groups_fields_with_their_types() -> None:
    flat = {name: ref.__forward_arg__ for name, ref in WorkerOptions.__annotations__.items()}
    fields = {f.name: f.type for group in GROUPS.values() for f in dataclasses.fields(group)}
    assert flat == fields
    assert list(HOMES) == list(flat)  # the TypedDict lists them group by group, in order
    assert WorkerOptions.__required_keys__ == frozenset()


def test_a_worker_given_nothing_has_each_groups_own_defaults(engine: sa.Engine) -> None:
    worker = Worker(registry, engine)
    assert worker.settings == WorkerSettings(
        ClaimSettings(), TimingSettings(), ObservabilitySettings(), SessionSettings(),
        MaintenanceSettings(),
    )  # fmt: skip
    assert (worker.concurrency, worker.poll_interval, worker.grace) == (4, 1.0, 30.0)
    assert (worker.batch_size, worker.stuck_after, worker.lock_timeout) == (500, 30.0, 5.0)
    assert worker.queues == registry.queues


def test_flat_keywords_and_groups_are_the_same_settings(engine: sa.Engine, tmp_path: Path) -> None:
    flat = Worker(
        registry,
        engine,
        queues=["work", "work", "other"],
        concurrency=8,
        grace=2,
        health_file=str(tmp_path / "h"),
        history_retention=3600,
    )
    grouped = Worker(
        registry,
        engine,
        claiming=ClaimSettings(queues=("work", "other"), concurrency=8),
        timing=TimingSettings(grace=2),
        observability=ObservabilitySettings(health_file=tmp_path / "h"),
        maintenance=MaintenanceSettings(history_retention=timedelta(hours=1)),
    )
    assert flat.settings == grouped.settings
    assert flat.settings.claiming.queues == ("work", "other")
    assert flat.queues == ["work", "other"]
    assert flat.settings.maintenance.retention == timedelta(hours=1)
    assert flat.health_file == tmp_path / "h"
    # One group given whole, another's fields flat: each from its own place.
    mixed = Worker(registry, engine, timing=TimingSettings(grace=2), concurrency=8)
    assert (mixed.grace, mixed.concurrency) == (2, 8)


def test_derived_defaults_follow_the_settings_they_depend_on(engine: sa.Engine) -> None:
    worker = Worker(registry, engine, concurrency=800, poll_interval=20)
    assert worker.batch_size == 800  # the concurrency when larger than 500
    assert worker.stuck_after == 60.0  # three poll intervals when longer than 30 s
    assert Worker(registry, engine, poll_interval=0).poll_interval == 0.01


BAD: list[tuple[str, object, str]] = [
    ("queues", "work", "queues must be a list"),
    ("queues", ["bad queue"], "queues"),
    ("queues", [7], "queues"),
    ("concurrency", 0, "concurrency must be a positive integer"),
    ("concurrency", 2.5, "concurrency must be a positive integer"),
    ("concurrency", True, "concurrency must be a positive integer"),
    ("batch_size", 0, r"batch_size must be an integer in \[1, "),
    ("prefetch", -1, r"prefetch must be an integer in \[0, 10000\]"),
    ("poll_interval", -1, "poll_interval must not be negative"),
    ("poll_interval", "1s", "poll_interval must be a number of seconds"),
    ("listen", "yes", "listen must be True or False"),
    ("listen_engine", "postgresql://x@y/z", "listen_engine must be a sync SQLAlchemy Engine"),
    ("pooler", "pgbouncer", "pooler must be one of"),
    ("processes", 0, r"processes must be an integer in \[1, concurrency=4\]"),
    ("grace", float("nan"), "grace must not be negative"),
    ("stuck_after", 0, "stuck_after must be positive"),
    ("lock_timeout", 0, r"lock_timeout must be in \(0, 3600\) seconds"),
    ("lock_timeout", 3600, r"lock_timeout must be in \(0, 3600\) seconds"),
    ("synchronous_commit", None, "synchronous_commit must be True or False"),
    ("name", 7, "name must be a string"),
    ("health_file", 7, "health_file must be a path"),
    ("metrics_port", 65536, r"metrics_port must be an integer in \[0, 65535\]"),
    ("session_factory", "sessionmaker", "session_factory must be callable"),
    ("async_session_factory", 1, "async_session_factory must be callable"),
    ("scheduler", 1, "scheduler must be True or False"),
    ("history_retention", -1, "history_retention"),
    ("history_every", 0, "history_every must be positive"),
    ("history_partitions", "no", "history_partitions must be True or False"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD)
def test_a_bad_setting_is_refused_flat_or_grouped_before_any_sql(
    engine: sa.Engine, name: str, value: object, message: str
) -> None:
    group = GROUPS[HOMES[name]]
    with pytest.raises(ConfigurationError, match=message):
        group(**{name: value})
    options: dict[str, Any] = {name: value}
    with pytest.raises(ConfigurationError, match=message):
        Worker(registry, engine, **options)


def test_every_setting_has_a_bad_value_tested() -> None:
    assert {name for name, _, _ in BAD} | {"metrics_host", "metrics_max_age"} == (set(HOMES))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"metrics_port": 0, "metrics_host": ""}, "metrics_host must be"),
        ({"metrics_port": 0, "metrics_max_age": 0}, "metrics_max_age must be in"),
        (
            {"history_retention": 60, "history_partitions": False},
            "history_retention drops partitions",
        ),
    ],
)
def test_settings_that_go_together_are_checked_together(
    engine: sa.Engine, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Worker(registry, engine, **options)


def test_a_setting_no_group_has_is_refused_with_a_hint(engine: sa.Engine) -> None:
    with pytest.raises(ConfigurationError, match=r"no setting 'concurency' .*'concurrency'"):
        Worker(registry, engine, concurency=8)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match=r"no setting 'queue' .*'queues'"):
        Worker(registry, engine, queue="work")  # type: ignore[call-arg]


def test_a_group_given_whole_and_flat_is_refused(engine: sa.Engine) -> None:
    with pytest.raises(ConfigurationError, match=r"concurrency belong to claiming=ClaimSettings"):
        Worker(registry, engine, claiming=ClaimSettings(queues=["work"]), concurrency=8)


def test_a_group_of_the_wrong_kind_is_refused(engine: sa.Engine) -> None:
    with pytest.raises(ConfigurationError, match="timing must be a TimingSettings"):
        Worker(registry, engine, timing={"grace": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="timing must be a TimingSettings"):
        Worker(registry, engine, timing=ClaimSettings())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="expected a SQLAlchemy Engine"):
        Worker(registry, "postgresql://x@y/z")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="handle_signals must be"):
        Worker(registry, engine, handle_signals="yes")  # type: ignore[arg-type]


def test_a_group_is_frozen_and_keyword_only() -> None:
    claiming = ClaimSettings(concurrency=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        claiming.concurrency = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ClaimSettings(None, 2)  # type: ignore[call-arg]
    assert dataclasses.replace(claiming, batch_size=10).largest_claim == 10


def test_the_worker_signature_names_the_groups() -> None:
    parameters = inspect.signature(Worker).parameters
    assert [name for name in parameters if name in GROUPS] == list(GROUPS)
    assert parameters["settings"].kind is inspect.Parameter.VAR_KEYWORD


def test_the_command_line_leaves_the_defaults_to_the_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = cli.build_parser().parse_args(["worker", "worker_tasks:registry"])
    for option in ("concurrency", "poll_interval", "grace", "lock_timeout", "metrics_host"):
        assert getattr(args, option) is None, option
    with pytest.raises(SystemExit):
        cli.main(["worker", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default {ClaimSettings.concurrency})" in help_text
    assert f"({TimingSettings.grace:g}s)" in help_text


def test_the_command_line_refuses_a_bad_setting_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = cli.main(
        [
            "worker",
            "worker_tasks:registry",
            "--database-url",
            "postgresql+psycopg://nobody@127.0.0.1:1/none",
            "--lock-timeout",
            "2h",
        ]
    )
    assert status != 0
    assert "lock_timeout must be in (0, 3600) seconds" in capsys.readouterr().err
