"""The reference pages (docs/reference/) and the benchmark page (docs/benchmarks.md) hold to
the code: every exported name is documented, every command and option of the command line
and every column of each mixin is in the generated reference, and the benchmark charts draw
one bar per figure of the committed run.

No database and no Sphinx build: the checks read the pages' directives and call the
functions the docs' extension (docs/_ext/) generates the pages from. The tests that render
docutils nodes run where Sphinx is installed (the ``docs`` dependency group) and are
skipped, saying so, elsewhere; ``nox -s docs`` builds the pages themselves with warnings as
errors.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sqla_jobs
import sqla_jobs.errors
from sqla_jobs.cli import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"
REFERENCE = DOCS / "reference"
RESULTS = DOCS / "benchmarks" / "results.json"

#: The modules users import, each with a reference page: the package and its public modules.
PUBLIC_MODULES = (
    "sqla_jobs",
    "sqla_jobs.aio",
    "sqla_jobs.models",
    "sqla_jobs.migrations",
    "sqla_jobs.testing",
    "sqla_jobs.periodic",
    "sqla_jobs.leasing",
    "sqla_jobs.workflows",
    "sqla_jobs.history",
    "sqla_jobs.health",
    "sqla_jobs.metrics",
    "sqla_jobs.tracing",
    "sqla_jobs.hooks",
    "sqla_jobs.integrations.sentry",
    "sqla_jobs.dashboard",
    "sqla_jobs.embedded",
    "sqla_jobs.events",
    "sqla_jobs.errors",
)


def _extension_module(name: str) -> ModuleType:
    """A module of docs/_ext, imported from its file (it is no package of its own)."""
    import sys

    if name in sys.modules:
        return sys.modules[name]
    if str(DOCS / "_ext") not in sys.path:
        sys.path.insert(0, str(DOCS / "_ext"))  # the extension imports its siblings
    spec = importlib.util.spec_from_file_location(name, DOCS / "_ext" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


reference = _extension_module("sqla_jobs_reference")
charts = _extension_module("sqla_jobs_charts")


# -- the pages' directives ------------------------------------------------------------------


@dataclass
class Directive:
    page: Path
    name: str
    argument: str
    options: dict[str, str] = field(default_factory=dict)
    content: list[str] = field(default_factory=list)


_FENCE = re.compile(r"^(`{3,}|:{3,})\{([\w-]+)\}\s*(.*)$")
_RST = re.compile(r"^\.\. ([\w:-]+):: (\S+)\s*$")


def directives(page: Path) -> list[Directive]:
    """The MyST directives of a page, and the autodoc directives inside its ``eval-rst``
    blocks, with their options and content."""
    found: list[Directive] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        index += 1
        if not match:
            continue
        fence, name, argument = match.groups()
        body = []
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index])
            index += 1
        index += 1
        if name == "eval-rst":
            found += _rst_directives(page, body)
            continue
        directive = Directive(page, name, argument.strip())
        rest = iter(body)
        for line in rest:
            option = re.match(r"^:([\w-]+):\s*(.*)$", line)
            if option:
                directive.options[option.group(1)] = option.group(2).strip()
                continue
            directive.content = [line, *rest]
        found.append(directive)
    return found


def _rst_directives(page: Path, lines: list[str]) -> list[Directive]:
    found: list[Directive] = []
    for line in lines:
        match = _RST.match(line)
        if match:
            found.append(Directive(page, match.group(1), match.group(2)))
            continue
        option = re.match(r"^\s+:([\w-]+):\s*(.*)$", line)
        if option and found:
            found[-1].options[option.group(1)] = option.group(2).strip()
    return found


def reference_directives(name: str) -> list[Directive]:
    return [
        d for page in sorted(REFERENCE.glob("*.md")) for d in directives(page) if d.name == name
    ]


# -- the Python API -------------------------------------------------------------------------


def _documented() -> tuple[set[tuple[str, str]], list[Any]]:
    """(module, name) pairs the reference's autodoc directives render, and the objects."""
    pairs: set[tuple[str, str]] = set()
    objects: list[Any] = []
    for directive in reference_directives("automodule"):
        module = importlib.import_module(directive.argument)
        options = directive.options
        assert {"members", "undoc-members", "imported-members"} <= set(options), (
            f"{directive.page.name}: automodule {directive.argument} renders its whole __all__ "
            "only with :members:, :undoc-members: and :imported-members: (it has "
            f"{sorted(options)})"
        )
        assert options["members"] == "", f"{directive.page.name}: :members: lists names"
        excluded = {n.strip() for n in options.get("exclude-members", "").split(",") if n.strip()}
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{directive.argument} has no __all__"
        assert excluded <= set(exported), f"{directive.page.name}: excludes {excluded}"
        with_docs = reference.attribute_docs(directive.argument)
        for name in exported:
            value = getattr(module, name)
            rendered = (
                inspect.isclass(value)
                or inspect.isroutine(value)
                or inspect.ismodule(value)
                or name in with_docs  # data: only with a doc comment in the module itself
            )
            if name not in excluded and rendered:
                pairs.add((directive.argument, name))
                objects.append(value)
    for kind in ("autoclass", "autofunction", "autoexception", "autodata", "py:data"):
        for directive in reference_directives(kind):
            module_name, _, name = directive.argument.rpartition(".")
            pairs.add((module_name, name))
            objects.append(getattr(importlib.import_module(module_name), name))
    return pairs, objects


