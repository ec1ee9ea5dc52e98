"""Every code block of README.md runs as written, in order, against a fresh server.

Fenced blocks tagged python run with the interpreter, each as a program of its own (as a reader
who copies it would run it); bash blocks run with `bash -e -o pipefail`, with the `redisq`
command of this interpreter on PATH. REDIS_URL names the fresh server and REDISQ_HOME a
directory of the test, so no block touches the user's embedded server. An HTML comment on the
line before a block marks it:

    <!-- readme-test: skip (why it cannot run here) -->   never run; kept few (see below)
    <!-- readme-test: spark -->                           run only by the test marked spark

Blocks without a language (the module tree) are not programs and are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import ServerProcess

README = Path(__file__).resolve().parent.parent / "README.md"
RUNNABLE = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
MAX_SKIPPED = 2
_MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<marker>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
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
        return f"README.md:{self.line} ({self.lang} block)"


def blocks(text: str) -> list[Block]:
    """The fenced code blocks, with the marker on the line before each."""
    found = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        previous = _MARKER.match(lines[i - 1]) if i else None
        found.append(
            Block(
                line=i + 1,
                lang=opening.group("lang"),
                code="\n".join(lines[i + 1 : end]) + "\n",
                marker=previous.group("marker") if previous else "",
            )
        )
        i = end + 1
    return found


def test_blocks_are_known_and_few_are_skipped() -> None:
    found = blocks(README.read_text())
    assert sum(1 for b in found if b.lang == "python") >= 4
    for block in found:
        assert block.lang in RUNNABLE or block.lang == "", f"{block.where()}: unknown language"
        if not block.lang:  # not a program: it must not look like one
            assert not re.search(r"^\s*(redisq|python|import|pip) ", block.code, re.M), (
                f"{block.where()} looks like code: tag it python or bash"
            )
        if block.marker:
            assert block.spark or re.fullmatch(r"skip \(.+\)", block.marker), (
                f"{block.where()}: marker {block.marker!r} is neither spark nor skip (reason)"
            )
    skipped = [b.where() for b in found if b.skipped]
    assert len(skipped) <= MAX_SKIPPED, f"too many README blocks skipped: {skipped}"


@pytest.fixture
def readme_env(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
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
        # `redisq server start` in a block starts the embedded server of REDISQ_HOME: stop it.
        subprocess.run(
            [sys.executable, "-m", "redisq.cli", "server", "stop"],
            env=env,
            capture_output=True,
            timeout=60,
        )
        server.stop()


def run_blocks(env: dict[str, str], work: Path, *, spark: bool) -> int:
    ran = 0
    for block in blocks(README.read_text()):
        if block.lang not in RUNNABLE or block.skipped or (block.spark and not spark):
            continue
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


def test_readme_runs_as_written(readme_env: tuple[dict[str, str], Path]) -> None:
    """Every block but the Spark ones (the next test) and the few skipped."""
    env, work = readme_env
    assert run_blocks(env, work, spark=False) >= 5


@pytest.mark.spark
@pytest.mark.timeout(1800)  # a Spark session, and a JVM for each `redisq audit`
def test_readme_runs_as_written_with_spark(readme_env: tuple[dict[str, str], Path]) -> None:
    """Every block, the Spark ones included, in order (one Spark session for the Python one;
    each `redisq audit` starts its own, as it does for a user)."""
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    env, work = readme_env
    assert run_blocks(env, work, spark=True) >= 7
