"""What the reference pages are generated from, read from the code: the commands of an
argparse parser, and the columns a declarative mixin gives a table.

Plain Python (argparse, SQLAlchemy), no Sphinx: the extension (:mod:`sqla_jobs_docs`) turns
these into pages, and tests/test_docs_reference.py checks them against the code without
building the site.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ColumnDoc",
    "CommandDoc",
    "OptionDoc",
    "cli_commands",
    "docstring_entries",
    "load_object",
    "mixin_columns",
    "parse_descriptions",
]


def load_object(spec: str) -> Any:
    """``package.module:attribute`` -> the attribute."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{spec!r}: expected MODULE:NAME")
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


# -- The command line -----------------------------------------------------------------------

USAGE_WIDTH = 88


@dataclass
class OptionDoc:
    """One argument of a command: an option (``--name``) or a positional argument."""

    names: list[str]
    argument: str  # the option's metavar ("" for a flag), or the positional's name
    help: str
    default: str = ""
    choices: list[str] = field(default_factory=list)
    required: bool = False
    excludes: list[str] = field(default_factory=list)  # its mutually exclusive group's others

    @property
    def positional(self) -> bool:
        return not self.names[0].startswith("-")


@dataclass
class CommandDoc:
    """One command: ``sqla-jobs`` itself, or one of its subcommands."""

    prog: str
    help: str
    description: str
    usage: str
    options: list[OptionDoc]
    subcommands: list[str] = field(default_factory=list)

    @property
    def program_id(self) -> str:
        """The program name Sphinx's ``option`` role looks options up under."""
        return "-".join(self.prog.split())


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    if "%" not in action.help:
        return action.help
    return argparse.HelpFormatter(parser.prog)._expand_help(action)


