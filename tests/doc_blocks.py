"""The fenced code blocks of the README and of the documentation pages, read and run as
tests/test_readme.py and tests/test_docs.py run them.

A page is Markdown (MyST for docs/). Every fenced block has a language the page's test
allows (a directive fence such as ```` ```{toctree} ```` is Sphinx's, not code). Every
``python`` block runs, top to bottom, in one namespace per page, on a fresh database whose
URL replaces :data:`PLACEHOLDER_URL`, unless an HTML comment right before its fence marks it
(``readme-test`` in the README, ``docs-test`` in docs/):

``<!-- docs-test: not run, REASON -->``
    compiled only; the page's text must say what the block leaves out.
``<!-- docs-test: alembic revision -->``
    a revision file: its ``upgrade()`` and ``downgrade()`` run inside an Alembic migration
    context on a database of their own (:func:`run_revisions`).
``<!-- docs-test: alembic revision, after the one above -->``
    the same, on the database the previous revision block of the page has upgraded.
``<!-- privileges-test: LABEL -->``
    before a ``sql`` block: tests/test_privileges.py runs it as the role setup it is.

A docs page may continue another page's setup (its models and engine) through one line that
is not attached to a block, before its first block: ``<!-- docs-test: after tutorial.md -->``
(a path under docs/). The test then runs that page's blocks first, in the same namespace and
on the same database, then this page's; :func:`chain` follows such lines (a cycle fails).

``sh`` blocks are read for their ``sqla-jobs`` commands (:func:`commands`), which the tests
parse with the command's own parser.
"""

from __future__ import annotations

