"""The CLI as a person and a shell script meet it: it never prints a traceback, each error says what
to do, `--help` shows the command's own options first, and the exit status tells a usage error (2)
from a failure (1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent import __version__
from agent.config import OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


@pytest.fixture
def run_env(short_tmp: Path) -> dict[str, str]:
    return {
        "DRA_KUBELET_DIR": str(short_tmp / "kubelet"), "DRA_CDI_DIR": str(short_tmp / "cdi"),
        "DRA_STATIC_CDI_DIR": str(short_tmp / "cdi-static"), "DRA_STATE_DIR": str(short_tmp / "state"),
        "DRA_OFFLINE": str(short_tmp / "offline"), "DRA_NVML": "sim", "NODE_NAME": "node-cli",
        "DRA_LOG_FORMAT": "json", "DRA_NIC_EXCLUDE": "*",
    }


# -- a reader that goes away -------------------------------------------------------------------------

@pytest.mark.parametrize("args", [("claims", "-o", "json"), ("claims",), ("slices",), ("slices", "-o", "json"),
                                  ("devices", "-o", "json"), ("devices", "-o", "yaml"), ("devices",),
                                  ("taints", "-o", "json"), ("vfio", "status", "-o", "json"), ("--version",),
                                  ("help", "settings")])
def test_a_closed_pipe_ends_the_command_quietly(run_env: dict[str, str], args: tuple[str, ...]) -> None:
    """`dra-agent claims -o json | head -1`: the reader has gone when the output comes (here before
    the command starts, so the write always finds it gone)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "agent", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, **run_env}, cwd=ROOT)
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr and "Exception" not in proc.stderr, \
        proc.stderr
    assert proc.returncode == 141  # as a Unix tool killed by SIGPIPE reports it to its shell


# -- errors that say what to do ----------------------------------------------------------------------

@pytest.mark.parametrize("args", [("kubelet", "info"), ("kubelet", "health", "--once"),
                                  ("kubelet", "prepare", "default/gpu-one", "--uid",
                                   "6a1e0c00-0000-4000-8000-000000000001")])
def test_no_agent_to_call_says_what_to_check(run_env: dict[str, str], args: tuple[str, ...]) -> None:
    proc = cli(*args, env=run_env)
    assert proc.returncode == 4 and "UNAVAILABLE" in proc.stderr  # no agent: its own status, not a usage error
    assert "is the agent running" in proc.stderr and "--kubelet-dir" in proc.stderr, proc.stderr
    assert run_env["DRA_KUBELET_DIR"] in proc.stderr and "dra-agent doctor" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cdi_validate_refuses_what_is_not_cdi(run_env: dict[str, str], tmp_path: Path) -> None:
    missing = cli("cdi", "validate", str(tmp_path / "nonexistent"), env=run_env)
    assert missing.returncode == 1 and "OK" not in missing.stdout
    assert f"{tmp_path / 'nonexistent'}: no such file or directory" in missing.stdout + missing.stderr
    readme = cli("cdi", "validate", str(ROOT / "README.md"), env=run_env)
    assert readme.returncode == 1 and "OK" not in readme.stdout
    assert "not a CDI spec directory or spec file" in readme.stdout + readme.stderr

    spec = tmp_path / "vendor.json"
    spec.write_text(json.dumps({"cdiVersion": "0.6.0", "kind": "example.com/gpu",
                                "devices": [{"name": "a", "containerEdits": {"env": ["A=1"]}}]}))
    one = cli("cdi", "validate", str(spec), env=run_env)
    assert one.returncode == 0 and f"{spec}: ok" in one.stdout and one.stdout.rstrip().endswith("OK")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("cdi", "validate", str(empty), env=run_env).returncode == 0  # a CDI directory with no specs yet
    # The default directories may be missing: a runtime skips them too.
    assert cli("cdi", "validate", env=run_env).returncode == 0


def test_version(run_env: dict[str, str], short_tmp: Path) -> None:
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout == f"dra-agent {__version__}\n"
    doctor = cli("doctor", "-o", "json", "--host-root", str(short_tmp), env={**run_env, "DRA_METRICS_ADDRESS": ""})
    first = json.loads(doctor.stdout)[0]
    assert first["check"] == "dra-agent" and first["ok"] and first["detail"].startswith(f"version {__version__}")
    # The agent's first log line says which version runs.
    run = cli("run", "--taint-policy", str(short_tmp / "no-such-policy.yaml"), env=run_env)
    assert run.returncode == 1
    assert json.loads(run.stderr.splitlines()[0])["msg"].startswith(f"dra-agent {__version__} starting")


def test_vfio_status_names_the_iommu_interface_column(run_env: dict[str, str]) -> None:
    proc = cli("vfio", "status", env=run_env)
    assert proc.returncode == 0, proc.stderr
    header = re.split(r"\s{2,}", proc.stdout.splitlines()[0])
    assert header == ["CLAIM", "STATE", "DEVICE", "FUNCTION", "ROLE", "IOMMU GROUP", "IOMMU INTERFACE",
                      "HOST DRIVER", "DRIVER NOW"]