def test_every_public_module_has_a_reference_page() -> None:
    documented = {d.argument for d in reference_directives("automodule")}
    assert documented == set(PUBLIC_MODULES)
    pages = {p.stem for p in REFERENCE.glob("*.md")} - {"index"}
    toctree = (REFERENCE / "index.md").read_text()
    for stem in pages:
        assert re.search(rf"^{re.escape(stem)}$", toctree, re.MULTILINE), f"{stem} not in toctree"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_exported_name_is_in_the_reference(module_name: str) -> None:
    """A name is documented under its own module, or the same object under another (the
    package's exceptions are on the errors page, the lease calls on the package's)."""
    pairs, objects = _documented()
    module = importlib.import_module(module_name)
    missing = [
        name
        for name in module.__all__
        if (module_name, name) not in pairs
        and not (
            (inspect.isclass(getattr(module, name)) or inspect.isroutine(getattr(module, name)))
            and any(getattr(module, name) is documented for documented in objects)
        )
    ]
    assert missing == [], f"{module_name}: not in docs/reference/: {missing}"


def test_exclusions_are_documented_elsewhere() -> None:
    """A name left out of one page (``:exclude-members:``) is the same object as one another
    page renders, so nothing is left out of the reference."""
    _pairs, objects = _documented()
    for directive in reference_directives("automodule"):
        module = importlib.import_module(directive.argument)
        for name in filter(
            None, map(str.strip, directive.options.get("exclude-members", "").split(","))
        ):
            value = getattr(module, name)
            assert any(value is other for other in objects), f"{directive.argument}.{name}"
            assert inspect.isclass(value) or inspect.isroutine(value), (
                f"{directive.argument}.{name}: only classes and functions are the same object "
                "wherever they are exported"
            )


# -- the errors -----------------------------------------------------------------------------


