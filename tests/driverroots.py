"""Driver roots for tests: a directory laid out like a filesystem the NVIDIA driver is installed in, with
the NVML stand-in (tests/nvml_standin/) as its libnvidia-ml.so.1, the way distributions install it.

- `debian`: Debian's packages keep the library out of the linker's default directories
  (`usr/lib/<multiarch>/nvidia/current/`) and register it in `etc/ld.so.conf.d/`: only the root's
  ld.so.cache (written here with the real `ldconfig -r`) finds it. `lib` is an absolute link to
  `/usr/lib` (merged /usr), and the library's link an absolute one, as packages write them: both must
  resolve inside the root.
- `runfile`: NVIDIA's installer puts the library in `usr/lib/<multiarch>/` (a default directory), and
  the root has no ld.so.cache.
- `rhel`: `usr/lib64/`, the directory Red Hat's linker searches, with an ld.so.cache.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

from conftest import need_command, need_root

DRIVER_VERSION = "570.124.06"
MULTIARCH = f"{platform.machine()}-linux-gnu"
LIBRARY = f"libnvidia-ml.so.{DRIVER_VERSION}"


def make_driver_root(top: Path, standin: Path, layout: str) -> Path:
    """A driver root at `top` holding the stand-in built in `standin`; returns the directory the library
    file is in (as the root names it, relative)."""
    if layout == "debian":
        where = Path("usr/lib") / MULTIARCH / "nvidia" / "current"
        (top / "usr" / "lib").mkdir(parents=True)
        (top / "lib").symlink_to("/usr/lib")
        conf = top / "etc" / "ld.so.conf.d"
        conf.mkdir(parents=True)
        (conf / "nvidia.conf").write_text(f"/{where}\n")
        (top / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    elif layout == "runfile":
        where = Path("usr/lib") / MULTIARCH
    elif layout == "rhel":
        where = Path("usr/lib64")
        (top / "etc").mkdir(parents=True)
        (top / "etc" / "ld.so.conf").write_text(f"/{where}\n")
    else:
        raise ValueError(layout)
    (top / where).mkdir(parents=True, exist_ok=True)
    shutil.copy(standin / "libnvidia-ml.so.1", top / where / LIBRARY)
    link = top / where / "libnvidia-ml.so.1"
    if layout == "debian":
        link.symlink_to(f"/{where}/{LIBRARY}")  # absolute: inside the root, not this machine's /usr
    else:
        link.symlink_to(LIBRARY)
    if layout != "runfile":
        write_ld_cache(top)
    return where


def write_ld_cache(top: Path) -> None:
    """The root's etc/ld.so.cache, by the real ldconfig (`-X`: it leaves the links as they are)."""
    need_command("ldconfig")
    need_root()  # ldconfig -r chroots
    done = subprocess.run(["ldconfig", "-r", str(top), "-X", "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (top / "etc" / "ld.so.cache").is_file()
