"""Every block of the docs pages with Spark blocks runs as written, in order, against a fresh
server of the page's own (tests/docblocks.py). Apart from tests/docs/test_pages_run.py (the
other pages) so that xdist (--dist loadfile) runs the two modules on different workers: this one
is minutes of JVM starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docblocks import ROOT, name, page_environment, pages, run_blocks, runnable

SITE = [page for page in pages() if page.parent != ROOT]
WITH_SPARK = [page for page in SITE if any(b.spark for b in runnable(page, spark=True))]


@pytest.mark.spark
@pytest.mark.timeout(1800)  # a Spark session, and a JVM for each `redisq audit`
@pytest.mark.parametrize("page", WITH_SPARK, ids=name)
def test_page_runs_as_written_with_spark(page: Path, tmp_path: Path) -> None:
    """Every block of a page with Spark blocks, in order (one Spark session per Python block;
    each `redisq audit` starts its own, as it does for a user)."""
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    with page_environment(tmp_path) as (env, work):
        assert run_blocks(page, env, work, spark=True) >= 2
