"""redisq._speedups, the C part of the hot paths (hatch_build.py compiles it), when it is there
and was built from the _speedups.c beside it; None otherwise, and redisq runs in pure Python.

A build from another source (an editable install whose _speedups.c changed since it was
compiled) is not used: it would decode by rules that are no longer the Python decoder's."""

from __future__ import annotations

import hashlib
import importlib
import warnings
from pathlib import Path
from types import ModuleType


def load() -> ModuleType | None:
    try:
        # By name: `from redisq import _speedups` would make the vocabulary import the package
        # root (and so everything) for import-linter, which cannot see a compiled module.
        _speedups = importlib.import_module("redisq._speedups")
    except ImportError:  # built without a compiler
        return None
    source = Path(__file__).resolve().parents[1] / "_speedups.c"
    if source.is_file():
        built_from = getattr(_speedups, "SOURCE_SHA256", None)
        if hashlib.sha256(source.read_bytes()).hexdigest() != built_from:
            warnings.warn(
                f"{_speedups.__file__} was built from another {source.name}: rebuild it "
                "(pip install -e ., or python hatch_build.py); redisq decodes in pure Python",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
    return _speedups
