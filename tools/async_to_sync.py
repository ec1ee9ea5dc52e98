#!/usr/bin/env python
"""Generate redisq's thread (sync) drivers from their asyncio sources.

Every behaviour of the drivers above the socket is written once, in asyncio (the files named in
SOURCES, `*_async.py`); the sync module beside each (`producer_async.py` -> `producer.py`) is
generated from it, as psycopg 3 generates its sync code (tools/async_to_sync.py there). What
differs between the two runtimes lives in redisq/runtime.py: a pair of small names
per primitive (`AEvent` / `Event`, `aspawn` / `spawn`, ...), which the generator maps.

    python tools/async_to_sync.py           # write every generated module
    python tools/async_to_sync.py --check   # exit 1 naming every stale one (CI runs this)

The transformation works on tokens, so comments, docstrings and blank lines survive; ruff then
formats the result (a line that lost its `await` may now fit on one line):
- `async def` / `async with` / `async for` lose `async`; `await x` becomes `x`;
- `if is_async(): <a> else: <b>` keeps only <b> (dedented), for the few places where the two
  runtimes do different things that no primitive names;
- names are mapped: a module `x_async` (a file of redisq/) becomes `x`; `AsyncFoo` becomes
  `Foo`; the primitives and NAMES; `Awaitable[T]` becomes `T`;
- the result must hold no `await`, no `async`, no `asyncio` and no `is_async`: anything left
  over is an error, not a silent difference.

One check runs on the source as well: no `await` inside `with self._guard:` (the state guard is
no lock at all in asyncio, where code between two awaits runs alone, and a threading.RLock in
the sync driver: an await under it would become a blocking call holding the lock).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The asyncio sources; each generates the module of the same name without `_async`.
SOURCES = [
    "redisq/server/scripts_async.py",
    "redisq/server/handle_async.py",
    "redisq/broker_async.py",
    "redisq/schedule/scheduler_async.py",
    "redisq/produce/transactional_async.py",
    "redisq/produce/delayed_sender_async.py",
    "redisq/produce/sender_async.py",
    "redisq/produce/producer_async.py",
    "redisq/consume/idempotent_async.py",
    "redisq/consume/membership_async.py",
    "redisq/consume/letters_async.py",
    "redisq/consume/partition_io_async.py",
    "redisq/consume/worker_async.py",
    "redisq/consume/coordinator_async.py",
    "redisq/consume/consumer_async.py",
    "redisq/consume/poller_async.py",
]

# Hand-written per runtime (they own sockets or event-loop plumbing): never generated.
HANDWRITTEN = [
    "redisq/server/connection_async.py",
    "redisq/server/transport_async.py",
    "redisq/produce/futures_async.py",
]

# The primitives of redisq/runtime.py and the few names of the standard library and
# redis-py that differ; everything else is mapped by the rules in rename().
NAMES = {
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "aclose": "close",
    "StopAsyncIteration": "StopIteration",
    "AsyncIterator": "Iterator",
    "AsyncIterable": "Iterable",
    "AsyncGenerator": "Generator",
    "AbstractAsyncContextManager": "AbstractContextManager",
    "asynccontextmanager": "contextmanager",
}

HEADER = (
    "# WARNING: generated from {source} by tools/async_to_sync.py; do not edit.\n"
    "# Change {source} and run `python tools/async_to_sync.py`.\n"
)

_ASYNC_CLASS = re.compile(r"^Async([A-Z]\w*)$")
_PRIMITIVE = re.compile(r"^(A[A-Z]\w*|a[a-z]\w*)$")


class GenerationError(Exception):
    pass


def primitive_names() -> dict[str, str]:
    """The async -> sync names of redisq/runtime.py: each async name there (AFoo,
    afoo) has its sync twin (Foo, foo) in the same module."""
    path = ROOT / "redisq" / "runtime.py"
    tree = ast.parse(path.read_text())
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    names: dict[str, str] = {}
    for name in defined:
        if not _PRIMITIVE.match(name):
            continue
        twin = name[1:]
        if twin in defined:
            names[name] = twin
    return names


def async_modules() -> set[str]:
    """The modules named `x_async` (sources and hand-written ones): only these lose `_async`
    (a method such as send_async keeps its name)."""
    return {path.stem for path in (ROOT / "redisq").rglob("*_async.py")}


_MODULES: set[str] = set()


def rename(name: str, primitives: dict[str, str]) -> str:
    if name == "is_async":  # its branches are gone; ruff drops the import left unused
        return name
    if name in NAMES:
        return NAMES[name]
    if name in primitives:
        return primitives[name]
    if not _MODULES:
        _MODULES.update(async_modules())
    if name in _MODULES:
        return name.removesuffix("_async")
    match = _ASYNC_CLASS.match(name)
    if match:
        return match.group(1)
    return name


def _is_async_test(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and test.func.id == "is_async"
        and not test.args
    )


def drop_async_branches(source: str) -> str:
    """`if is_async(): <a> [else: <b>]` -> <b> dedented to the if's level (nothing without an
    else), and `<a> if is_async() else <b>` -> <b>. Works on lines and spans, innermost last,
    so that comments in <b> stay."""
    source = _drop_async_expressions(source)
    while True:
        tree = ast.parse(source)
        target = None
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _is_async_test(node.test):
                if target is None or node.lineno > target.lineno:
                    target = node
        if target is None:
            return source
        lines = source.splitlines(keepends=True)
        start = target.lineno - 1
        end = target.end_lineno  # exclusive, in 0-based lines
        kept: list[str] = []
        if target.orelse:
            else_line = target.orelse[0].lineno - 2  # comments may sit between `else:` and it
            while not lines[else_line].lstrip().startswith(("else", "elif")):
                else_line -= 1
            if lines[else_line].lstrip().startswith("elif"):
                raise GenerationError(f"line {else_line + 1}: no elif after `if is_async()`")
            kept = [_dedent(line, 4) for line in lines[else_line + 1 : end]]
        source = "".join(lines[:start] + kept + lines[end:])


def _drop_async_expressions(source: str) -> str:
    """`<a> if is_async() else <b>` -> `<b>` (in parentheses unless it is one token), from the
    last one up (spans stay valid)."""
    while True:
        tree = ast.parse(source)
        found = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.IfExp) and _is_async_test(node.test)
        ]
        if not found:
            return source
        node = max(found, key=lambda n: (n.lineno, n.col_offset))
        lines = source.splitlines(keepends=True)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line.encode()))
        data = source.encode()

        def at(lineno: int, col: int, offsets: list[int] = offsets) -> int:
            return offsets[lineno - 1] + col

        start = at(node.lineno, node.col_offset)
        end = at(node.end_lineno or node.lineno, node.end_col_offset or 0)
        orelse = node.orelse
        kept = data[
            at(orelse.lineno, orelse.col_offset) : at(
                orelse.end_lineno or orelse.lineno, orelse.end_col_offset or 0
            )
        ]
        if b"\n" in kept or b" " in kept.strip():
            kept = b"(" + kept + b")"
        source = (data[:start] + kept + data[end:]).decode()


def _dedent(line: str, by: int) -> str:
    if line.strip() == "":
        return line
    prefix = line[:by]
    if prefix.strip():
        raise GenerationError(f"cannot dedent {line!r}")
    return line[by:]


def check_guarded_awaits(source: str, path: str) -> None:
    """No await inside `with self._guard:` (see the module doc)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, ast.With):
            continue
        guarded = any(
            isinstance(item.context_expr, ast.Attribute) and item.context_expr.attr == "_guard"
            for item in node.items
        )
        if not guarded:
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Await | ast.AsyncWith | ast.AsyncFor):
                raise GenerationError(
                    f"{path}:{inner.lineno}: await under `with self._guard:` (the sync driver "
                    "would block holding the lock)"
                )