def test_errors_have_one_root_and_the_drawn_tree_is_the_real_one() -> None:
    """Every exception of sqla_jobs.errors derives from SqlaJobsError, and the tree drawn in
    the module's docstring (the errors page shows it) has each class under its real base."""
    classes = {name: getattr(sqla_jobs.errors, name) for name in sqla_jobs.errors.__all__}
    root = sqla_jobs.errors.SqlaJobsError
    assert all(issubclass(cls, root) for cls in classes.values())
    assert list(root.__bases__) == [Exception]
    drawn: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    tree = (sqla_jobs.errors.__doc__ or "").split("The tree::", 1)[1]
    for line in tree.splitlines():
        match = re.search(r"([A-Z]\w*Error)\b", line)
        if not match or line[: match.start()].strip("│├└─ ") != "":
            continue
        depth = match.start()
        while stack and stack[-1][0] >= depth:
            stack.pop()
        drawn[match.group(1)] = stack[-1][1] if stack else None
        stack.append((depth, match.group(1)))
    assert set(drawn) == set(classes)
    for name, cls in classes.items():
        parents = [b.__name__ for b in cls.__bases__ if issubclass(b, root)]
        assert drawn[name] == (parents[0] if parents else None), name
    # The package exports the errors a caller catches: they are sqla_jobs.errors' own. One
    # exception is no error: Snooze, a request a handler raises (sqla_jobs.context), under
    # the same root all the same.
    for name in sqla_jobs.__all__:
        value = getattr(sqla_jobs, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            if value is sqla_jobs.Snooze:
                assert issubclass(value, root)
                continue
            assert classes.get(name) is value


# -- the command line -----------------------------------------------------------------------


def _cli_directive() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    (directive,) = reference_directives("sqla-jobs-cli")
    parser = reference.load_object(directive.argument)()
    expand = {}
    for item in filter(None, directive.options.get("expand", "").split(",")):
        prog, _, spec = item.partition("=")
        expand[prog.strip()] = reference.load_object(spec.strip())()
    return parser, expand


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _arguments(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string and positional of a parser (what ``--help`` lists), but help."""
    names: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.nargs == argparse.REMAINDER:
            continue
        positional = action.metavar if isinstance(action.metavar, str) else action.dest
        names |= set(action.option_strings) or {positional}
    return names


def test_the_cli_page_documents_the_real_parser() -> None:
    parser, expand = _cli_directive()
    assert parser.prog == build_parser().prog
    subcommands = _subcommands(build_parser())
    assert subcommands, "build_parser() has no subcommands"
    # A subcommand that hands its arguments on (bench) is expanded by its own parser.
    for sub in subcommands.values():
        if any(a.nargs == argparse.REMAINDER for a in sub._actions):
            assert sub.prog in expand, f"{sub.prog} reads its own options: add it to :expand:"


def test_the_cli_model_covers_every_command_and_option() -> None:
    parser, expand = _cli_directive()
    commands = {command.prog: command for command in reference.cli_commands(parser, expand)}
    expected = {parser.prog: parser}
    for sub in _subcommands(parser).values():
        expected[sub.prog] = expand.get(sub.prog, sub)
    assert set(commands) == set(expected)
    for prog, real in expected.items():
        documented = {name for option in commands[prog].options for name in option.names}
        assert documented == _arguments(real), prog
        assert commands[prog].usage.startswith(f"usage: {prog}")
    assert commands[parser.prog].subcommands == list(_subcommands(parser))


def test_the_cli_directive_renders_every_command_and_option() -> None:
    pytest.importorskip("sphinx", reason="the docs extension's nodes need Sphinx (docs group)")
    docs = _extension_module("sqla_jobs_docs")
    parser, expand = _cli_directive()
    commands = reference.cli_commands(parser, expand)
    registered: list[tuple[str, str, str]] = []
    sections = docs.cli_nodes(commands, lambda *args: registered.append(args))
    assert len(sections) == len(commands)
    for section, command in zip(sections, commands, strict=True):
        title = section.children[0].astext()
        assert title == command.prog
        text = section.astext()
        for option in command.options:
            for name in option.names:
                assert name in text, f"{command.prog}: {name}"
                assert (command.program_id, name) in {(p, n) for p, n, _ in registered}
        for name in command.subcommands:
            assert name in text
    ids = [node_id for _, _, node_id in registered]
    assert len(ids) == len(set(ids)), "two options share an anchor"


# -- the columns ----------------------------------------------------------------------------


class _LeaseBase(DeclarativeBase):
    pass


class _Seat(sqla_jobs.LeaseMixin, _LeaseBase):
    __tablename__ = "docs_reference_seats"
    id: Mapped[int] = mapped_column(primary_key=True)


class _Flow(sqla_jobs.WorkflowMixin, _LeaseBase):
    __tablename__ = "docs_reference_flows"


class _Steps(sqla_jobs.StepMixin, _LeaseBase):
    """The step columns alone (a real step model has JobMixin's too)."""

    __tablename__ = "docs_reference_steps"
    id: Mapped[int] = mapped_column(primary_key=True)


def _mixins() -> dict[str, type]:
    return {
        name: getattr(sqla_jobs, name)
        for name in sqla_jobs.__all__
        if name.endswith("Mixin") and inspect.isclass(getattr(sqla_jobs, name))
    }


def _real_columns(mixin: type) -> list[str]:
    """The columns a mixin gives a real model of the package (or of this test), in order."""
    from sqla_jobs import models

    model = {
        "JobMixin": models.Job,
        "JobResultMixin": models.JobResult,
        "ScheduleMixin": models.JobSchedule,
        "LeaseMixin": _Seat,
        "WorkflowMixin": _Flow,
        "StepMixin": _Steps,
    }[mixin.__name__]
    own = {"LeaseMixin": {"id"}, "StepMixin": {"id"}}.get(mixin.__name__, set())
    return [c.key for c in sa_inspect(model).columns if c.key not in own]


def test_every_mixin_has_a_columns_table() -> None:
    tables = {d.argument.rpartition(":")[2] for d in reference_directives("sqla-jobs-columns")}
    assert tables == set(_mixins())


@pytest.mark.parametrize("mixin_name", sorted(_mixins()))
def test_the_columns_table_covers_every_column(mixin_name: str) -> None:
    mixin = _mixins()[mixin_name]
    (directive,) = [
        d
        for d in reference_directives("sqla-jobs-columns")
        if d.argument.endswith(f":{mixin_name}")
    ]
    assert reference.load_object(directive.argument) is mixin
    columns = reference.mixin_columns(mixin)
    assert [c.name for c in columns] == _real_columns(mixin)
    given = reference.parse_descriptions(directive.content)
    assert set(given) <= {c.name for c in columns}, "a meaning for a column the mixin lacks"
    for column in columns:
        assert column.doc or given.get(column.name), f"{mixin_name}.{column.name}: no meaning"
        assert column.type, column.name


def test_the_columns_read_type_null_and_default_from_the_mixin() -> None:
    by_name = {c.name: c for c in reference.mixin_columns(sqla_jobs.JobMixin)}
    assert (by_name["id"].type, by_name["id"].default, by_name["id"].primary_key) == (
        "bigint",
        "identity",
        True,
    )
    assert (by_name["status"].nullable, by_name["status"].default) == (False, "'pending'")
    assert (by_name["args"].type, by_name["args"].default) == ("jsonb", "'{}'::jsonb")
    assert (by_name["finished_at"].type, by_name["finished_at"].nullable) == ("timestamptz", True)
    assert by_name["run_at"].default == "now()"
    leases = {c.name: c for c in reference.mixin_columns(sqla_jobs.LeaseMixin)}
    assert leases["lease_fence"].doc.startswith("The fencing token")


def test_the_columns_directive_renders_a_row_per_column() -> None:
    pytest.importorskip("sphinx", reason="the docs extension's nodes need Sphinx (docs group)")
    docs = _extension_module("sqla_jobs_docs")
    for mixin in _mixins().values():
        columns = reference.mixin_columns(mixin)
        table = docs.columns_table(columns, lambda column: [])
        rows = [node for node in table.findall() if node.tagname == "row"][1:]  # no header
        assert [row.children[0].astext().split()[0] for row in rows] == [c.name for c in columns]


# -- the benchmark charts -------------------------------------------------------------------


def _results() -> dict[str, Any]:
    document: dict[str, Any] = charts.load_results(RESULTS)
    return document


def _rects(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [
        e
        for e in root.iter("{http://www.w3.org/2000/svg}rect")
        if e.get("class", "").startswith("bar")
    ]


def test_the_committed_results_are_a_bench_run() -> None:
    document = _results()
    assert document["machine"]["server_version"]
    assert document["metrics"], "no metrics"
    for name, found in document["metrics"].items():
        assert isinstance(found["median"], int | float), name


def _chart_directives() -> list[Directive]:
    return [d for d in directives(DOCS / "benchmarks.md") if d.name == "sqla-jobs-bench-chart"]


def test_the_benchmark_page_charts_draw_one_bar_per_entry() -> None:
    document = _results()
    charts_on_page = _chart_directives()
    assert charts_on_page, "docs/benchmarks.md draws no chart"
    for directive in charts_on_page:
        assert (DOCS / directive.argument).resolve() == RESULTS.resolve()
        if "sweep" in directive.options:
            bars = []
            for spec in directive.options["sweep"].split(","):
                mode, processes = spec.split()
                bars += charts.sweep_bars(document, mode, int(processes))
        else:
            bars = []
            drawn: set[str] = set()
            for line in directive.content:
                line = line.strip()
                if not line or line.startswith("["):
                    continue
                name, _, label = line.partition("|")
                bars += charts.bars_for(
                    document,
                    [(name.strip(), label.strip())],
                    ceilings="no-ceilings" not in directive.options,
                    drawn=drawn,
                )
        svg = charts.draw_bars(bars, title=directive.options.get("title", ""), unit="jobs/s")
        rects = _rects(svg)
        assert len(rects) == len(bars) > 0
        for rect, bar in zip(rects, bars, strict=True):
            assert rect.get("class") == f"bar {bar.kind}"
            title = rect.find("{http://www.w3.org/2000/svg}title")
            assert title is not None
            assert title.text
            assert title.text.startswith(bar.label)


def test_a_chart_is_to_scale() -> None:
    """Each metric with a ceiling gives its bar and, the first time, its ceiling's, and bar
    widths are proportional to the values (the longest bar is the largest value)."""
    document = _results()
    with_ceiling = [n for n, m in document["metrics"].items() if m.get("ceiling_median")]
    assert with_ceiling, "the run measured no figure beside a ceiling"
    bars = charts.bars_for(document, [(name, name) for name in with_ceiling])
    ceilings = {document["metrics"][name]["ceiling"] for name in with_ceiling}
    assert len(bars) == len(with_ceiling) + len(ceilings)
    assert [bar.kind for bar in bars[:2]] == ["sqla_jobs", "ceiling"]
    assert sum(bar.kind == "ceiling" for bar in bars) == len(ceilings)
    rects = _rects(charts.draw_bars(bars, title="all", unit="x"))
    widths = [float(rect.get("width", "0")) for rect in rects]
    largest = max(range(len(bars)), key=lambda i: bars[i].value)
    assert widths[largest] == max(widths)
    for bar, width in zip(bars, widths, strict=True):
        if bar.value > 0 and bars[largest].value > 0:
            expected = widths[largest] * bar.value / bars[largest].value
            assert abs(width - max(expected, 1.0)) < 0.2


def test_the_sweep_has_a_bar_per_batch_size() -> None:
    # Each batch size of --sweep, and those the sweep grew to past its largest while the
    # rate rose, in order.
    document = _results()
    prefix, suffix = "ceiling.sweep.lease.b", ".1p"
    batches = sorted(
        int(name.removeprefix(prefix).removesuffix(suffix))
        for name in document["metrics"]
        if name.startswith(prefix) and name.endswith(suffix)
    )
    assert set(document["config"]["sweep"]) <= set(batches)
    bars = charts.sweep_bars(document, "lease", 1)
    assert [bar.label for bar in bars] == [f"B = {b}" for b in batches]
    rects = _rects(charts.draw_bars(bars, title="sweep", unit="jobs/s"))
    assert len(rects) == len(batches)


def test_a_chart_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one bar"):
        charts.draw_bars([], title="empty", unit="jobs/s")
    with pytest.raises(KeyError, match="no metric"):
        charts.bars_for(_results(), [("no.such.metric", "none")])
