"""The dashboard's pictures: each queue's last hour by minute (jobs finished and failed,
the depth), drawn on the server as inline SVG (no script), and the failing jobs grouped by
task and error.

Every read is bounded (:mod:`sqla_jobs._queries.dashboard`): the minute counts come from
each source's newest window of jobs (the job table, and a partitioned history), the
depth now from the partial indexes (:func:`sqla_jobs.queue_stats`), the failures from the
dead indexes. The depth of an earlier minute is derived, not stored: the jobs not yet
finished now, less those enqueued since, plus those finished since.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from sqlalchemy import Connection

from sqla_jobs import queue
from sqla_jobs._queries import dashboard as statements
from sqla_jobs._queries.dashboard import FAILURES, MINUTE_COUNTS, MINUTES
from sqla_jobs.dashboard.sources import TableSource
from sqla_jobs.schema import JobMixin, JobStatus

__all__ = [
    "Chart",
    "Failure",
    "QueueActivity",
    "depth_series",
    "read_activity",
    "read_failures",
]

#: The charts' size in SVG units (they scale with the page).
WIDTH: Final = 360
HEIGHT: Final = 110
_PAD_TOP: Final = 14  # room for the maximum's label
_PAD_BOTTOM: Final = 16  # room for the time labels
_UNFINISHED: Final = (JobStatus.PENDING, JobStatus.RUNNING)


@dataclass
class QueueActivity:
    """One queue's last hour, :data:`~sqla_jobs._queries.dashboard.MINUTES` minutes, oldest
    first (the last one is the current, partial minute)."""

    queue: str
    succeeded: list[int] = field(default_factory=lambda: [0] * MINUTES)
    dead: list[int] = field(default_factory=lambda: [0] * MINUTES)
    finished: list[int] = field(default_factory=lambda: [0] * MINUTES)
    enqueued: list[int] = field(default_factory=lambda: [0] * MINUTES)
    unfinished_now: int = 0

    @property
    def depth(self) -> list[int]:
        """Jobs not finished (pending or running) at the end of each minute."""
        return depth_series(self.unfinished_now, self.enqueued, self.finished)

    @property
    def throughput(self) -> Chart:
        """Succeeded and dead jobs per minute, as stacked bars."""
        return Chart.bars(self.succeeded, self.dead)

    @property
    def depth_chart(self) -> Chart:
        """The depth, as a line over a filled area."""
        return Chart.line(self.depth)


def depth_series(now: int, enqueued: Sequence[int], finished: Sequence[int]) -> list[int]:
    """The jobs not finished at the end of each minute, from the count ``now`` (the end of
    the last minute) back: a minute's end had the next minute's end's jobs, less those
    enqueued in the next minute, plus those finished in it. Never below 0 (the counts
    are lower bounds on a busy table)."""
    depth = [0] * len(enqueued)
    level = now
    for minute in range(len(enqueued) - 1, -1, -1):
        depth[minute] = max(level, 0)
        level = level - enqueued[minute] + finished[minute]
    return depth


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class Chart:
    """An SVG chart's geometry: its largest value, and bars (two stacked series) or a line
    (``path``, and ``area`` below it). The template draws it."""

    maximum: int
    total: int
    lower: list[Bar] = field(default_factory=list)
    upper: list[Bar] = field(default_factory=list)
    path: str = ""
    area: str = ""
    width: int = WIDTH
    height: int = HEIGHT
    bottom: int = HEIGHT - _PAD_BOTTOM

    @staticmethod
    def _scale(maximum: int) -> float:
        return (HEIGHT - _PAD_TOP - _PAD_BOTTOM) / max(maximum, 1)

    @classmethod
    def bars(cls, lower: Sequence[int], upper: Sequence[int]) -> Chart:
        """``lower`` stacked under ``upper``, a bar per minute; a bar of a minute with
        anything at all is at least one unit tall, so that a single job shows."""
        sums = [a + b for a, b in zip(lower, upper, strict=True)]
        maximum = max(sums, default=0)
        scale = cls._scale(maximum)
        step = WIDTH / max(len(sums), 1)
        bottom = HEIGHT - _PAD_BOTTOM
        below: list[Bar] = []
        above: list[Bar] = []
        for minute, (a, b) in enumerate(zip(lower, upper, strict=True)):
            x = minute * step + 0.5
            low = max(a * scale, 1.5) if a else 0.0
            high = max(b * scale, 1.5) if b else 0.0
            if low:
                below.append(Bar(x, bottom - low, step - 1, low))
            if high:
                above.append(Bar(x, bottom - low - high, step - 1, high))
        return cls(maximum=maximum, total=sum(sums), lower=below, upper=above)

    @classmethod
    def line(cls, values: Sequence[int]) -> Chart:
        """``values`` as a line (a point in the middle of each minute) over its area."""
        maximum = max(values, default=0)
        scale = cls._scale(maximum)
        step = WIDTH / max(len(values), 1)
        bottom = HEIGHT - _PAD_BOTTOM
        points = [
            (minute * step + step / 2, bottom - value * scale)
            for minute, value in enumerate(values)
        ]
        if not points:
            return cls(maximum=0, total=0)
        path = "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in points)
        area = f"{path} L{points[-1][0]:.1f},{bottom} L{points[0][0]:.1f},{bottom} Z"
        return cls(maximum=maximum, total=sum(values), path=path, area=area)


def read_activity(
    connection: Connection, model: type[JobMixin], sources: Sequence[TableSource]
) -> list[QueueActivity]:
    """Every queue's last hour, by name: the minute counts of each source's newest window,
    and the jobs not finished now (the partial indexes)."""
    queues: dict[str, QueueActivity] = {}
    for source in sources:
        for row in MINUTE_COUNTS.rows(
            connection, source.table, {"before": statements.MAX_ID}, scan=source.scan
        ):
            activity = queues.setdefault(row.queue, QueueActivity(row.queue))
            if 0 <= row.minute < MINUTES:
                activity.succeeded[row.minute] += row.succeeded
                activity.dead[row.minute] += row.dead
                activity.finished[row.minute] += row.finished
                activity.enqueued[row.minute] += row.enqueued
    for stat in queue.queue_stats(connection, model):
        if stat.status in _UNFINISHED:
            activity = queues.setdefault(stat.queue, QueueActivity(stat.queue))
            activity.unfinished_now += stat.count
    return [queues[name] for name in sorted(queues)]


@dataclass(frozen=True)
class Failure:
    """Dead jobs of one task and error kind (the last line of their errors, up to its
    colon): how many, the newest's finish time, id and last line."""

    task: str
    error: str
    jobs: int
    latest: datetime | None
    latest_id: int
    message: str


def read_failures(connection: Connection, sources: Sequence[TableSource]) -> list[Failure]:
    """The dead jobs of the last day by task and error kind, most jobs first, over every
    source (:data:`~sqla_jobs._queries.dashboard.FAILURES`)."""
    groups: dict[tuple[str, str], Failure] = {}
    for source in sources:
        for row in FAILURES.rows(connection, source.table, {}, scan=source.scan):
            found = Failure(
                row.task, row.error, row.jobs, row.latest, int(row.latest_id), row.message
            )
            seen = groups.get((row.task, row.error))
            if seen is not None:
                newer = found if _later(found.latest, seen.latest) else seen
                found = Failure(
                    row.task,
                    row.error,
                    seen.jobs + found.jobs,
                    newer.latest,
                    newer.latest_id,
                    newer.message,
                )
            groups[(row.task, row.error)] = found
    return sorted(groups.values(), key=lambda f: (-f.jobs, f.task, f.error))


def _later(a: datetime | None, b: datetime | None) -> bool:
    return a is not None and (b is None or a > b)