def _argument(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices is not None and not action.option_strings:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper() if action.option_strings else action.dest


def _default(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 or default is None or default == argparse.SUPPRESS:
        return ""
    if isinstance(default, float) and default.is_integer():
        return f"{default:g}"
    return str(default)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:  # type: ignore[type-arg]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def cli_commands(
    parser: argparse.ArgumentParser,
    expand: dict[str, argparse.ArgumentParser] | None = None,
) -> list[CommandDoc]:
    """The parser and every subcommand under it, depth first, as :class:`CommandDoc`.

    ``expand`` maps a subcommand's prog (``"sqla-jobs bench"``) to the parser that parses its
    remaining arguments itself; that parser's options are documented as the subcommand's.
    """
    commands: list[CommandDoc] = []
    _walk(parser, "", commands, expand or {})
    return commands


def _walk(
    parser: argparse.ArgumentParser,
    help_text: str,
    out: list[CommandDoc],
    expand: dict[str, argparse.ArgumentParser],
) -> None:
    own = expand.get(parser.prog)
    if own is not None:
        description = parser.description
        parser = own
        parser.description = parser.description or description
    excluded: dict[int, list[str]] = {}
    for group in parser._mutually_exclusive_groups:
        for action in group._group_actions:
            excluded[id(action)] = [
                other.option_strings[0] if other.option_strings else other.dest
                for other in group._group_actions
                if other is not action
            ]
    options = []
    sub = _subparsers(parser)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action is sub:
            continue
        if action.nargs == argparse.REMAINDER:
            continue  # handed to another parser, documented as its own command
        names = list(action.option_strings) or [_argument(action)]
        options.append(
            OptionDoc(
                names=names,
                argument=_argument(action),
                help=_help(parser, action),
                default=_default(action),
                choices=[str(c) for c in action.choices] if action.choices is not None else [],
                required=bool(action.required) and bool(action.option_strings),
                excludes=excluded.get(id(action), []),
            )
        )
    command = CommandDoc(
        prog=parser.prog,
        help=help_text,
        description=parser.description or "",
        usage=_usage(parser),
        options=options,
    )
    out.append(command)
    if sub is None:
        return
    helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    for name, child in sub.choices.items():
        command.subcommands.append(name)
        _walk(child, helps.get(name, ""), out, expand)


# -- The mixins' columns --------------------------------------------------------------------


@dataclass
class ColumnDoc:
    name: str
    type: str
    nullable: bool
    default: str
    doc: str  # from the code ("" when it has none)
    primary_key: bool = False


def docstring_entries(doc: str | None) -> dict[str, str]:
    """The ``name`` / indented text entries of a docstring (reST definition lists whose
    term is one literal, as LeaseMixin's docstring writes its columns)."""
    entries: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    for index, line in enumerate(lines):
        match = re.fullmatch(r"``(\w+)``", line)
        if not match:
            continue
        body = []
        for following in lines[index + 1 :]:
            if following.startswith("    ") or (not following.strip() and body == []):
                body.append(following.strip())
            else:
                break
        text = " ".join(part for part in body if part)
        if text:
            entries[match.group(1)] = text
    return entries


def _probe(mixin: type) -> Any:
    """A model of its own that mixes ``mixin`` in (on a metadata of its own)."""
    from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

    class Base(DeclarativeBase):
        pass

    namespace: dict[str, Any] = {"__tablename__": f"docs_probe_{mixin.__name__.lower()}"}
    if not any(
        getattr(value, "column", None) is not None and value.column.primary_key
        for klass in mixin.__mro__
        for value in vars(klass).values()
    ):
        namespace["__annotations__"] = {"probe_id": Mapped[int]}
        namespace["probe_id"] = mapped_column(primary_key=True)
    return type(f"Docs{mixin.__name__}Probe", (mixin, Base), namespace)


def _default_text(column: Any) -> str:
    from sqlalchemy import Identity
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.schema import DefaultClause

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    if isinstance(column.identity, Identity) or (
        column.primary_key and column.autoincrement is True
    ):
        return "identity"
    server = column.server_default
    if isinstance(server, DefaultClause):
        arg = server.arg
        if isinstance(arg, str):
            return f"'{arg}'"
        return str(arg.compile(dialect=dialect))
    if column.default is not None and getattr(column.default, "is_scalar", False):
        return repr(column.default.arg)
    return ""


def mixin_columns(mixin: type) -> list[ColumnDoc]:
    """The columns ``mixin`` adds, in declaration order, read from a probe model."""
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    probe = _probe(mixin)
    table = probe.__table__
    from_docstring = docstring_entries(mixin.__doc__)
    own = [
        name
        for klass in reversed(mixin.__mro__)
        for name, value in vars(klass).items()
        if getattr(value, "column", None) is not None
    ]
    columns = []
    for name in dict.fromkeys(own):
        column = table.c[name]
        doc = column.doc or column.comment or from_docstring.get(name, "")
        columns.append(
            ColumnDoc(
                name=name,
                type=column.type.compile(dialect=dialect)
                .lower()
                .replace("timestamp with time zone", "timestamptz"),
                nullable=bool(column.nullable),
                default=_default_text(column),
                doc=" ".join(doc.split()),
                primary_key=bool(column.primary_key),
            )
        )
    return columns


def parse_descriptions(lines: Iterable[str]) -> dict[str, str]:
    """A MyST definition list (``name``, then ``: text``, continued by indented lines) ->
    {name: text}."""
    found: dict[str, str] = {}
    term: str | None = None
    for raw in lines:
        line = raw.rstrip()
        if not line.strip():
            continue
        if line.startswith(": ") and term is not None:
            found[term] = line[2:].strip()
        elif line.startswith((" ", "\t")) and term is not None and term in found:
            found[term] += " " + line.strip()
        else:
            term = line.strip().strip("`")
    return found


# -- What autodoc renders of a module -------------------------------------------------------


def attribute_docs(module_name: str) -> set[str]:
    """The module-level names of a module's own source that carry a doc comment (``#:`` on
    the lines right above the assignment, or on its line) or a docstring right after it:
    the data ``automodule`` renders. Data without one (and data a module only imports) it
    leaves out, even with ``:undoc-members:``, so a page names those with ``autodata``."""
    import ast

    module = importlib.import_module(module_name)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return set()
    lines = source.splitlines()
    body = ast.parse(source).body
    found: set[str] = set()
    for index, node in enumerate(body):
        if isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        else:
            continue
        above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
        inline = "#:" in lines[node.lineno - 1]
        after = body[index + 1] if index + 1 < len(body) else None
        docstring = (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        )
        if above.startswith("#:") or inline or docstring:
            found.update(targets)
    return found
