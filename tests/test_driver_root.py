"""The driver's NVML library found below the driver root (`--driver-root`), as the root's own dynamic
linker would find it: its ld.so.cache (as the real ldconfig writes it, in each of its layouts), then the
usual directories, every link resolved inside the root. The agent itself loading it from there and
publishing the stand-in's GPUs is in tests/test_nvml_standin.py."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest
from conftest import need_command, need_root
from driverroots import LIBRARY, MULTIARCH, make_driver_root
from test_nvml_standin import STANDIN

from agent.host.driverroot import NVML_LIBRARY, find_library, library_dirs, resolve_in
from agent.host.ldcache import CacheError, lookup, parse_cache, read_cache


@pytest.fixture(scope="module")
def standin() -> Path:
    need_command("make", "gcc")
    root = Path(__file__).resolve().parent.parent
    built = subprocess.run(["make", "-s", "nvml-standin"], cwd=root, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    return STANDIN


@pytest.mark.parametrize("layout", ["new", "compat", "old"])
def test_every_layout_ldconfig_writes_reads_as_ldconfig_lists_it(tmp_path: Path, standin: Path, layout: str) -> None:
    need_command("ldconfig")
    need_root()
    make_driver_root(tmp_path, standin, "rhel")
    cache = tmp_path / "etc" / f"cache-{layout}"
    done = subprocess.run(["ldconfig", "-r", str(tmp_path), "-X", "-c", layout, "-C", f"/etc/{cache.name}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = subprocess.run(["ldconfig", "-r", str(tmp_path), "-p", "-C", f"/etc/{cache.name}"],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    expected = sorted((line.split()[0], line.split("=> ")[1]) for line in listed.splitlines() if "=>" in line)
    entries = read_cache(cache)
    assert sorted((e.name, e.path) for e in entries) == expected
    # The soname the stand-in is built with, as the driver's library has it.
    assert lookup(entries, NVML_LIBRARY) == ["/usr/lib64/libnvidia-ml.so.1"]


def test_this_machine_s_own_cache_reads_as_ldconfig_lists_it() -> None:
    need_command("ldconfig")
    if not Path("/etc/ld.so.cache").is_file():
        pytest.skip("no /etc/ld.so.cache on this machine")
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=60, check=True).stdout
    expected = sorted((line.split()[0], line.split("=> ")[1]) for line in listed.splitlines() if "=>" in line)
    assert sorted((e.name, e.path) for e in read_cache(Path("/etc/ld.so.cache"))) == expected


def test_another_machine_s_libraries_are_not_this_one_s(tmp_path: Path, standin: Path) -> None:
    # Only the cache finds a library in Debian's layout; its entries are this machine's, not another's.
    make_driver_root(tmp_path, standin, "debian")
    entries = read_cache(tmp_path / "etc" / "ld.so.cache")
    other = "aarch64" if platform.machine() == "x86_64" else "x86_64"
    assert lookup(entries, NVML_LIBRARY, other) == []
    found = find_library(tmp_path, machine=other)
    assert found.found is None
    assert found.tried[0] == f"/etc/ld.so.cache (no {NVML_LIBRARY} for {other})"
    assert f"/lib/{other}-linux-gnu/{NVML_LIBRARY}" in found.tried


def test_a_broken_cache_is_a_cache_error() -> None:
    for data in (b"", b"not a cache", b"glibc-ld.so.cache1.1" + b"\xff" * 8, b"ld.so-1.7.0\0\x05\0\0\0"):
        with pytest.raises(CacheError):
            parse_cache(data)


def test_debian_layout_is_found_through_the_root_s_cache_only(tmp_path: Path, standin: Path) -> None:
    where = make_driver_root(tmp_path / "root", standin, "debian")
    found = find_library(tmp_path / "root")
    # The link is absolute (/usr/lib/...), resolved inside the root, not in this machine's /usr.
    assert found.found == tmp_path / "root" / where / LIBRARY
    assert found.tried == ()
    os.unlink(tmp_path / "root" / "etc" / "ld.so.cache")
    missing = find_library(tmp_path / "root")
    assert missing.found is None
    assert missing.tried == ("/etc/ld.so.cache (No such file or directory)",
                             *(f"/{d}/{NVML_LIBRARY}" for d in library_dirs()))


@pytest.mark.parametrize("layout", ["runfile", "rhel"])
def test_other_layouts(tmp_path: Path, standin: Path, layout: str) -> None:
    where = make_driver_root(tmp_path, standin, layout)
    found = find_library(tmp_path)
    assert found.found == tmp_path / where / LIBRARY
    if layout == "runfile":
        assert found.tried[0] == "/etc/ld.so.cache (No such file or directory)"


def test_links_never_leave_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "lib64").mkdir(parents=True)
    # An absolute link to a file this machine has, but the root does not; and `..` past the root.
    (root / "usr" / "lib64" / NVML_LIBRARY).symlink_to("/etc/hostname")
    (root / "lib64").symlink_to("../../../../../../../etc")
    (root / "etc").mkdir()
    (root / "etc" / "marker").touch()
    assert resolve_in(root, "/lib64/marker") == root / "etc" / "marker"  # `..` stops at the root
    with pytest.raises(FileNotFoundError):
        resolve_in(root, f"/usr/lib64/{NVML_LIBRARY}")
    with pytest.raises(FileNotFoundError):
        resolve_in(root, "/lib64/hostname")
    (root / "usr" / "lib" / MULTIARCH).mkdir(parents=True)
    (root / "usr" / "lib" / MULTIARCH / NVML_LIBRARY).symlink_to(NVML_LIBRARY)  # a loop
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        resolve_in(root, f"/usr/lib/{MULTIARCH}/{NVML_LIBRARY}")
    found = find_library(root)
    assert found.found is None
    assert f"/usr/lib/{MULTIARCH}/{NVML_LIBRARY} (Too many levels of symbolic links)" in found.tried


def test_the_agent_s_own_root_searches_ld_library_path_first(tmp_path: Path, standin: Path) -> None:
    found = find_library(Path("/"), env={"LD_LIBRARY_PATH": f"{tmp_path}::{standin}"})
    assert found.found == standin / NVML_LIBRARY
    assert found.tried[0] == f"{tmp_path}/{NVML_LIBRARY}"
    # Another root's linker never sees this process's LD_LIBRARY_PATH.
    (tmp_path / "etc").mkdir()
    assert find_library(tmp_path, env={"LD_LIBRARY_PATH": str(standin)}).found is None
