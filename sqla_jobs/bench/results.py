"""What a run is asked to measure (:class:`Config`) and what it measured (:class:`Results`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = ["SECTIONS", "SWEEP", "Config", "Metric", "Results"]

SECTIONS: Final = (
    "ceiling",
    "enqueue",
    "drain",
    "latency",
    "history",
    "hot",
    "memory",
    "pgbouncer",
    "async",
    "keys",
    "fair",
    "workflows",
    "baseline",
    "processes",
    "shape",
)

#: The batch sizes the ceiling's plain loops are measured at; the best is the ceiling.
SWEEP: Final = (1, 10, 50, 100, 200, 500)


@dataclass
class Config:
    url: str
    jobs: int = 20_000
    single_jobs: int = 2_000
    history_rows: int = 1_000_000
    memory_jobs: int = 1_000_000
    memory_base_jobs: int = 50_000
    repeat: int = 3
    #: The batched drains' worker: Worker(concurrency=...) and nothing else (its defaults).
    concurrency: int = 200
    #: The batch size of the history section's library claim loop.
    batch: int = 50
    sweep: tuple[int, ...] = SWEEP
    #: The largest batch the sweep grows to past ``sweep`` (while the rate rises).
    sweep_max: int = 16_000
    chunk: int = 1_000
    latency_samples: int = 200
    sections: tuple[str, ...] = SECTIONS
    #: The checkout the ``baseline`` section compares this version with.
    baseline: Path | None = None


@dataclass
class Metric:
    name: str
    unit: str
    runs: list[float] = field(default_factory=list)
    ceiling: str | None = None
    higher_is_better: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None


class Results:
    def __init__(self) -> None:
        self.metrics: dict[str, Metric] = {}
        self.skipped: dict[str, str] = {}  # section -> why it was not measured

    def add(self, name: str, value: float, unit: str, ceiling: str | None = None) -> Metric:
        metric = self.metrics.setdefault(name, Metric(name, unit, ceiling=ceiling))
        metric.runs.append(value)
        return metric

    def add_cpu(self, name: str, value: float | None, ceiling: str | None = None) -> Metric | None:
        """A CPU-per-job figure (microseconds, lower is better; :mod:`sqla_jobs.bench.cpu`),
        when there is one: None, not measured (the server not on this machine, a drain too
        short to count), adds nothing."""
        if value is None:
            return None
        metric = self.add(name, value, "us/job", ceiling)
        metric.higher_is_better = False
        return metric

    def median(self, name: str) -> float | None:
        metric = self.metrics.get(name)
        return None if metric is None else metric.median

    def ratio(self, name: str) -> float | None:
        metric = self.metrics.get(name)
        if metric is None or metric.ceiling is None:
            return None
        value, ceiling = metric.median, self.median(metric.ceiling)
        if value is None or not ceiling:
            return None
        return value / ceiling
