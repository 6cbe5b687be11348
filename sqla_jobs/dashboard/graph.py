"""A workflow's steps as a graph, laid out on the server for an inline SVG (no script).

Columns by dependency depth: a step with no dependency is in column 0, any other one column
right of its deepest dependency (the longest path to it from a root), so every edge points
right. In a column the steps are ordered by the mean row of their dependencies (then by id),
which keeps most edges short and uncrossed. One box per step, coloured by its status, linked
to its job's page; one edge per dependency.

A workflow can have thousands of steps, which a browser cannot draw as boxes: at most
``limit`` boxes (:data:`MAX_BOXES`) are drawn, the shallowest columns first (then by id), and
the page says how many were left out; an edge is drawn when both its ends are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from sqla_jobs._queries.dashboard import WorkflowStepRow

__all__ = ["MAX_BOXES", "Box", "Edge", "Graph", "depths", "layout"]

#: The most step boxes a workflow's page draws.
MAX_BOXES: Final = 300
#: A box's size, and the room between columns and between rows, in SVG units.
BOX_WIDTH: Final = 168
BOX_HEIGHT: Final = 40
COLUMN_GAP: Final = 56
ROW_GAP: Final = 14
MARGIN: Final = 8
#: Characters of a step's name shown in its box (the whole name is in its tooltip).
NAME_SHOWN: Final = 22


@dataclass(frozen=True, slots=True)
class Box:
    """A step's box: its row, its column (its depth) and its place."""

    step: WorkflowStepRow
    column: int
    x: int
    y: int

    @property
    def label(self) -> str:
        """The step's name, cut to fit its box."""
        name = self.step.step or f"#{self.step.id}"
        return name if len(name) <= NAME_SHOWN else name[: NAME_SHOWN - 1] + "…"


@dataclass(frozen=True, slots=True)
class Edge:
    """A dependency: step ``target`` runs after step ``source``; ``path`` is its SVG path
    (a curve from the right side of ``source``'s box to the left side of ``target``'s)."""

    source: int
    target: int
    path: str


@dataclass(frozen=True, slots=True)
class Graph:
    """What a workflow's page draws: the boxes, the edges, the picture's size, and the steps
    left out (``hidden``) because there were more than the limit."""

    boxes: list[Box]
    edges: list[Edge]
    width: int
    height: int
    columns: int
    hidden: int


def depths(steps: Sequence[WorkflowStepRow]) -> dict[int, int]:
    """Each step's depth: 0 for a step with no dependency among ``steps``, else one more
    than its deepest dependency's (the longest path from a root). Computed in topological
    order (Kahn's), since a step added at run time may depend on a step of a higher id; a
    dependency not among ``steps`` (not read) is ignored, and so, should there ever be one,
    is a cycle (its steps are put right of the others)."""
    ids = {step.id for step in steps}
    needs = {
        step.id: [d for d in dict.fromkeys(step.depends_on or ()) if d in ids] for step in steps
    }
    dependents: dict[int, list[int]] = {step.id: [] for step in steps}
    waiting = {}
    for step_id, dependencies in needs.items():
        waiting[step_id] = len(dependencies)
        for dependency in dependencies:
            dependents[dependency].append(step_id)
    depth = dict.fromkeys(ids, 0)
    ready = [step_id for step_id, count in waiting.items() if count == 0]
    done = 0
    while ready:
        step_id = ready.pop()
        done += 1
        for dependent in dependents[step_id]:
            depth[dependent] = max(depth[dependent], depth[step_id] + 1)
            waiting[dependent] -= 1
            if waiting[dependent] == 0:
                ready.append(dependent)
    if done < len(ids):  # a cycle: not made by sqla_jobs, but never loop or fail on one
        right = max(depth.values(), default=0) + 1
        for step_id, count in waiting.items():
            if count > 0:
                depth[step_id] = right
    return depth


def layout(steps: Sequence[WorkflowStepRow], *, limit: int = MAX_BOXES) -> Graph:
    """The boxes and edges of ``steps`` (at most ``limit`` boxes: the shallowest first)."""
    depth = depths(steps)
    ordered = sorted(steps, key=lambda step: (depth[step.id], step.id))
    shown = ordered[:limit]
    columns: dict[int, list[WorkflowStepRow]] = {}
    for step in shown:
        columns.setdefault(depth[step.id], []).append(step)
    row_of: dict[int, float] = {}
    boxes: list[Box] = []
    place: dict[int, Box] = {}
    for index, column in enumerate(sorted(columns)):
        members = columns[column]

        def mean_row(step: WorkflowStepRow) -> float:
            rows = [row_of[d] for d in step.depends_on or () if d in row_of]
            return sum(rows) / len(rows) if rows else -1.0

        members.sort(key=lambda step: (mean_row(step), step.id))
        for row, step in enumerate(members):
            row_of[step.id] = row
            box = Box(
                step,
                column,
                x=MARGIN + index * (BOX_WIDTH + COLUMN_GAP),
                y=MARGIN + row * (BOX_HEIGHT + ROW_GAP),
            )
            boxes.append(box)
            place[step.id] = box
    edges = []
    for box in boxes:
        for dependency in dict.fromkeys(box.step.depends_on or ()):
            source = place.get(dependency)
            if source is not None:
                edges.append(Edge(dependency, box.step.id, _curve(source, box)))
    tallest = max((len(members) for members in columns.values()), default=0)
    return Graph(
        boxes=boxes,
        edges=edges,
        width=2 * MARGIN + max(len(columns) * (BOX_WIDTH + COLUMN_GAP) - COLUMN_GAP, 0),
        height=2 * MARGIN + max(tallest * (BOX_HEIGHT + ROW_GAP) - ROW_GAP, 0),
        columns=len(columns),
        hidden=len(steps) - len(shown),
    )


def _curve(source: Box, target: Box) -> str:
    x1, y1 = source.x + BOX_WIDTH, source.y + BOX_HEIGHT // 2
    x2, y2 = target.x - 4, target.y + BOX_HEIGHT // 2  # room for the arrow's head
    bend = max((x2 - x1) // 2, 12)
    return f"M{x1},{y1} C{x1 + bend},{y1} {x2 - bend},{y2} {x2},{y2}"
