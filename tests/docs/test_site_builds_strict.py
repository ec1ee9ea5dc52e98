"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, with no warning.

--strict turns every warning into a failure: a page missing from the nav or a nav entry with no
page, a link to a page or an anchor that does not exist, an API reference entry (mkdocstrings)
that does not resolve, a cross-reference to an object that is not documented. On top of the
build, this checks what mkdocs cannot:

- every code block in the built site is a block of its page's Markdown, which
  tests/docs/test_pages_run.py runs (or a known docstring example, listed below with its reason);
- every public name of both APIs has its entry in the API reference;
- the README's links to the site's pages and anchors resolve.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import redisq
import redisq.asyncio
import redisq.metrics
import redisq.policies
from tests.docblocks import DOCS, README, ROOT, blocks

# Code blocks rendered from library docstrings (the API reference), not from a page: fragments
# that name objects they do not define. Each is listed here with where it comes from, so a new
# one fails this test until it is made a page's block or listed.
DOCSTRING_EXAMPLES = {
    "with producer.transaction() as tx:": "redisq.Transaction / redisq.asyncio.Transaction "
    "(redisq/produce/transactional_async.py): a fragment (producer, consumer, messages); the "
    "runnable example is on docs/transactions.md",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output[-6000:]}"
    warnings = [line for line in output.splitlines() if re.match(r"(WARNING|ERROR)\b", line)]
    assert warnings == []
    return out


def built(site: Path, page: Path) -> Path:
    """Where mkdocs writes a page (use_directory_urls: docs/a/b.md -> a/b/index.html)."""
    relative = page.relative_to(DOCS).with_suffix("")
    if relative.name == "index":
        return site / relative.parent / "index.html"
    return site / relative / "index.html"


def rendered_code(page_html: str) -> list[str]:
    """The text of every code block of a built page, signatures of the API reference aside."""
    found = []
    for match in re.finditer(
        r'<div class="(?P<cls>[^"]*)"><pre[^>]*>(?P<body>.*?)</pre>', page_html, re.S
    ):
        if "doc-signature" in match.group("cls"):
            continue
        found.append(html.unescape(re.sub(r"<[^>]+>", "", match.group("body"))))
    # code blocks that no highlighter wrapped (an indented block in a docstring, say)
    for match in re.finditer(r"<pre><code>(?P<body>.*?)</code></pre>", page_html, re.S):
        found.append(html.unescape(re.sub(r"<[^>]+>", "", match.group("body"))))
    return found


def normal(code: str) -> str:
    return "\n".join(line.rstrip() for line in code.strip().splitlines())


def test_site_builds_strict(site: Path) -> None:
    assert (site / "index.html").exists()
    assert (site / "reference" / "redisq" / "index.html").exists()


def test_every_code_block_in_the_site_is_a_page_block(site: Path) -> None:
    unknown = []
    for page in sorted(DOCS.rglob("*.md")):
        sources = {normal(block.code) for block in blocks(page)}
        for code in rendered_code(built(site, page).read_text()):
            code = normal(code)
            first = code.splitlines()[0] if code else ""
            if code not in sources and not first.startswith(tuple(DOCSTRING_EXAMPLES)):
                unknown.append(f"{page.relative_to(ROOT)}: {first!r}")
    assert unknown == [], "code blocks on the site that no test runs"


def test_every_public_name_is_in_the_reference(site: Path) -> None:
    reference = "".join(p.read_text() for p in (site / "reference").rglob("index.html"))
    ids = set(re.findall(r'id="(redisq[\w.]*)"', reference))
    missing = []
    errors = set(dir(redisq.errors))
    for name in redisq.__all__:
        if name in errors:
            wanted = {f"redisq.errors.{name}"}
        else:
            wanted = {f"redisq.{name}"}
        if name != "errors" and not wanted & ids:
            missing.append(f"redisq.{name}")
    for name in redisq.asyncio.__all__:
        wanted = {f"redisq.asyncio.{name}", f"redisq.{name}", f"redisq.errors.{name}"}
        if not wanted & ids:
            missing.append(f"redisq.asyncio.{name}")
    for name in redisq.policies.__all__:
        if name != "Action" and f"redisq.policies.{name}" not in ids:
            missing.append(f"redisq.policies.{name}")
    for name in ("collect", "exposition"):
        if f"redisq.metrics.{name}" not in ids:
            missing.append(f"redisq.metrics.{name}")
    for name in ("ProducerOptions", "ConsumerOptions"):
        if f"redisq.settings.{name}" not in ids:
            missing.append(f"redisq.settings.{name}")
    assert missing == []


def test_readme_links_resolve(site: Path) -> None:
    """The README links to the pages as docs/*.md (so the links work on GitHub too)."""
    links = re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#([^)\s]+))?\)", README.read_text())
    assert len(links) >= 10
    broken = []
    for target, anchor in links:
        page = ROOT / target
        if not page.exists():
            broken.append(target)
        elif anchor and f'id="{anchor}"' not in built(site, page).read_text():
            broken.append(f"{target}#{anchor}")
    assert broken == []


def test_pages_say_what_they_cover() -> None:
    """A reader can land on any page from a search: its first paragraph says what it covers."""
    vague = []
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text().splitlines()
        first = next((line for line in lines[1:] if line.strip()), "")
        if not lines[0].startswith("# ") or first.startswith(("#", "```", "<!--", "|", "-")):
            vague.append(str(page.relative_to(ROOT)))
    assert vague == []
