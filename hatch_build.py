"""Build hook: compiles redisq/_speedups.c (the read hot path in C) into the wheel.

Optional, as hiredis is for redis-py: when there is no compiler (or REDISQ_NO_EXTENSIONS is
set), the hook says so and the wheel is pure Python, where redisq decodes in Python alone."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "redisq/_speedups.c"


class SpeedupsHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        name = "_speedups" + sysconfig.get_config_var("EXT_SUFFIX")
        if os.environ.get("REDISQ_NO_EXTENSIONS"):
            self.app.display_info("redisq: REDISQ_NO_EXTENSIONS is set: the pure-Python decoder")
            if version == "editable":  # an earlier editable build's module would still load
                Path(self.root, "redisq", name).unlink(missing_ok=True)
            return
        self.scratch = tempfile.mkdtemp(prefix="redisq-speedups-")
        try:
            built = compile_extension(Path(self.root), Path(self.scratch))
        except Exception as exc:  # no compiler, no headers: the Python decoder serves
            self.app.display_warning(
                f"redisq: {SOURCE} was not compiled ({type(exc).__name__}: {exc}); "
                "redisq will decode in pure Python (slower reads, same results)"
            )
            return
        if version == "editable":  # the editable wheel points at the source tree
            shutil.copyfile(built, Path(self.root, "redisq", name))
            return
        build_data["force_include"][str(built)] = f"redisq/{name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        scratch = getattr(self, "scratch", None)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def compile_extension(root: Path, scratch: Path) -> Path:
    """setuptools' build_ext: the platform's compiler and flags, as for any C extension."""
    from setuptools import Distribution, Extension

    digest = hashlib.sha256((root / SOURCE).read_bytes()).hexdigest()
    here = os.getcwd()
    os.chdir(root)
    try:
        dist = Distribution(
            {
                "name": "redisq-speedups",
                "ext_modules": [
                    Extension(
                        "redisq._speedups",
                        [SOURCE],
                        # redisq.model.native uses the module only with the source it was built from
                        define_macros=[("REDISQ_SOURCE_SHA256", f'"{digest}"')],
                    )
                ],
            }
        )
        command: Any = dist.get_command_obj("build_ext")
        command.build_lib = str(scratch / "lib")
        command.build_temp = str(scratch / "temp")
        command.ensure_finalized()
        command.run()
        return Path(command.get_ext_fullpath("redisq._speedups"))
    finally:
        os.chdir(here)


if __name__ == "__main__":  # python hatch_build.py: compile in place, for a plain checkout
    with tempfile.TemporaryDirectory() as scratch:
        out = compile_extension(Path(__file__).parent, Path(scratch))
        target = Path(__file__).parent / "redisq" / out.name
        shutil.copyfile(out, target)
        print(target, file=sys.stderr)
