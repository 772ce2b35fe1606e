"""`make setup` (the first step of `make run` and `make test`): its editable install builds without a
warning. pip shows every warning the build backend emits (pip 25 and later, as `BuildBackendWarning`),
and a new user's first `make run` ended in setuptools' "Editable installation ... Please be careful with
folders in your working directory with the same name as your package", from the import hook setuptools
installs for a flat layout that names no package directory (pyproject.toml's [tool.setuptools])."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What the build reads: the build hook (setup.py) generates agent/pb from proto/ into the tree.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "agent", "cdi", "proto")

# The build backend's hook, run as pip runs it (in a process of its own, in the source tree), with every
# warning recorded: what pip would print.
BUILD = """
import json, sys, warnings
import setuptools.build_meta as backend
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    name = backend.build_editable(sys.argv[1])
print(json.dumps({"wheel": name, "warnings": [f"{w.category.__name__}: {w.message}" for w in said]}))
"""


def test_the_editable_install_builds_without_a_warning(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "pb", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = tmp_path / "wheel"
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", BUILD, str(out)], cwd=src, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    built = json.loads(done.stdout.splitlines()[-1])
    assert built["warnings"] == []
    # The install puts the checkout on the path (a .pth), so agent/ and cdi/ are imported from it as they are
    # edited, agent/pb included.
    with zipfile.ZipFile(out / built["wheel"]) as wheel:
        (pth,) = [n for n in wheel.namelist() if n.endswith(".pth")]
        assert wheel.read(pth).decode().split() == [str(src.resolve())]
    assert (src / "agent" / "pb" / "dra_v1_pb2.py").is_file()