def test_a_claim_without_namespace_is_a_usage_error(run_env: dict[str, str]) -> None:
    proc = cli("kubelet", "prepare", "gpu-one", env=run_env)
    assert proc.returncode == 2 and "NAMESPACE/NAME" in proc.stderr and "Traceback" not in proc.stderr
    assert "default/gpu-one" in proc.stderr  # what the person probably meant


def test_a_claim_that_is_not_found_gets_the_closest_name(run_env: dict[str, str], short_tmp: Path) -> None:
    seeded = subprocess.run([sys.executable, str(ROOT / "examples" / "seed.py"), str(short_tmp)], capture_output=True,
                            text=True, env={**os.environ, **run_env}, cwd=ROOT, timeout=60)
    assert seeded.returncode == 0, seeded.stderr
    proc = cli("kubelet", "prepare", "default/gpu-onee", env=run_env)
    assert proc.returncode == 3 and "not found" in proc.stderr  # not found: its own status, not a usage error
    assert "did you mean default/gpu-one?" in proc.stderr, proc.stderr
    typo = cli("kubelet", "prepare", "defualt/gpu-one", env=run_env)  # the namespace mistyped
    assert typo.returncode == 3 and "did you mean default/gpu-one?" in typo.stderr, typo.stderr
    far = cli("kubelet", "unprepare", "default/zzzzzzzz", env=run_env)
    assert far.returncode == 3 and "not found" in far.stderr and "did you mean" not in far.stderr


# -- help --------------------------------------------------------------------------------------------

COMMANDS = [("run",), ("devices",), ("slices",), ("claims",), ("kubelet", "info"), ("kubelet", "prepare"),
            ("kubelet", "unprepare"), ("kubelet", "health"), ("cdi", "validate"), ("doctor",), ("taints",),
            ("taints", "clear"), ("sim", "xid"), ("sim", "lose"), ("sim", "recover"), ("vfio", "status")]
OWN = {("devices",): "--output", ("slices",): "--output", ("claims",): "--files",
       ("kubelet", "prepare"): "--uid", ("kubelet", "unprepare"): "--uid", ("kubelet", "health"): "--once",
       ("cdi", "validate"): "PATH", ("doctor",): "--host-root", ("taints",): "--output", ("taints", "clear"): "DEVICE",
       ("sim", "xid"): "XID", ("sim", "lose"): "--wait", ("sim", "recover"): "--wait", ("vfio", "status"): "--output"}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_shows_the_commands_own_options_first(command: tuple[str, ...]) -> None:
    proc = cli(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    if command == ("run",):  # the settings are run's own options: all of them, in one section at the end
        assert all(opt.flag in text and f"${opt.env}" in text for opt in OPTIONS)
        return
    assert len(text.splitlines()) <= 40, text
    assert "dra-agent help settings" in text
    own = OWN.get(command)
    if own is not None:
        assert own in text and text.index(own) < text.index("dra-agent help settings")
    # Not every shared setting: those that matter to the command, the rest in `dra-agent help settings`.
    assert sum(opt.flag in text for opt in OPTIONS) <= 10


@pytest.mark.parametrize("command", sorted({c[:1] for c in COMMANDS} | set(COMMANDS)), ids=" ".join)
def test_help_command_is_command_help(command: tuple[str, ...]) -> None:
    # docs/cli.md: `help COMMAND` is `COMMAND --help`, for a command of actions too (`help kubelet`).
    asked = cli("help", *command)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout == cli(*command, "--help").stdout


def test_help_settings_lists_every_setting_once() -> None:
    proc = cli("help", "settings")
    assert proc.returncode == 0, proc.stderr
    for opt in OPTIONS:
        assert opt.flag in proc.stdout and f"${opt.env}" in proc.stdout, opt.flag
    assert "--help" in cli("--help").stdout and "help settings" in cli("--help").stdout


@pytest.mark.parametrize(("args", "where"), [
    (("claims", "--bogus"), "dra-agent claims"),
    (("claims", "-o", "xml"), "dra-agent claims"),
    (("kubelet", "prepare"), "dra-agent kubelet prepare"),
    (("kubelet", "info", "--node-name"), "dra-agent kubelet info"),
    (("nothing",), "dra-agent"),
    ((), "dra-agent"),
    (("sim", "xid", "gpu-0"), "dra-agent sim xid"),
    (("help", "nothing"), "dra-agent help"),
])
def test_a_usage_error_is_one_line_and_a_pointer(args: tuple[str, ...], where: str) -> None:
    proc = cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith(f"{where}: error: ")
    assert lines[1] == f"See '{where} --help'."


# -- what a read-only command leaves ------------------------------------------------------------------

def modes(root: Path) -> dict[str, int]:
    """Permission bits of `root` and everything below it, by relative path."""
    out = {".": root.stat().st_mode & 0o7777}
    for path in root.rglob("*"):
        out[str(path.relative_to(root))] = path.lstat().st_mode & 0o7777
    return out


def test_read_only_commands_make_nothing_looser_than_run(run_env: dict[str, str], short_tmp: Path) -> None:
    """`devices --nvml sim` writes the simulated machine (sysfs, device nodes) under the state directory, as
    `run` does: what it creates is never more open than what `run` creates, starting with the state
    directory itself (0700)."""
    import agentkit

    ran = {**run_env, "DRA_STATE_DIR": str(short_tmp / "ran")}
    reg = Path(run_env["DRA_KUBELET_DIR"]) / "plugins_registry" / "dra.example.com-reg.sock"
    with agentkit.agent_process(["run"], ran, reg, ROOT):
        pass
    by_run = modes(short_tmp / "ran")
    assert by_run["."] == 0o700

    for i, command in enumerate((("devices",), ("slices",), ("sim", "xid", "gpu-0", "13", "--wait", "0"),
                                 ("taints", "clear", "gpu-0"))):
        state = short_tmp / f"looked-{i}"
        proc = cli(*command, env={**run_env, "DRA_STATE_DIR": str(state)})
        assert proc.returncode == 0, proc.stderr
        looser = {path: f"{mode:04o} (run: {by_run[path]:04o})" for path, mode in modes(state).items()
                  if path in by_run and mode & ~by_run[path]}
        assert not looser, (command, looser)
        assert modes(state)["."] == 0o700, command


# -- make run ----------------------------------------------------------------------------------------

def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *descendants(int(child))]
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("sig", "group"), [("SIGTERM", False), ("SIGKILL", False), ("SIGINT", True),
                                            ("SIGHUP", True)])
