"""Marks shared by the test modules."""

from __future__ import annotations

import pytest

# A check of the arguments, refused in the client before anything is sent: the server plays no
# part, so it runs on one backend (standalone Valkey, always at hand) instead of the `broker`
# fixture's four (issue 33.4). What the server decides stays on every backend.
ONE_BACKEND = pytest.mark.parametrize("backend", ["valkey"])
