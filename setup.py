"""Build hook: generate the gRPC modules from proto/ into the build (see proto/build.py)."""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithProto(build_py):
    def run(self) -> None:
        super().run()
        generate = runpy.run_path(str(HERE / "proto" / "build.py"))["generate"]
        generate(HERE if self.editable_mode else Path(self.build_lib))


setup(cmdclass={"build_py": BuildWithProto})
