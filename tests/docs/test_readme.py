"""Every code block of README.md runs as written, in order, against a fresh server.

How blocks are found, marked and run is tests/docblocks.py, which runs every page of the docs
site the same way (tests/docs/test_pages_run.py).
"""

from __future__ import annotations

from pathlib import Path

from tests.docblocks import README, blocks, page_environment, problems, run_blocks


def test_blocks_are_known_and_few_are_skipped() -> None:
    assert sum(1 for b in blocks(README) if b.lang == "python") >= 2
    assert problems(README) == []


def test_readme_runs_as_written(tmp_path: Path) -> None:
    """Every block but the skipped ones (the set-up commands: what CI does)."""
    with page_environment(tmp_path) as (env, work):
        assert run_blocks(README, env, work, spark=False) >= 2
