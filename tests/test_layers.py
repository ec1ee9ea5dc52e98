"""The layers of docs/DESIGN.md §10 hold: import-linter checks the contracts in pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    command = shutil.which("lint-imports")
    if command is None:
        pytest.fail("import-linter is a test dependency (pyproject.toml): lint-imports is missing")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [command, "--no-cache", "--config", str(root / "pyproject.toml")],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=300,
    )


def test_the_import_contracts_are_kept() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_a_protocol_module_importing_a_driver_breaks_the_contracts(tmp_path: Path) -> None:
    """The check can fail: the same tree with one forbidden import is refused."""
    for name in ("redisq", "spark_connector"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    group = tmp_path / "redisq" / "protocol" / "group.py"
    group.write_text(group.read_text() + "\nfrom redisq.produce import producer  # noqa\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0
    assert "redisq.protocol is not allowed to import redisq.produce.producer" in done.stdout
