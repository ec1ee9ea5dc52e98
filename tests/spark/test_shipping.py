"""redisq shipped to executors as a zip (spark_connector.shipping): importable from the zip alone,
Lua scripts included (read through importlib.resources), and working against a real server."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from spark_connector.shipping import package_zip  # noqa: E402

pytestmark = pytest.mark.spark

# Run in a fresh interpreter with the zip first on sys.path, in a directory without the source
# checkout: every module and script must come from the zip.
PROBE = """
import sys, uuid
sys.path.insert(0, sys.argv[1])
import redisq, redisq.server.lua, spark_connector.commit
assert redisq.__file__.startswith(sys.argv[1]), redisq.__file__
assert spark_connector.commit.__file__.startswith(sys.argv[1])
names = redisq.server.lua.script_names()
assert "tx_apply" in names and "produce_sequence" in names, names
assert "#include" not in redisq.server.lua.read_source("tx_apply")
broker = redisq.connect(sys.argv[2], namespace="z" + uuid.uuid4().hex[:8])
broker.create_topic("t", partitions=2)
with broker.producer() as producer:
    producer.send("t", b"from-a-zip", key=b"k")
print(len(names), [m.value for p in range(2) for m in broker.read("t", p)])
"""


def test_the_zip_alone_carries_redisq_and_its_lua_scripts(
    tmp_path: Path, valkey_server: Any
) -> None:
    archive = package_zip(tmp_path / "code.zip")
    names = zipfile.ZipFile(archive).namelist()
    assert "redisq/lua/tx_apply.lua" in names and "redisq/lua/includes/append.lua" in names
    assert "spark_connector/writer.py" in names
    assert not any("__pycache__" in n for n in names)
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(archive), valkey_server.url],
        cwd=run_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "[b'from-a-zip']" in done.stdout
