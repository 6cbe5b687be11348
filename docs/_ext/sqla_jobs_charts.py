"""The benchmark charts: a bench run's JSON (``sqla-jobs bench --json``) drawn as SVG.

Pure Python and the standard library only: no plotting package, no Sphinx. The Sphinx
extension (:mod:`sqla_jobs_docs`) puts the SVG inline in the page at build time, and
tests/test_docs_reference.py calls these functions on the committed JSON.

A chart is a list of :class:`Bar` (one horizontal bar each) grouped under headings; a bar's
``kind`` picks its colour: the library's figure, the ceiling measured beside it, or a peer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

__all__ = [
    "KINDS",
    "Bar",
    "bars_for",
    "draw_bars",
    "load_results",
    "metric",
    "sweep_bars",
]

#: Bar kinds and their fill colours (readable on Furo's light and dark backgrounds).
KINDS: dict[str, str] = {
    "sqla_jobs": "#2f7ed8",  # the library (the real Worker, the library's calls)
    "ceiling": "#9a9a9a",  # the plain loop of the same run
    "peer": "#e8a33d",  # another queue library
}


@dataclass(frozen=True)
class Bar:
    """One bar: its label, its value and what it is (a key of :data:`KINDS`)."""

    label: str
    value: float
    kind: str = "sqla_jobs"
    group: str = ""
    note: str = ""  # printed after the value, e.g. the ratio to the ceiling


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a ``sqla-jobs bench --json`` document."""
    document: dict[str, Any] = json.loads(Path(path).read_text())
    if not isinstance(document.get("metrics"), dict):
        raise ValueError(f"{path}: not a bench run's JSON (no 'metrics' object)")
    return document


def metric(document: Mapping[str, Any], name: str) -> dict[str, Any]:
    """One metric of the document, or :class:`KeyError` naming what the run has."""
    metrics: dict[str, Any] = document["metrics"]
    if name not in metrics:
        raise KeyError(f"the bench run has no metric {name!r} (it has {len(metrics)} others)")
    found: dict[str, Any] = metrics[name]
    return found


def bars_for(
    document: Mapping[str, Any],
    entries: Iterable[tuple[str, str]],
    *,
    ceilings: bool = True,
    group: str = "",
    drawn: set[str] | None = None,
) -> list[Bar]:
    """The bars of ``entries`` (metric name, label), each followed by its ceiling's bar.

    A metric with a ``ceiling`` in the run gets a second bar, the ceiling's median, labelled
    with the ceiling's name, and its own bar notes the ratio; ``ceilings=False`` leaves
    the ceiling bars out (the ratio note stays). A ceiling named in ``drawn`` is not drawn
    again (the set is updated: pass one set for all the calls that make one chart).
    """
    drawn = set() if drawn is None else drawn
    bars: list[Bar] = []
    for name, label in entries:
        found = metric(document, name)
        ratio = found.get("ratio")
        note = f"{ratio:.2f} of the ceiling" if isinstance(ratio, int | float) else ""
        bars.append(Bar(label, float(found["median"]), "sqla_jobs", group, note))
        ceiling = found.get("ceiling")
        if (
            ceilings
            and ceiling
            and ceiling not in drawn
            and found.get("ceiling_median") is not None
        ):
            drawn.add(ceiling)
            bars.append(
                Bar(
                    f"ceiling: {ceiling.removeprefix('ceiling.')}",
                    float(found["ceiling_median"]),
                    "ceiling",
                    group,
                )
            )
    return bars


def sweep_bars(document: Mapping[str, Any], mode: str, processes: int) -> list[Bar]:
    """The ceiling loop's sweep over batch sizes (``ceiling.sweep.<mode>.b<n>.<p>p``), one
    bar per batch size, smallest first."""
    prefix, suffix = f"ceiling.sweep.{mode}.b", f".{processes}p"
    points = []
    for name, found in document["metrics"].items():
        if name.startswith(prefix) and name.endswith(suffix):
            batch = int(name[len(prefix) : -len(suffix)])
            points.append((batch, float(found["median"])))
    if not points:
        raise KeyError(f"the bench run has no sweep of {mode!r} with {processes} process(es)")
    group = f"{mode}, {processes} process{'es' if processes > 1 else ''}"
    return [Bar(f"B = {batch}", value, "ceiling", group) for batch, value in sorted(points)]


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