def transform_tokens(source: str, primitives: dict[str, str]) -> str:
    """The token-level part: async/await dropped, names mapped, Awaitable[T] -> T."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = source.splitlines(keepends=True)
    # (row, col) -> replacement for a token span; deletions of `async `/`await `
    edits: list[tuple[tuple[int, int], tuple[int, int], str]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == tokenize.NAME:
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if tok.string == "async" and nxt is not None and nxt.string in ("def", "with", "for"):
                edits.append((tok.start, nxt.start, ""))
            elif tok.string == "await":
                end = nxt.start if nxt is not None and nxt.start[0] == tok.end[0] else tok.end
                edits.append((tok.start, end, ""))
            elif tok.string == "Awaitable" and nxt is not None and nxt.string == "[":
                depth = 0
                for j in range(i + 1, len(tokens)):
                    if tokens[j].string == "[":
                        depth += 1
                    elif tokens[j].string == "]":
                        depth -= 1
                        if depth == 0:
                            edits.append((tok.start, nxt.end, ""))
                            edits.append((tokens[j].start, tokens[j].end, ""))
                            break
            else:
                new = rename(tok.string, primitives)
                if new != tok.string:
                    edits.append((tok.start, tok.end, new))
        elif tok.type in (tokenize.STRING, tokenize.COMMENT):
            new = _rename_in_text(tok.string, primitives)
            if new != tok.string:
                edits.append((tok.start, tok.end, new))
        i += 1
    # apply from the end
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def pos(rc: tuple[int, int]) -> int:
        return offsets[rc[0] - 1] + rc[1]

    out = source
    for start, end, new in sorted(edits, key=lambda e: pos(e[0]), reverse=True):
        out = out[: pos(start)] + new + out[pos(end) :]
    return out


_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def _rename_in_text(text: str, primitives: dict[str, str]) -> str:
    """Module and class names in docstrings and comments (`producer_async` -> `producer`)."""

    def sub(match: re.Match[str]) -> str:
        word = match.group(0)
        if word.endswith("_async") or _ASYNC_CLASS.match(word) or word in NAMES:
            return rename(word, primitives)
        return word

    return _WORD.sub(sub, text)


def check_output(text: str, target: str) -> None:
    tree = ast.parse(text)
    for node in ast.walk(tree):
        bad = None
        if isinstance(node, ast.Await | ast.AsyncFunctionDef | ast.AsyncWith | ast.AsyncFor):
            bad = type(node).__name__
        elif isinstance(node, ast.Name) and node.id in ("asyncio", "is_async"):
            bad = node.id
        elif isinstance(node, ast.Attribute) and node.attr == "is_async":
            bad = node.attr
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            module = getattr(node, "module", None) or ""
            if module == "asyncio" or "asyncio" in names or module.startswith("redis.asyncio"):
                bad = "an import of asyncio"
        if bad:
            raise GenerationError(f"{target}:{getattr(node, 'lineno', '?')}: {bad} left over")


def ruff(text: str, target: str) -> str:
    """Imports sorted (renamed modules move) and the code formatted, as ruff does it for the
    rest of the project (pyproject.toml's settings)."""
    for args in (
        ["check", "--select", "I,F401", "--fix", "--quiet", "--exit-zero"],
        ["format", "--quiet"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *args, "--stdin-filename", target, "-"],
            input=text,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if done.returncode != 0:
            raise GenerationError(f"ruff {args[0]} failed on {target}: {done.stderr.strip()}")
        text = done.stdout
    return text


def generate(source_path: str) -> tuple[Path, str]:
    path = ROOT / source_path
    if not path.name.endswith("_async.py"):
        raise GenerationError(f"{source_path}: a source's name ends with _async.py")
    target = path.with_name(path.name.removesuffix("_async.py") + ".py")
    source = path.read_text()
    check_guarded_awaits(source, source_path)
    primitives = primitive_names()
    text = drop_async_branches(source)
    text = transform_tokens(text, primitives)
    text = HEADER.format(source=path.name) + text
    rel_target = str(target.relative_to(ROOT))
    text = ruff(text, rel_target)
    check_output(text, rel_target)
    return target, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a generated file is stale")
    parser.add_argument("sources", nargs="*", help="only these sources (default: all)")
    options = parser.parse_args()
    stale = []
    for source in options.sources or SOURCES:
        try:
            target, text = generate(source)
        except GenerationError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        current = target.read_text() if target.exists() else None
        if current == text:
            continue
        if options.check:
            stale.append(str(target.relative_to(ROOT)))
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print(
            "stale generated modules (run `python tools/async_to_sync.py`): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
