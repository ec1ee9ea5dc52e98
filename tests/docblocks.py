"""The code blocks of README.md and of every page of the docs site (docs/), and how they run.

One mechanism for every page a reader sees (tests/docs/test_readme.py runs the README's blocks,
tests/docs/test_pages_run.py every docs page's): fenced blocks tagged python run with the
interpreter, each as a program of its own (as a reader who copies it would run it); bash blocks
run with `bash -e -o pipefail`, with the `redisq` command of this interpreter on PATH. A page's
blocks run in order, against a fresh server of the page's own (so each page works in a namespace
nobody else writes to): REDIS_URL names it and REDISQ_HOME is a directory of the test, so no
block touches the user's embedded server or a shared one. An HTML comment on the line before a
block marks it:

    <!-- readme-test: skip (why it cannot run here) -->   never run; kept few (MAX_SKIPPED)
    <!-- readme-test: spark -->                           run only by the tests marked spark

Blocks without a language, or tagged text (a module tree, a Redis command to type), are not
programs and are not run; they must not look like a Python or shell program.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.servers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RUNNABLE = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
NOT_PROGRAMS = {"", "text"}  # a module tree, a Redis command to type, a picture
MAX_SKIPPED = 2  # per page: a skipped block is a promise nobody checks
# Pages on the site whose blocks are not run, each with its reason. Keep it to this one.
NOT_RUN: dict[str, str] = {}
_MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<marker>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. "docs/producing.md"
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str = ""

    @property
    def skipped(self) -> bool:
        return self.marker.startswith("skip")

    @property
    def spark(self) -> bool:
        return self.marker == "spark"

    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.lang or 'plain'} block)"


def pages() -> list[Path]:
    """README.md and every Markdown page of the site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with the marker on the line before each."""
    found = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = opening.group("indent")
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        previous = _MARKER.match(lines[i - 1].strip()) if i else None
        code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]) + "\n"
        found.append(
            Block(
                page=name(page),
                line=i + 1,
                lang=opening.group("lang"),
                code=code,
                marker=previous.group("marker") if previous else "",
            )
        )
        i = end + 1
    return found


def problems(page: Path) -> list[str]:
    """What is wrong with a page's blocks: an unknown language, a plain block that looks like a
    program, a marker that is neither spark nor skip with a reason, too many skipped."""
    found = []
    page_blocks = blocks(page)
    for block in page_blocks:
        if block.lang not in RUNNABLE and block.lang not in NOT_PROGRAMS:
            found.append(f"{block.where()}: unknown language {block.lang!r}")
        looks_like_code = re.search(r"^\s*(redisq|python|import|pip) ", block.code, re.M)
        if block.lang in NOT_PROGRAMS and looks_like_code:
            found.append(f"{block.where()} looks like code: tag it python or bash")
        if block.marker and not (block.spark or re.fullmatch(r"skip \(.+\)", block.marker)):
            found.append(f"{block.where()}: marker {block.marker!r}: neither spark nor skip (why)")
    skipped = [b.where() for b in page_blocks if b.skipped]
    if len(skipped) > MAX_SKIPPED:
        found.append(f"too many blocks skipped: {skipped}")
    return found


def runnable(page: Path, *, spark: bool) -> list[Block]:
    if name(page) in NOT_RUN:
        return []
    return [
        b for b in blocks(page) if b.lang in RUNNABLE and not b.skipped and (spark or not b.spark)
    ]


@contextmanager
def page_environment(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """A fresh server and a work directory for one page's blocks; the server, and any embedded
    server a block started (`redisq server start`), stopped afterwards."""
    server = ServerProcess().start()
    env = {
        **os.environ,
        "REDIS_URL": server.url,
        "REDISQ_HOME": str(tmp_path / "redisq-home"),
        "TMPDIR": str(tmp_path),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONUNBUFFERED": "1",
    }
    work = tmp_path / "work"
    work.mkdir()
    try:
        yield env, work
    finally:
        subprocess.run(
            [sys.executable, "-m", "redisq.cli", "server", "stop"],
            env=env,
            capture_output=True,
            timeout=60,
        )
        server.stop()


def run_blocks(page: Path, env: dict[str, str], work: Path, *, spark: bool) -> int:
    """Run a page's blocks in order; fail on the first that exits non-zero. Returns how many ran."""
    ran = 0
    for block in runnable(page, spark=spark):
        if RUNNABLE[block.lang] == "python":
            command = [sys.executable, "-c", block.code]
        else:
            command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
        started = time.monotonic()
        result = subprocess.run(
            command, cwd=work, env=env, capture_output=True, text=True, timeout=900
        )
        print(f"{block.where()}: {time.monotonic() - started:.1f} s")
        assert result.returncode == 0, (
            f"{block.where()} exited {result.returncode}\n--- code\n{block.code}"
            f"--- stdout (tail)\n{result.stdout[-3000:]}\n--- stderr (tail)\n"
            f"{result.stderr[-3000:]}"
        )
        ran += 1
    return ran