# Layout, in SVG user units (the SVG scales to the page's width).
_WIDTH = 900
_LABEL = 270  # the label column
_VALUE = 250  # room right of the longest bar for its value and note
_BAR = 18
_GAP = 6
_HEADING = 26
_AXIS = 28


def draw_bars(bars: Sequence[Bar], *, title: str, unit: str) -> str:
    """An SVG document of horizontal bars, one ``<rect class="bar">`` per :class:`Bar`, on
    one linear scale from 0, grouped under a heading wherever ``group`` changes.

    Text uses ``currentColor``, so it follows the page's light or dark theme.
    """
    if not bars:
        raise ValueError("a chart needs at least one bar")
    if any(not math.isfinite(bar.value) or bar.value < 0 for bar in bars):
        raise ValueError("bar values must be finite and not negative")
    top = max(bar.value for bar in bars) or 1.0
    scale = (_WIDTH - _LABEL - _VALUE) / top
    rows: list[str] = []
    y = 30
    group: str | None = None
    for bar in bars:
        if bar.group != group and bar.group:
            y += 4
            rows.append(
                f'<text x="0" y="{y + 14}" class="group" font-weight="bold">'
                f"{escape(bar.group)}</text>"
            )
            y += _HEADING
        group = bar.group
        width = max(bar.value * scale, 1.0)
        value = f"{_number(bar.value)} {unit}" + (f" ({bar.note})" if bar.note else "")
        rows.append(
            f'<text x="{_LABEL - 8}" y="{y + 13}" text-anchor="end">{escape(bar.label)}</text>'
            f'<rect class="bar {escape(bar.kind)}" x="{_LABEL}" y="{y}" width="{width:.1f}" '
            f'height="{_BAR}" fill="{KINDS.get(bar.kind, KINDS["sqla_jobs"])}">'
            f"<title>{escape(bar.label)}: {escape(value)}</title></rect>"
            f'<text x="{_LABEL + width + 6:.1f}" y="{y + 13}">{escape(value)}</text>'
        )
        y += _BAR + _GAP
    axis_y = y + 4
    ticks = _ticks(top)
    axis = [
        (
            f'<line x1="{_LABEL}" y1="{axis_y}" x2="{_LABEL + top * scale:.1f}" y2="{axis_y}" '
            'stroke="currentColor" stroke-opacity="0.4"/>'
        )
    ]
    for tick in ticks:
        x = _LABEL + tick * scale
        axis.append(
            f'<line x1="{x:.1f}" y1="30" x2="{x:.1f}" y2="{axis_y}" stroke="currentColor" '
            'stroke-opacity="0.12"/>'
            f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle" font-size="11">'
            f"{_number(tick)}</text>"
        )
    legend = _legend({bar.kind for bar in bars}, axis_y + _AXIS)
    height = axis_y + _AXIS + 22
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_WIDTH} {height}" '
        f'width="100%" role="img" aria-label="{escape(title)}" class="sqla-jobs-chart" '
        'font-family="sans-serif" font-size="13" fill="currentColor">'
        f"<title>{escape(title)}</title>"
        f'<text x="0" y="16" font-weight="bold" font-size="14">{escape(title)}</text>'
        + "".join(axis)
        + "".join(rows)
        + legend
        + "</svg>"
    )


def _ticks(top: float) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) from 0 to at most ``top``:
    the widest step that still gives at least three intervals."""
    if top <= 0:
        return [0.0]
    base = 10.0 ** math.floor(math.log10(top))
    step = base
    for factor in (5.0, 2.0, 1.0, 0.5, 0.2, 0.1):
        step = base * factor
        if top / step >= 3:
            break
    return [step * i for i in range(int(top // step + 1e-9) + 1)]


def _legend(kinds: set[str], y: int) -> str:
    names = {"sqla_jobs": "sqla_jobs", "ceiling": "plain-SQL ceiling, same run", "peer": "peer"}
    parts, x = [], 0
    for kind in KINDS:
        if kind in kinds:
            parts.append(
                f'<rect x="{x}" y="{y}" width="12" height="12" fill="{KINDS[kind]}"/>'
                f'<text x="{x + 18}" y="{y + 11}" font-size="12">{escape(names[kind])}</text>'
            )
            x += 30 + 8 * len(names[kind])
    return "".join(parts)
