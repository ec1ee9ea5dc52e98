"""The thread drivers are generated from their asyncio sources (tools/async_to_sync.py): none may
be stale, and the generator refuses what it cannot translate faithfully."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import async_to_sync  # noqa: E402


def test_no_generated_module_is_stale() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "async_to_sync.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr


def test_every_async_module_is_a_source_or_hand_written() -> None:
    """A new `*_async.py` must be listed: generated from, or kept by hand (sockets only)."""
    listed = set(async_to_sync.SOURCES) | set(async_to_sync.HANDWRITTEN)
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "redisq").rglob("*_async.py")}
    assert found == listed


def test_each_generated_module_says_so_in_its_first_lines() -> None:
    for source in async_to_sync.SOURCES:
        target = ROOT / source.replace("_async.py", ".py")
        head = target.read_text().splitlines()[:2]
        assert "generated from" in head[0] and "do not edit" in head[0], target


def transform(source: str) -> str:
    text = async_to_sync.drop_async_branches(textwrap.dedent(source))
    return async_to_sync.transform_tokens(text, async_to_sync.primitive_names())


def test_await_and_async_go_and_names_map() -> None:
    out = transform(
        """
        from redisq.runtime import AEvent, aspawn
        from redisq.produce.producer_async import Producer

        class AsyncThing:
            async def __aenter__(self) -> AsyncThing:
                self._wake = AEvent()
                self._task = aspawn(self._run, name="x")
                async with self._lock:
                    await self._wake.wait(1.0)
                return [x async for x in self.items()]
        """
    )
    assert "await" not in out and "async" not in out
    assert "from redisq.runtime import Event, spawn" in out
    assert "from redisq.produce.producer import Producer" in out
    assert "class Thing:" in out and "def __enter__(self) -> Thing:" in out
    assert "self._wake = Event()" in out and "with self._lock:" in out


def test_is_async_branches_keep_the_sync_side_only() -> None:
    out = transform(
        """
        def f():
            if is_async():
                a = 1
            else:
                # the thread side
                a = 2
            return a
        """
    )
    assert "a = 1" not in out and "    # the thread side\n    a = 2" in out


def test_an_await_under_the_state_guard_is_refused() -> None:
    with pytest.raises(async_to_sync.GenerationError, match="_guard"):
        async_to_sync.check_guarded_awaits(
            textwrap.dedent(
                """
                async def f(self):
                    with self._guard:
                        await self.io()
                """
            ),
            "x.py",
        )


def test_leftover_asyncio_is_an_error() -> None:
    with pytest.raises(async_to_sync.GenerationError, match="asyncio"):
        async_to_sync.check_output("import asyncio\n", "x.py")
