"""A task's options are declared once (sqla_jobs.registry.TaskOptions), taken by every
signature that registers a task, defaulted by the registry and checked before any SQL."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import pytest
from worker_tasks import WorkerJob

from sqla_jobs import ConfigurationError, Registry, RetryPolicy, Task, TaskOptions


def noop(ctx: Any) -> None:  # pragma: no cover
    pass


@pytest.mark.parametrize("signature", [Registry.task, Registry.add, Task.__init__])
def test_every_signature_that_registers_a_task_takes_the_one_declaration(signature: Any) -> None:
    options = inspect.signature(signature).parameters["options"]
    assert options.kind is inspect.Parameter.VAR_KEYWORD
    assert options.annotation == "Unpack[TaskOptions]"


def test_options_left_out_take_the_registrys_defaults() -> None:
    retry = RetryPolicy(base=timedelta(seconds=1))
    registry = Registry(
        WorkerJob,
        default_queue="slow",
        default_max_attempts=3,
        default_lease=90,
        default_retry=retry,
        default_mode="lock",
    )
    task = registry.add(noop)
    assert (task.name, task.queue, task.max_attempts, task.mode, task.priority) == (
        "noop",
        "slow",
        3,
        "lock",
        0,
    )
    assert (task.lease, task.retry, task.schedule, task.key_limit) == (
        timedelta(seconds=90),
        retry,
        None,
        None,
    )
    # None is "left out" too, so that a caller may pass its own optional values along.
    options: TaskOptions = {"name": "again", "queue": None, "lease": None, "priority": None}
    assert registry.add(noop, **options).queue == "slow"


def test_options_given_are_kept() -> None:
    registry = Registry(WorkerJob)

    @registry.task(queue="fast", max_attempts=2, mode="lock", lease=5, priority=-3, key_limit=2)
    def charge(ctx: Any) -> None:  # pragma: no cover
        pass

    assert (charge.queue, charge.max_attempts, charge.mode) == ("fast", 2, "lock")
    assert (charge.lease, charge.priority, charge.key_limit) == (timedelta(seconds=5), -3, 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"name": "bad name"}, "name"),
        ({"queue": "bad queue"}, "queue"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"mode": "sometimes"}, "mode must be 'lease' or 'lock'"),
        ({"lease": -1}, "lease must be positive"),
        ({"priority": "high"}, "priority"),
        ({"priority": False}, "priority"),
        ({"schedule": "* * * * *"}, "schedule must be a sqla_jobs.Schedule"),
        ({"key_limit": 0}, "key_limit"),
    ],
)
def test_a_bad_option_is_refused_by_each_way_in(options: dict[str, Any], message: str) -> None:
    registry = Registry(WorkerJob)
    with pytest.raises(ConfigurationError, match=message):
        registry.add(noop, **options)
    with pytest.raises(ConfigurationError, match=message):
        registry.task(**options)(noop)
    assert len(registry) == 0


@pytest.mark.parametrize(
    ("defaults", "message"),
    [
        ({"default_queue": ""}, "default_queue must not be empty"),
        ({"default_max_attempts": 0}, "default_max_attempts"),
        ({"default_lease": 0}, "default_lease must be positive"),
        ({"default_mode": "always"}, "mode must be 'lease' or 'lock'"),
    ],
)
def test_a_bad_registry_default_is_refused(defaults: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Registry(WorkerJob, **defaults)


def test_an_option_no_task_has_is_refused_at_once_with_a_hint() -> None:
    registry = Registry(WorkerJob)
    with pytest.raises(ConfigurationError, match=r"no option 'max_attempt' .*'max_attempts'"):
        registry.task(max_attempt=3)  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="no option 'retries'"):
        registry.add(noop, retries=3)  # type: ignore[call-arg]
    assert len(registry) == 0
