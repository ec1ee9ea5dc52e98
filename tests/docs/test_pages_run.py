"""Every code block of every page of the docs site runs as written, page by page, in order,
against a fresh server of the page's own (tests/docblocks.py: how blocks are found, marked and
run; the README's are run the same way by tests/docs/test_readme.py). The Spark blocks are run by
tests/docs/test_pages_run_spark.py, a module of its own so that xdist runs it beside this one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docblocks import (
    NOT_RUN,
    ROOT,
    blocks,
    name,
    page_environment,
    pages,
    problems,
    run_blocks,
    runnable,
)

SITE = [page for page in pages() if page.parent != ROOT]
WITH_BLOCKS = [page for page in SITE if runnable(page, spark=False)]


def test_blocks_are_known_and_few_are_skipped() -> None:
    assert set(NOT_RUN) <= {name(page) for page in SITE}
    found = {name(page): problems(page) for page in SITE}
    assert {page: p for page, p in found.items() if p} == {}
    assert sum(len(blocks(page)) for page in WITH_BLOCKS) >= 20


@pytest.mark.parametrize("page", WITH_BLOCKS, ids=name)
def test_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    """A page's blocks but the Spark ones (test_pages_run_spark.py) and the few skipped."""
    with page_environment(tmp_path) as (env, work):
        assert run_blocks(page, env, work, spark=False) >= 1
