"""README's walk-through, as a reader pastes it: the agent started the way its first block says (`make
run`, with the block's own environment), then every other ```sh block of the section run as written, in
order, in one shell (an `export` holds for the blocks after it), from a directory where `.run` and
`.venv` are what they are in a checkout. Each block must exit 0, every command in it included (`set -e`),
and show what the walk-through says it shows.

The one thing not as pasted: `make run` is given `RUN=<that directory>/.run` (the Makefile's own
variable), so the test never touches the checkout's `.run` or an agent a person runs there."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DRIVER = "dra.example.com"
SECTION = "## Walk-through"
MARK = "@@walkthrough-block"

# A command of the walk-through -> what the output of its block must hold. Every command here must be
# in the walk-through: a step taken out of README fails the test, as one that no longer works does.
SHOWS = {
    "dra-agent kubelet info": ["v1.DRAPlugin", DRIVER],
    "dra-agent kubelet prepare default/gpu-one": ['"device_name": "gpu-0"'],
    "cat .run/cdi/dra.example.com-claim_*.json": [f'"kind": "{DRIVER}/claim"'],
    # A JSON stream, an object a line per API version: read as README says, line by line.
    "python3 -m json.tool --json-lines $(dra-agent claims default/gpu-one --metadata)": [
        '"apiVersion": "metadata.resource.k8s.io/v1beta1"', '"apiVersion": "metadata.resource.k8s.io/v1alpha1"',
        '"name": "gpu-one"'],
    "dra-agent claims ": ["default/gpu-one"],
    "dra-agent kubelet health --once": ["devices in pool", "HEALTHY", "gpu-3 "],
    "dra-agent sim xid gpu-3 48": ["xid gpu-3 XID 48: applied"],
    "dra-agent taints": ["NoSchedule"],
    "dra-agent sim recover gpu-3": ["recover gpu-3: applied"],
    "dra-agent kubelet prepare default/virt-launcher-vm-1-gpu-k8q2z": ["-vfio"],
    "dra-agent vfio status": ["default/virt-launcher-vm-1-gpu-k8q2z", "vfio-pci"],
    "dra-agent kubelet prepare default/mig-one": ["gpu-7-mig-1g10gb-0"],
}


def walkthrough(text: str) -> list[str]:
    """The ```sh blocks of README's walk-through section, in order."""
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else None]
    return re.findall(r"^```sh\n(.*?)^```$", section, flags=re.M | re.S)


def agent_command(block: str) -> dict[str, str]:
    """The environment of the first block, which must be `make run` alone (after VAR=value assignments)."""
    lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) == 1, f"the walk-through's first block starts the agent, and does nothing else:\n{block}"
    words = shlex.split(lines[0], comments=True)
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_][A-Z0-9_]*=", w))
    assert words[len(env):] == ["make", "run"], f"the walk-through's first block is not `make run`: {lines[0]}"
    return env


@pytest.fixture
def workdir(short_tmp: Path) -> Path:
    """A directory standing in for the checkout: `.venv` is the checkout's, `.run` is its own."""
    (short_tmp / ".venv").symlink_to(ROOT / ".venv")
    return short_tmp


@contextlib.contextmanager
def started(workdir: Path, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`make run` as the first block says, in its own session (as a terminal would hold it), until the
    agent's DRA socket answers its path; stopped as Ctrl-C stops it, and waited for until its sockets
    are gone."""
    run = workdir / ".run"
    registration = run / "kubelet" / "plugins_registry" / f"{DRIVER}-reg.sock"
    dra = run / "kubelet" / "plugins" / DRIVER / "dra.sock"
    # No cluster: the walk-through is offline, as `make run` is on a machine that has none.
    environ = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    with open(log, "wb") as out:
        make = subprocess.Popen(["make", "--no-print-directory", "-C", str(ROOT), "run", f"RUN={run}"],
                                env={**environ, **env}, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # `make run` sets up .venv first when it must
        while not dra.exists():
            assert make.poll() is None, f"make run exited {make.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the agent did not open {dra}:\n{log.read_text()}"
            time.sleep(0.1)
        yield make
    finally:
        os.killpg(make.pid, signal.SIGINT)
        make.wait(timeout=60)
        deadline = time.monotonic() + 60
        while registration.exists() or dra.exists():  # the agent stops with make, removing its sockets
            assert time.monotonic() < deadline, f"the agent left its sockets:\n{log.read_text()}"
            time.sleep(0.1)


def run_blocks(blocks: list[str], cwd: Path) -> tuple[int, list[str]]:
    """The blocks in one bash, as pasted one after another into one terminal; the exit status, and each
    block's output (stdout and stderr) as far as it got."""
    script = ["set -eo pipefail"]
    for i, block in enumerate(blocks):
        script += [f"printf '\\n{MARK} {i}\\n'", block]
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("DRA_")})
    parts = re.split(rf"^{MARK} \d+$", proc.stdout.decode(errors="replace"), flags=re.M)[1:]
    return proc.returncode, parts


def check(blocks: list[str], rc: int, outputs: list[str]) -> None:
    """Every block ran and exited 0, and each command of `SHOWS` is in one whose output holds its marks."""
    if rc != 0 or len(outputs) != len(blocks):
        failed = len(outputs) - 1
        raise AssertionError(f"README's walk-through: block {failed + 1} exited {rc}:\n{blocks[failed]}\n"
                             f"--- its output ---\n{outputs[failed] if outputs else ''}")
    for command in SHOWS:
        assert any(command in b for b in blocks), f"README's walk-through no longer runs `{command}`"
    for command, marks in SHOWS.items():
        out = outputs[next(i for i, b in enumerate(blocks) if command in b)]
        for mark in marks:
            assert mark in out, f"`{command}` in README's walk-through does not show {mark!r}:\n{out}"


def test_every_block_of_the_walkthrough_works_as_pasted(workdir: Path) -> None:
    agent, *blocks = walkthrough((ROOT / "README.md").read_text())
    assert blocks, "README's walk-through has no blocks to run after starting the agent"
    log = workdir / "make-run.log"
    with started(workdir, agent_command(agent), log):
        rc, outputs = run_blocks(blocks, workdir)
        check(blocks, rc, outputs)
    assert "ready in" in log.read_text()


def test_doctor_with_the_walkthroughs_settings_finds_the_agents_probes(workdir: Path) -> None:
    # The walk-through's export line names no metrics address: doctor looks where `make run` serves.
    agent, export, *_ = walkthrough((ROOT / "README.md").read_text())
    export_line = next(line for line in export.splitlines() if line.startswith("export "))
    with started(workdir, agent_command(agent), workdir / "make-run.log"):
        proc = subprocess.run(["bash", "-c", f"{export_line}\n.venv/bin/dra-agent doctor -o json"], cwd=workdir,
                              capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if not k.startswith("DRA_")})
    probes = [c for c in json.loads(proc.stdout) if c["check"].startswith("probes")]
    assert [(c["ok"], c["detail"].split(" ")[0]) for c in probes] == [(True, "dra-agent")], probes


def test_a_broken_block_fails_the_walkthrough(workdir: Path) -> None:
    """What the test above would say of a walk-through with a broken step (the metadata file's path as
    README once printed it, `<uid>` and all), and of one missing a step: run, not assumed."""
    agent, *blocks = walkthrough((ROOT / "README.md").read_text())
    broken = [b.replace("$(dra-agent claims default/gpu-one --metadata)",
                        f".run/kubelet/plugins/{DRIVER}/dra-device-metadata/<uid>/gpu/metadata.json")
              for b in blocks]
    assert broken != blocks
    with started(workdir, agent_command(agent), workdir / "make-run.log"):
        rc, outputs = run_blocks(broken, workdir)
        with pytest.raises(AssertionError, match="exited"):
            check(broken, rc, outputs)
        # The blocks before the broken one did run (the agent was there and answered).
        assert "v1.DRAPlugin" in outputs[0]
        # A step taken out is named as missing (here: the checks alone, on the blocks as they ran).
        without = [b.replace("dra-agent vfio status", "true") for b in blocks]
        with pytest.raises(AssertionError, match="no longer runs `dra-agent vfio status`"):
            check(without, 0, ["" for _ in without])
