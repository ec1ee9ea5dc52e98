"""The C module is built and is what redisq reads with. Not skipped when it is missing (the
other speedups tests are): CI installs with a compiler, and a build that silently fell back to
pure Python would read at about 0.7x the rate without anyone noticing."""

from __future__ import annotations

import os

import pytest

from redisq.model import native, records


def test_the_c_decoder_is_built_and_what_redisq_reads_with() -> None:
    if os.environ.get("REDISQ_NO_EXTENSIONS"):
        pytest.skip("installed without the C module on purpose (REDISQ_NO_EXTENSIONS)")
    module = native.load()
    assert module is not None, (
        "redisq._speedups is missing or was built from another _speedups.c: "
        "pip install -e . (with a C compiler), or python hatch_build.py"
    )
    fast = module.decode_entries
    from redisq.consume import chunks
    from redisq.consume import partition_io as partition
    from redisq.consume import partition_io_async as async_partition

    assert records.decode_entries is fast
    assert chunks.decode_entries is fast
    assert partition.decode_entries is fast
    assert async_partition.decode_entries is fast
