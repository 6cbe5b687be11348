"""The documentation's own Sphinx extension: reference pages generated from the code, and the
benchmark charts drawn from a bench run's JSON.

Directives (MyST: ```` ```{name} argument ````):

``sqla-jobs-cli MODULE:FUNCTION``
    Every command of an :mod:`argparse` parser that ``FUNCTION()`` returns
    (``sqla_jobs.cli:build_parser``): one section per command, subcommands walked, with its
    usage, description and each option (its names, argument, help, default, choices, and
    what it excludes). Each option is a target of Sphinx's ``option`` role:
    ``{option}`sqla-jobs worker --concurrency```.
``sqla-jobs-columns MODULE:MIXIN``
    The columns a declarative mixin gives a table (name, PostgreSQL type, null, default,
    meaning), read from a throwaway model that mixes it in. A column's meaning is its
    ``doc=`` or ``comment=``, or its entry in the mixin's docstring (``name`` on a line of
    its own, the text indented below it), or else the directive's content, a MyST
    definition list (``name`` then ``: text``). A column with no meaning anywhere, or a
    meaning given for a column the mixin does not have, is a build warning.
``sqla-jobs-bench-chart PATH``
    Horizontal bars (inline SVG, drawn by :mod:`sqla_jobs_charts`) of the metrics listed
    in the content, one per line, ``metric.name | label``, each followed by its ceiling's
    bar; a line ``[heading]`` starts a group. ``:sweep: lease 1`` draws a ceiling loop's
    sweep of batch sizes instead. Options ``:title:``, ``:unit:``, ``:no-ceilings:``.
``sqla-jobs-bench-table PATH``
    Every metric of the run (median, unit, ceiling, ratio), or with ``:targets:`` the
    targets and whether each was met.
``sqla-jobs-bench-machine PATH``
    What the run ran on and with which sizes (from the JSON's ``machine`` and ``config``).

``PATH`` is relative to the page (``benchmarks/results.json``), and a page is rebuilt when
the file changes.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import sqla_jobs_charts as charts
from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sqla_jobs_reference import (
    ColumnDoc,
    CommandDoc,
    cli_commands,
    load_object,
    mixin_columns,
    parse_descriptions,
)

__all__ = ["cli_nodes", "columns_table", "setup"]


# -- The command line -----------------------------------------------------------------------


def _para(*children: nodes.Node | str) -> nodes.paragraph:
    paragraph = nodes.paragraph()
    for child in children:
        paragraph += nodes.Text(child) if isinstance(child, str) else child
    return paragraph


def _option_id(command: CommandDoc, name: str) -> str:
    return nodes.make_id(f"cmdoption-{command.program_id}-{name}")


def cli_nodes(
    commands: Sequence[CommandDoc],
    register: Callable[[str, str, str], None] | None = None,
) -> list[nodes.Node]:
    """One section per command. ``register(program, option, node id)`` is called for every
    option (the directive registers each with Sphinx's standard domain)."""
    sections: list[nodes.Node] = []
    for command in commands:
        section = nodes.section(ids=[nodes.make_id(f"cli-{command.program_id}")])
        section += nodes.title("", "", nodes.literal(command.prog, command.prog))
        text = command.description or command.help
        if text:
            section += _para(text)
        if command.help and command.description and command.help != command.description:
            section += _para("In the command list: ", command.help, ".")
        section += nodes.literal_block(command.usage, command.usage, language="text")
        if command.subcommands:
            line = _para("Commands: ")
            for index, name in enumerate(command.subcommands):
                if index:
                    line += nodes.Text(", ")
                ref = nodes.reference("", "", internal=True)
                ref["refid"] = nodes.make_id(f"cli-{command.program_id}-{name}")
                ref += nodes.literal(name, name)
                line += ref
            line += nodes.Text(".")
            section += line
        if command.options:
            items = nodes.definition_list()
            for option in command.options:
                item = nodes.definition_list_item()
                term = nodes.term()
                ids = []
                for index, name in enumerate(option.names):
                    if index:
                        term += nodes.Text(", ")
                    shown = name if option.positional else f"{name} {option.argument}".strip()
                    term += nodes.literal(shown, shown)
                    ids.append(_option_id(command, name))
                    if register is not None:
                        register(command.program_id, name, ids[-1])
                term["ids"] = ids
                item += term
                definition = nodes.definition()
                if option.help:
                    definition += _para(option.help)
                facts: list[nodes.Node | str] = []
                if option.required:
                    facts.append("Required. ")
                if option.default and not re.search(
                    rf"(?<![\w.]){re.escape(option.default)}(?![\w.])", option.help
                ):  # a default the help text does not already give
                    facts += ["Default: ", nodes.literal(option.default, option.default), ". "]
                if option.choices:
                    facts.append("One of: ")
                    for index, choice in enumerate(option.choices):
                        facts += [", " if index else "", nodes.literal(choice, choice)]
                    facts.append(". ")
                if option.excludes:
                    facts.append("Not with ")
                    for index, other in enumerate(option.excludes):
                        facts += [", " if index else "", nodes.literal(other, other)]
                    facts.append(".")
                if facts:
                    definition += _para(*facts)
                item += definition
                items += item
            section += items
        sections.append(section)
    return sections


class CliDirective(SphinxDirective):
    """``sqla-jobs-cli MODULE:FUNCTION``, option ``:expand: PROG=MODULE:FUNCTION`` (one or
    more, comma-separated): a subcommand whose arguments another parser reads."""

    required_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {"expand": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        try:
            parser = load_object(self.arguments[0])()
        except Exception as exc:  # reported on the page's line, not a crash
            raise self.error(f"{self.arguments[0]}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(parser, argparse.ArgumentParser):
            raise self.error(f"{self.arguments[0]}() did not return an ArgumentParser")
        expand = {}
        for item in filter(None, self.options.get("expand", "").split(",")):
            prog, _, spec = item.partition("=")
            expand[prog.strip()] = load_object(spec.strip())()
        std = self.env.domains.standard_domain
        docname = self.env.docname

        def register(program: str, option: str, node_id: str) -> None:
            std.add_program_option(program, option, docname, node_id)

        return cli_nodes(cli_commands(parser, expand), register)


# -- The mixins' columns --------------------------------------------------------------------


def columns_table(
    columns: Sequence[ColumnDoc], meaning: Callable[[ColumnDoc], list[nodes.Node]]
) -> nodes.table:
    """A table: column, type, null, default, meaning (``meaning(column)``'s nodes)."""
    headers = ("column", "type", "null", "default", "meaning")
    table = nodes.table(classes=["sqla-jobs-columns"])
    group = nodes.tgroup(cols=len(headers))
    table += group
    for width in (14, 18, 6, 14, 48):
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    group += head
    row = nodes.row()
    for header in headers:
        row += nodes.entry("", nodes.paragraph(header, header))
    head += row
    body = nodes.tbody()
    group += body
    for column in columns:
        row = nodes.row()
        name = column.name + (" (primary key)" if column.primary_key else "")
        for cell in (
            [_para(nodes.literal(column.name, column.name), name[len(column.name) :])],
            [_para(nodes.literal(column.type, column.type))],
            [_para("null" if column.nullable else "not null")],
            [_para(nodes.literal(column.default, column.default))] if column.default else [],
            meaning(column),
        ):
            entry = nodes.entry()
            for node in cell:
                entry += node
            row += entry
        body += row
    return table


class ColumnsDirective(SphinxDirective):
    required_arguments = 1
    has_content = True

    def run(self) -> list[nodes.Node]:
        try:
            columns = mixin_columns(load_object(self.arguments[0]))
        except Exception as exc:  # reported on the page's line, not a crash
            raise self.error(f"{self.arguments[0]}: {type(exc).__name__}: {exc}") from exc
        given = parse_descriptions(self.content)
        known = {column.name for column in columns}
        result: list[nodes.Node] = [
            self.state.document.reporter.warning(
                f"{self.arguments[0]} has no column {name!r} (it has: {', '.join(known)})",
                line=self.lineno,
            )
            for name in sorted(set(given) - known)
        ]

        def meaning(column: ColumnDoc) -> list[nodes.Node]:
            text = column.doc or given.get(column.name, "")
            if not text:
                result.append(
                    self.state.document.reporter.warning(
                        f"{self.arguments[0]}.{column.name}: no meaning in the code "
                        "(doc=, comment=, the docstring) nor in the directive's content",
                        line=self.lineno,
                    )
                )
                return []
            if column.doc:  # reST from the docstring: shown as plain text
                return [_para(re.sub(r"``([^`]+)``", r"\1", text))]
            inline, messages = self.state.inline_text(text, self.lineno)
            paragraph = nodes.paragraph()
            paragraph.extend(inline)
            return [paragraph, *messages]

        table = columns_table(columns, meaning)
        return [table, *result]


# -- The benchmark --------------------------------------------------------------------------


class _BenchDirective(SphinxDirective):
    required_arguments = 1

    def document_json(self) -> dict[str, Any]:
        relative, absolute = self.env.relfn2path(self.arguments[0], self.env.docname)
        self.env.note_dependency(relative)
        try:
            return charts.load_results(absolute)
        except (OSError, ValueError) as exc:
            raise self.error(f"{self.arguments[0]}: {exc}") from exc


def _chart_lines(lines: Iterable[str]) -> list[tuple[str, str, str]]:
    """Content lines -> (group, metric, label)."""
    entries, group = [], ""
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            group = line[1:-1].strip()
            continue
        name, _, label = line.partition("|")
        entries.append((group, name.strip(), label.strip() or name.strip()))
    return entries


class BenchChartDirective(_BenchDirective):
    has_content = True
    option_spec: ClassVar[dict[str, Any]] = {
        "title": directives.unchanged_required,
        "unit": directives.unchanged,
        "no-ceilings": directives.flag,
        "sweep": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        document = self.document_json()
        title = self.options.get("title", "")
        try:
            if "sweep" in self.options:
                bars: list[charts.Bar] = []
                for spec in self.options["sweep"].split(","):
                    mode, processes = spec.split()
                    bars += charts.sweep_bars(document, mode, int(processes))
                unit = self.options.get("unit", "jobs/s")
            else:
                bars = []
                units = set()
                drawn: set[str] = set()  # each ceiling once per chart
                for group, name, label in _chart_lines(self.content):
                    units.add(charts.metric(document, name)["unit"])
                    bars += charts.bars_for(
                        document,
                        [(name, label)],
                        ceilings="no-ceilings" not in self.options,
                        group=group,
                        drawn=drawn,
                    )
                if len(units) > 1 and "unit" not in self.options:
                    raise self.error(f"metrics of several units ({units}): give :unit:")
                unit = self.options.get("unit") or (units.pop() if units else "")
            svg = charts.draw_bars(bars, title=title, unit=unit)
        except (KeyError, ValueError) as exc:
            raise self.error(str(exc)) from exc
        figure = nodes.container(classes=["sqla-jobs-chart"])
        figure += nodes.raw("", svg, format="html")
        return [figure]


def _figure(value: Any, unit: str = "") -> str:
    if not isinstance(value, int | float):
        return ""
    if unit == "fraction":
        return f"{value * 100:+.1f} %"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def _simple_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(headers))
    table += group
    for _ in headers:
        group += nodes.colspec(colwidth=10)
    head = nodes.thead()
    group += head
    row = nodes.row()
    for header in headers:
        row += nodes.entry("", nodes.paragraph(header, header))
    head += row
    body = nodes.tbody()
    group += body
    for values in rows:
        row = nodes.row()
        for index, value in enumerate(values):
            cell = nodes.literal(value, value) if index == 0 and value else nodes.Text(value)
            row += nodes.entry("", nodes.paragraph("", "", cell))
        body += row
    return table


class BenchTableDirective(_BenchDirective):
    option_spec: ClassVar[dict[str, Any]] = {"targets": directives.flag}

    def run(self) -> list[nodes.Node]:
        document = self.document_json()
        if "targets" in self.options:
            verdicts = {True: "met", False: "not met", None: "not measured"}
            rows = [
                (t["metric"], t["target"], _figure(t["value"]), verdicts[t["met"]])
                for t in document.get("targets", [])
            ]
            return [_simple_table(("metric", "target", "value", "verdict"), rows)]
        rows = []
        for name, found in document["metrics"].items():
            unit = found.get("unit", "")
            rows.append(
                (
                    name,
                    _figure(found.get("median"), unit),
                    unit if unit != "fraction" else "",
                    found.get("ceiling") or "",
                    _figure(found.get("ceiling_median")),
                    _figure(found.get("ratio")),
                )
            )
        headers = ("metric", "median", "unit", "ceiling", "ceiling's median", "ratio")
        return [_simple_table(headers, rows)]


class BenchMachineDirective(_BenchDirective):
    def run(self) -> list[nodes.Node]:
        document = self.document_json()
        machine, config = document.get("machine", {}), document.get("config", {})
        facts = [
            ("PostgreSQL", str(machine.get("server_version", "?"))),
            ("server", str(machine.get("server", "?"))),
            (
                "fsync, synchronous_commit",
                f"{machine.get('fsync')}, {machine.get('synchronous_commit')}",
            ),
            ("CPUs", str(machine.get("cpus", "?"))),
            ("platform", str(machine.get("platform", "?"))),
            (
                "Python, SQLAlchemy, psycopg",
                f"{machine.get('python')}, {machine.get('sqlalchemy')}, {machine.get('psycopg')}",
            ),
            ("runs per figure (medians)", str(machine.get("repeat", config.get("repeat", "?")))),
            ("sections", ", ".join(config.get("sections", []))),
            (
                "jobs per batched run, per one-per-claim run",
                f"{config.get('jobs')}, {config.get('single_jobs')}",
            ),
            ("batched drains' Worker(concurrency=...)", str(config.get("concurrency"))),
            ("ceiling's batch sizes", ", ".join(map(str, config.get("sweep", [])))),
        ]
        items = nodes.bullet_list()
        for name, value in facts:
            items += nodes.list_item("", _para(f"{name}: ", nodes.literal(value, value)))
        skipped = document.get("skipped") or {}
        for section, why in skipped.items():
            items += nodes.list_item("", _para(f"section {section} skipped: {why}"))
        return [items]


# -- References into the package's internals -----------------------------------------------
#
# Docstrings name internal modules and objects (sqla_jobs._queries.claim, a handler's
# TypeVar), and names imported only for type checking (Session, timedelta); the reference
# documents the public modules only. A reference that Sphinx cannot resolve is looked up in
# Python from the referring object's module: if it is the same object as one the reference
# documents under another name (sqla_jobs.queue.ClaimedJob is sqla_jobs.ClaimedJob), it
# links there; if it exists but is not documented, it is shown as code without a link.
# A reference to nothing that exists still warns (and fails the build).

_DOCUMENTED_KINDS = ("class", "exception", "function", "method", "module", "property")


@functools.cache
def _lookup(name: str) -> tuple[bool, Any]:
    """Import the longest module prefix of a dotted name, then get the rest."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for part in parts[cut:]:
                found = getattr(found, part)
        except AttributeError:
            return False, None
        return True, found
    return False, None


@functools.cache
def _type_checking_imports(module: str) -> dict[str, str]:
    """``name -> module.name`` for every ``from module import name`` in a module's source
    (those under ``if TYPE_CHECKING:`` included, which getattr cannot see)."""
    import ast

    try:
        source = inspect.getsource(importlib.import_module(module))
    except (OSError, TypeError, ImportError):
        return {}
    names = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _documented(env: Any) -> dict[int, tuple[str, Any]]:
    cache: dict[int, tuple[str, Any]] | None = getattr(env, "_sqla_jobs_documented", None)
    if cache is None:
        cache = {}
        keep = []
        for name, entry in env.domains.python_domain.objects.items():
            if entry.aliased or entry.objtype not in _DOCUMENTED_KINDS:
                continue
            found, obj = _lookup(name)
            if found and (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)):
                cache.setdefault(id(obj), (name, entry))
                keep.append(obj)
        env._sqla_jobs_documented = cache
        env._sqla_jobs_documented_objects = keep  # the ids stay valid while these live
    return cache


@functools.lru_cache(maxsize=1)
def _package_names() -> dict[str, str]:
    """Every name bound at the top of a loaded ``sqla_jobs`` module, defined there or
    imported (type-checking imports included) -> a dotted path to it."""
    import sys

    found: dict[str, str] = {}
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not (
            module_name == "sqla_jobs" or module_name.startswith("sqla_jobs.")
        ):
            continue
        for name in vars(module):
            found.setdefault(name, f"{module_name}.{name}")
        for name, path in _type_checking_imports(module_name).items():
            found.setdefault(name, path)
    return found


def _referrer_module(node: Any) -> str:
    """The module of the object whose docstring holds the reference (its ``source`` reads
    ``path:docstring of package.module.name``), or ""."""
    source = str(node.source or "")
    _, marker, dotted = source.partition(":docstring of ")
    if not marker:
        return ""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        found, obj = _lookup(name)
        if found and inspect.ismodule(obj):
            return name
    return ""


def _missing_reference(
    app: Sphinx, env: Any, node: Any, contnode: nodes.Element
) -> nodes.Element | None:
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip(".~")
    klass = node.get("py:class") or ""
    head, _, rest = target.partition(".")
    candidates = [target]
    for module in dict.fromkeys((node.get("py:module") or "", _referrer_module(node))):
        if not module:
            continue
        if klass:
            candidates.append(f"{module}.{klass}.{target}")
        candidates.append(f"{module}.{target}")
        imported = _type_checking_imports(module).get(head)
        if imported:
            candidates.append(f"{imported}.{rest}" if rest else imported)
    candidates.append(f"sqla_jobs.{target}")  # the package's public face
    anywhere = _package_names().get(head)
    if anywhere:
        candidates.append(f"{anywhere}.{rest}" if rest else anywhere)
    for candidate in candidates:
        found, obj = _lookup(candidate)
        if not found:
            continue
        documented = _documented(env).get(id(obj))
        if documented is not None:
            from sphinx.util.nodes import make_refnode

            name, entry = documented
            return make_refnode(
                app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name
            )
        return contnode  # exists, but not in the reference: shown unlinked
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", _missing_reference)
    app.add_directive("sqla-jobs-cli", CliDirective)
    app.add_directive("sqla-jobs-columns", ColumnsDirective)
    app.add_directive("sqla-jobs-bench-chart", BenchChartDirective)
    app.add_directive("sqla-jobs-bench-table", BenchTableDirective)
    app.add_directive("sqla-jobs-bench-machine", BenchMachineDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
