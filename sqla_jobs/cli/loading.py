"""What a command names by ``module:attribute``: the registry and the job model."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Final

from sqla_jobs.cli.arguments import CommandError
from sqla_jobs.events import describe
from sqla_jobs.registry import Registry
from sqla_jobs.schema import JobMixin

DEFAULT_MODEL: Final = "sqla_jobs.models:Job"


def load_object(target: str, what: str) -> Any:
    """Import ``module:attribute`` (the attribute may be dotted), with the current
    directory importable as ``python -m`` would have it (``sqla-jobs worker app:registry``
    run next to ``app.py``)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise CommandError(f"{what} must look like module:name, not {target!r}")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise CommandError(
                f"cannot import {module_name!r}: no module named {exc.name!r} "
                "(is it in the current directory or on PYTHONPATH?)"
            ) from exc
        raise CommandError(f"importing {module_name!r} failed: {describe(exc)}") from exc
    except Exception as exc:
        raise CommandError(
            f"importing {module_name!r} failed: {type(exc).__name__}: {describe(exc)}"
        ) from exc
    missing = object()
    for part in attribute.split("."):
        obj = getattr(obj, part, missing)
        if obj is missing:
            raise CommandError(f"module {module_name!r} has no {attribute!r}")
    return obj


def load_registry(target: str) -> Registry:
    registry = load_object(target, "the registry")
    if not isinstance(registry, Registry):
        raise CommandError(f"{target} is a {type(registry).__name__}, not a sqla_jobs Registry")
    return registry


def load_model(args: argparse.Namespace) -> type[JobMixin]:
    if getattr(args, "registry", None):
        return load_registry(args.registry).model
    target = getattr(args, "model", None) or DEFAULT_MODEL
    model = load_object(target, "the model")
    if not (isinstance(model, type) and issubclass(model, JobMixin)):
        raise CommandError(f"{target} is not a model class that mixes in JobMixin")
    return model