def test_make_run_stops_with_make_and_is_ready(short_tmp: Path, sig: str, group: bool) -> None:
    """`make run` stopped by a signal to make's process alone (as `kill`, `timeout` or an IDE send it; make
    passes SIGTERM on to its child, and dies of SIGKILL at once) or to its process group (as a terminal sends
    Ctrl-C and a hangup): the agent stops with it, as on SIGTERM, removing its sockets. Offline, as `make
    run` is without a cluster, the agent is ready once its slices are written, though no kubelet registers
    the plugin. (SIGINT or SIGHUP to make's process alone makes make wait for its child, which never hears
    of it: nothing to test there.)"""
    import signal
    import time

    import httpx2

    run = short_tmp / "run"
    port = free_port()
    env = {**os.environ, "DRA_NVML": "sim", "DRA_NIC_EXCLUDE": "*", "DRA_METRICS_ADDRESS": f"127.0.0.1:{port}"}
    env.pop("KUBECONFIG", None)
    make = subprocess.Popen(["make", "--no-print-directory", "run", f"RUN={run}"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    registration = run / "kubelet" / "plugins_registry" / "dra.example.com-reg.sock"
    deadline = time.monotonic() + 120
    agent = 0
    try:
        while not registration.exists():
            assert make.poll() is None, make.communicate()
            assert time.monotonic() < deadline, "make run did not start the agent"
            time.sleep(0.05)
        (agent,) = [p for p in descendants(make.pid) if Path(f"/proc/{p}/comm").read_text().strip() == "dra-agent"]
        while True:  # ready: slices written, offline (no kubelet registers the plugin here)
            try:
                ready = httpx2.get(f"http://127.0.0.1:{port}/readyz", trust_env=False, timeout=10)
            except httpx2.ConnectError:  # the probes' port opens after the registration socket
                ready = None
            if ready is not None and ready.status_code == 200:
                break
            assert time.monotonic() < deadline, ready.text if ready is not None else "no probes"
            time.sleep(0.1)
        assert "[+]kubelet-registration ok: offline" in ready.text and "[+]slices ok" in ready.text
        as_run = {"DRA_KUBELET_DIR": str(run / "kubelet"), "DRA_STATE_DIR": str(run / "state"),
                  "DRA_CDI_DIR": str(run / "cdi"), "DRA_OFFLINE": str(run / "offline")}
        doctor = subprocess.run([sys.executable, "-m", "agent", "doctor", "-o", "json"], cwd=ROOT, timeout=120,
                                capture_output=True, text=True, env={**env, **as_run})
        (probes,) = [r for r in json.loads(doctor.stdout) if r["check"] == "probes (/healthz, /readyz)"]
        assert probes["ok"], probes

        if group:
            os.killpg(make.pid, getattr(signal, sig))
        else:
            make.send_signal(getattr(signal, sig))
        make.communicate(timeout=60)
        while alive(agent):
            assert time.monotonic() < deadline, f"the agent outlived make ({sig})"
            time.sleep(0.05)
        assert not registration.exists()  # it stopped as on SIGTERM: its sockets are gone
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGTERM)
            make.communicate(timeout=60)
        if agent and alive(agent):  # left behind by a failure above
            os.kill(agent, signal.SIGTERM)
