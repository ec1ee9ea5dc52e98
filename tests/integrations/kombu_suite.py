"""Kombu's own integration mixins (t/integration/common.py of the Kombu sdist on PyPI), fetched
once into a cache directory rather than copied into this repository.

load_common() runs at collection (the test classes subclass the mixins, so they must exist when
the module is imported); the sdist is downloaded once per machine and cache directory. When
PyPI cannot be reached the caller skips the suite with the reason returned, never a stand-in.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

KOMBU_VERSION = "5.7.0"
MODULE_NAME = "kombu_t_integration_common"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "redisq-tests" / f"kombu-{KOMBU_VERSION}"


def _download(target: Path) -> str | None:
    """Put common.py of the sdist at target; the reason it failed, or None."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "pip", "download", f"kombu=={KOMBU_VERSION}",
            "--no-deps", "--no-binary", ":all:", "--retries", "1", "--timeout", "20",
            "--disable-pip-version-check", "-d", tmp,
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            return f"pip download kombu=={KOMBU_VERSION} timed out (PyPI unreachable?)"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            return f"pip download kombu=={KOMBU_VERSION} failed (PyPI unreachable?): {tail}"
        archives = list(Path(tmp).glob("kombu-*.tar.gz"))
        if not archives:
            return f"pip download kombu=={KOMBU_VERSION} gave no sdist"
        member = f"kombu-{KOMBU_VERSION}/t/integration/common.py"
        with tarfile.open(archives[0]) as archive:
            source = archive.extractfile(member)
            if source is None:
                return f"{member} is not in the sdist"
            text = source.read()
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(text)
        os.replace(partial, target)  # atomic: a concurrent test worker sees all of it or nothing
    return None


def load_common() -> ModuleType | str:
    """Kombu's t/integration/common.py as a module, or why it could not be had."""
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    target = cache_dir() / f"{MODULE_NAME}.py"
    if not target.exists():
        failure = _download(target)
        if failure is not None:
            return failure
    # It imports only kombu and pytest (installed), so its directory on sys.path is all it needs.
    sys.path.insert(0, str(target.parent))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    spec.loader.exec_module(module)
    return module