import re
import shlex
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PLACEHOLDER_URL = "postgresql+psycopg://app@localhost/app"
NOT_RUN = "not run"
ALEMBIC = "alembic revision"
ALEMBIC_AFTER = "alembic revision, after the one above"
AFTER = "after "
PRIVILEGES = "privileges-test"
MARKER = re.compile(r"<!--\s*([a-z]+-test):\s*(.*?)\s*-->")
FENCE = re.compile(r"^(`{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    source: str  # the page's path, relative to the repository: README.md, docs/tutorial.md
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    kind: str | None  # the marker's kind (readme-test, docs-test, privileges-test), if any
    marker: str | None  # the text of the marker right before the fence, if any
    marker_line: int | None

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language == "python" and self.marker is None

    @property
    def directive(self) -> bool:
        return self.language.startswith("{")

    @property
    def revision(self) -> bool:
        return (self.marker or "").startswith(ALEMBIC)


@dataclass(frozen=True)
class Page:
    """A Markdown page: its path relative to the repository, its text and its blocks."""

    source: str
    text: str
    blocks: tuple[Block, ...]

    @property
    def path(self) -> Path:
        return ROOT / self.source

    @property
    def runnable(self) -> list[Block]:
        return [block for block in self.blocks if block.runs]

    def section(self, heading: str) -> str:
        """The text under ``heading`` (a whole heading line, ``## Name``), up to the next
        heading of the same or a higher level."""
        level = len(heading) - len(heading.lstrip("#"))
        lines = self.text.splitlines()
        assert heading in lines, f"{self.source} has no heading {heading!r}"
        start = lines.index(heading) + 1
        end, fenced = start, False
        while end < len(lines):
            line = lines[end]
            if line.startswith("```"):
                fenced = not fenced
            hashes = len(line) - len(line.lstrip("#"))
            if not fenced and 0 < hashes <= level and line[hashes : hashes + 1] == " ":
                break
            end += 1
        return "\n".join(lines[start:end])


def read_blocks(text: str, source: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.lstrip().startswith(("```", "~~~")):
            index += 1
            continue
        found = FENCE.match(line)
        assert found, f"{source}:{index + 1}: fence with ``` at the start of the line only"
        ticks, language = found.group(1), found.group(2).strip()
        end = index + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        assert end < len(lines), f"{source}:{index + 1}: the block is never closed"
        before = index - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.fullmatch(lines[before].strip()) if before >= 0 else None
        blocks.append(
            Block(
                source=source,
                line=index + 1,
                language=language,
                code="\n".join(lines[index + 1 : end]) + "\n",
                kind=marker.group(1) if marker else None,
                marker=marker.group(2) if marker else None,
                marker_line=before + 1 if marker else None,
            )
        )
        index = end + 1
    return blocks


def markers(text: str) -> list[tuple[int, str, str]]:
    """Every marker line of ``text``: (line number, kind, text)."""
    return [
        (number, found.group(1), found.group(2))
        for number, line in enumerate(text.splitlines(), start=1)
        if (found := MARKER.fullmatch(line.strip()))
    ]


def load(path: Path) -> Page:
    source = path.resolve().relative_to(ROOT).as_posix()
    text = path.read_text(encoding="utf-8")
    return Page(source, text, tuple(read_blocks(text, source)))


def docs_pages() -> list[Page]:
    """Every Markdown page under docs/, in path order."""
    return [load(path) for path in sorted(DOCS.rglob("*.md")) if "_build" not in path.parts]


def prelude(page: Page, kind: str = "docs-test") -> str | None:
    """The docs page that ``page`` continues (its ``after PAGE`` line), if any."""
    found = [text for _, k, text in markers(page.text) if k == kind and text.startswith(AFTER)]
    assert len(found) <= 1, f"{page.source}: more than one '{AFTER}PAGE' line"
    return found[0][len(AFTER) :].strip() if found else None


def chain(page: Page) -> list[Page]:
    """``page`` after the pages it continues, the first one first."""
    pages = [page]
    while (name := prelude(pages[0])) is not None:
        path = DOCS / name
        assert path.is_file(), f"{pages[0].source}: '{AFTER}{name}' names no page under docs/"
        before = load(path)
        assert before.source not in {p.source for p in pages}, f"{page.source}: a cycle of preludes"
        pages.insert(0, before)
    return pages


def check_blocks(page: Page, kind: str, languages: frozenset[str]) -> None:
    """The rules of the module docstring, for one page whose own marker kind is ``kind``."""
    first_block = min((block.line for block in page.blocks), default=len(page.text))
    attached = {block.marker_line for block in page.blocks}
    for number, marker_kind, text in markers(page.text):
        where = f"{page.source}:{number}"
        assert marker_kind in (kind, PRIVILEGES), f"{where}: a {marker_kind} marker here"
        if marker_kind == kind and text.startswith(AFTER):
            assert kind == "docs-test", f"{where}: only docs pages continue another page"
            assert number not in attached, f"{where}: '{text}' is right before a block"
            assert number < first_block, f"{where}: '{text}' comes after the page's first block"
        else:
            assert number in attached, f"{where}: marker {text!r} is not right before a block"
    for block in page.blocks:
        if block.directive:
            continue
        assert block.language in languages, (
            f"{block.where}: fence language {block.language!r}; use one of {sorted(languages)}"
        )
        if block.kind == PRIVILEGES:
            assert block.language == "sql", (
                f"{block.where}: a {PRIVILEGES} marker before a non-SQL block"
            )
        elif block.marker is not None:
            assert block.language == "python", f"{block.where}: a marker before a non-Python block"
            reason = block.marker.partition(",")[2].strip()
            known = block.marker in (ALEMBIC, ALEMBIC_AFTER) or (
                block.marker.startswith(NOT_RUN + ",") and reason
            )
            assert known, (
                f"{block.where}: unknown marker {block.marker!r}; use '{NOT_RUN}, REASON', "
                f"'{ALEMBIC}' or '{ALEMBIC_AFTER}'"
            )
        elif block.language == "sql":
            raise AssertionError(
                f"{block.where}: an SQL block runs only with a {PRIVILEGES} marker"
            )
        if block.language == "python":
            compile(block.code, block.where, "exec")


# -- running ----------------------------------------------------------------------------------


def engine_holders(blocks: list[Block]) -> list[Block]:
    literal = f'"{PLACEHOLDER_URL}"'
    return [block for block in blocks if block.runs and literal in block.code]


@contextmanager
def running(blocks: list[Block], url: str, module_name: str) -> Iterator[dict[str, Any]]:
    """Run ``blocks`` (their runnable ones, in order) in the namespace of one new module, the
    placeholder URL replaced by ``url``; yield the namespace, then dispose of its engines."""
    literal = f'"{PLACEHOLDER_URL}"'
    module = types.ModuleType(module_name)
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    try:
        for block in blocks:
            if not block.runs:
                continue
            code = compile(block.code.replace(literal, repr(url)), block.where, "exec")
            try:
                exec(code, namespace)
            except Exception as exc:
                raise AssertionError(f"the block at {block.where} failed: {exc!r}") from exc
        _dispose(namespace)  # the pages' pools close between pages (they reconnect when used)
        yield namespace
    finally:
        _dispose(namespace)
        del sys.modules[module.__name__]


def _dispose(namespace: dict[str, Any]) -> None:
    for value in list(namespace.values()):
        if isinstance(value, sa.Engine):
            value.dispose()


def migrate(engine: sa.Engine, step: Callable[[], None]) -> None:
    """Run ``step`` as a revision's ``upgrade()`` or ``downgrade()`` runs (Alembic's
    ``autocommit_block()`` included), and commit."""
    with engine.connect() as connection:
        context = MigrationContext.configure(connection)
        with Operations.context(context), context.begin_transaction():
            step()


def _tables(engine: sa.Engine) -> set[str]:
    with engine.connect() as connection:
        return set(sa.inspect(connection).get_table_names())


def revision_groups(page: Page) -> list[list[Block]]:
    """The page's revision blocks, grouped: a block marked '... after the one above' joins
    the group of the revision block before it."""
    groups: list[list[Block]] = []
    for block in page.blocks:
        if block.marker == ALEMBIC_AFTER:
            assert groups, f"{block.where}: no revision block above it"
            groups[-1].append(block)
        elif block.marker == ALEMBIC:
            groups.append([block])
    return groups


def revisions_of(group: list[Block]) -> list[dict[str, Any]]:
    """The namespaces of the revision blocks of ``group``, each run as a module of its own."""
    revisions: list[dict[str, Any]] = []
    for block in group:
        revision: dict[str, Any] = {}
        exec(compile(block.code, block.where, "exec"), revision)
        revisions.append(revision)
    return revisions


def run_revisions(
    group: list[Block], engine: sa.Engine, check: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """Upgrade each revision of ``group`` in turn, call ``check`` (if given), then downgrade
    them in reverse; the tables must then be the ones there were before. Returns the
    revisions' namespaces."""
    revisions = revisions_of(group)
    before = _tables(engine)
    for revision in revisions:
        migrate(engine, revision["upgrade"])
    if check is not None:
        check()
    for revision in reversed(revisions):
        migrate(engine, revision["downgrade"])
    after = _tables(engine)
    assert after == before, f"{group[0].where}: the downgrade left {after ^ before}"
    return revisions


def commands(block: Block) -> Iterator[list[str]]:
    """The arguments of every ``sqla-jobs`` command of an ``sh`` block."""
    for line in block.code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "sqla-jobs":
            yield words[1:]


def parse_command(argv: list[str], where: str) -> None:
    """Parse ``sqla-jobs ARGV`` as the command would (the bench's own options included), or
    fail naming ``where``."""
    import sqla_jobs
    from sqla_jobs.bench import runner as bench
    from sqla_jobs.cli import build_parser

    argv = list(argv)
    if "--baseline" in argv:  # the checkout it names is the reader's: this one here
        argv[argv.index("--baseline") + 1] = str(Path(sqla_jobs.__file__).parent.parent)
    try:
        args, unknown = build_parser().parse_known_args(argv)
        if args.command == "bench":
            bench._config(bench._parser().parse_args([*unknown, *args.bench_args]), "postgresql://")
        else:
            assert unknown == [], f"{where}: sqla-jobs {argv}: unknown {unknown}"
    except SystemExit as exc:
        raise AssertionError(f"{where}: `sqla-jobs {shlex.join(argv)}`") from exc


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as connection:
        return connection.execute(sa.text(sql), params).scalar()


def normalized(text: str) -> str:
    return " ".join(text.split())


def table_rows(text: str, first_cell: str = "| `") -> list[list[list[str]]]:
    """The Markdown tables of ``text`` whose rows start with ``first_cell``: rows of cells,
    backticks removed."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith(first_cell):
            current.append([cell.strip().replace("`", "") for cell in line.strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables
