"""One frozen settings object, built from command-line flags and environment variables.

Every setting is a flag and an environment variable (the flag wins). The table
`OPTIONS` (`agent.options`) is the single source: argparse and `--help` are made from it, and the
settings table of docs/configuration.md is checked against it (tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.options import DEFAULT_METRICS_ADDRESS as DEFAULT_METRICS_ADDRESS  # re-exported
from agent.options import OPTIONS as OPTIONS  # re-exported: callers read the table through Settings' module
from agent.options import Option as Option
from agent.options import default_state_dir

if TYPE_CHECKING:
    from agent.computeshare import ComputeShares
    from agent.kinds import Kind
    from agent.names import PluginResources

UNIX_PATH_MAX = 108  # sun_path, including the terminating NUL
# Device kinds whose claims may skip the kubelet's prepare and unprepare (`--skip-node-operations`): what
# such a claim gets from prepare is a CPU list or a NUMA node's name in its environment, which a claim
# taken for node-allocatable accounting alone does without.
SKIPPABLE_KINDS = ("cpu", "memory")
# The kinds `--binding-conditions` may name: those whose prepare changes the host (`agent.bindingconditions`,
# whose `bindable_kinds` derives them from the kinds' traits; a test holds the two together).
BINDABLE_KINDS = ("vfio", "mig", "vgpu")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class NvmlMode:
    kind: str  # auto | real | sim
    profile: str = ""

    @classmethod
    def parse(cls, text: str) -> NvmlMode:
        kind, _, profile = text.partition(":")
        if kind not in ("auto", "real", "sim") or (profile and kind != "sim"):
            raise ConfigError(f"--nvml must be auto, real or sim[:PROFILE], not {text!r}")
        if kind == "sim":
            return cls("sim", profile or "dgx-h100")
        return cls(kind)

    def __str__(self) -> str:
        return f"sim:{self.profile}" if self.kind == "sim" else self.kind


def _globs(text: str) -> tuple[str, ...]:
    return tuple(g.strip() for g in text.split(",") if g.strip())


@dataclass(frozen=True)
class Settings:
    driver_name: str = "dra.example.com"
    node_name: str = field(default_factory=socket.gethostname)
    nvml: NvmlMode = NvmlMode("auto")
    driver_root: Path = Path("/")
    kubelet_dir: Path = Path("/var/lib/kubelet")
    cdi_dir: Path = Path("/var/run/cdi")
    static_cdi_dir: Path = Path("/etc/cdi")
    state_dir: Path = field(default_factory=lambda: Path(default_state_dir()))
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    kubeconfig: Path | None = None
    offline: Path | None = None
    offline_fallback: Path | None = None
    nic_include: tuple[str, ...] = ()
    node_ips: tuple[str, ...] = ()  # the Node's addresses (status.hostIPs): the NIC holding one is an uplink
    nic_exclude: tuple[str, ...] = ()
    nic_passthrough: tuple[str, ...] = ()
    rescan_interval: float = 60.0
    netlink_debounce: float = 0.5
    rolling_update_pod_uid: str = ""
    allow_unsafe_roots: bool = False
    claim_fetch_concurrency: int = 16
    api_timeout: float = 10.0
    gc_grace_period: float = 600.0
    device_plugin_resources: str = "nvidia.com/gpu,nvidia.com/mig-*"
    dynamic_mig: bool = True
    mig_profiles: str = "1g,2g,3g,7g"  # the plainest profile of each common compute size (facts.MigChoice)
    vgpu_types: str = "auto"
    gpu_sharing: bool = False
    gpu_compute_shares: str = "0.1/0.05/1/0.05"
    compatibility_groups: bool = False
    kubevirt_cpu: bool = False
    numa_node_list: str = "auto"
    partition_type_attribute: bool = False
    skip_node_operations: tuple[str, ...] = ()
    binding_conditions: tuple[str, ...] = ()
    gpu_host_memory_overhead: int = 256 * 2**20
    gpu_probe_interval: float = 1.0
    taint_policy: Path | None = None
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    probe_address: str = ""  # a listener of the probes' own (loopback in the DaemonSet); "": on the metrics one
    probe_socket: Path | None = None  # a unix socket of the probes, for the kubelet's exec probes; None: none
    stop_with_parent: bool = False
    log_format: str = "auto"
    log_level: str = "info"

    def __post_init__(self) -> None:
        from agent.apirules import dns_subdomain_errors

        if errs := dns_subdomain_errors(self.driver_name, max_len=63):
            raise ConfigError(f"--driver-name {self.driver_name!r}: {'; '.join(errs)}")
        if not self.node_name:
            raise ConfigError("--node-name is empty")
        if self.log_format not in ("auto", "json", "text"):
            raise ConfigError(f"--log-format must be auto, json or text, not {self.log_format!r}")
        if self.rescan_interval <= 0 or self.netlink_debounce < 0:
            raise ConfigError("--rescan-interval must be > 0 and --netlink-debounce >= 0")
        if not self.gpu_probe_interval > 0:
            raise ConfigError(f"--gpu-probe-interval must be > 0, not {self.gpu_probe_interval!r}")
        if self.claim_fetch_concurrency < 1:
            raise ConfigError("--claim-fetch-concurrency must be >= 1")
        if not self.gc_grace_period >= 0:  # also NaN
            raise ConfigError(f"--gc-grace-period must be >= 0, not {self.gc_grace_period!r}")
        from agent.names import PluginResources, ResourceNameError

        try:
            PluginResources.parse(self.device_plugin_resources)
        except ResourceNameError as exc:
            raise ConfigError(str(exc)) from None
        if self.metrics_address:
            parse_address(self.metrics_address)
        if self.probe_address:
            parse_address(self.probe_address, "--probe-address")
        if self.probe_socket is not None:
            # Bound first as `.<8 hex>.sock` beside it (agent/kubelet/sockets.py): both names must fit.
            path = self.probe_socket
            longest = max(len(os.fsencode(str(path))), len(os.fsencode(str(path.parent))) + 15)
            if longest >= UNIX_PATH_MAX:
                raise ConfigError(f"--probe-socket {self.probe_socket}: too long for a unix socket (its directory "
                                  f"at most {UNIX_PATH_MAX - 16} bytes, the path at most {UNIX_PATH_MAX - 1})")
        from agent.facts import MigChoice
        from agent.vgpupolicy import VgpuPolicy

        try:
            MigChoice.parse(self.mig_profiles)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

        try:
            VgpuPolicy.of(self.vgpu_types, self.compatibility_groups)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if self.numa_node_list not in ("auto", "true", "false"):
            raise ConfigError(f"--numa-node-list must be auto, true or false, not {self.numa_node_list!r}")
        if bad := sorted(set(self.skip_node_operations) - set(SKIPPABLE_KINDS)):
            raise ConfigError(f"--skip-node-operations: {', '.join(bad)} cannot skip prepare (only "
                              f"{', '.join(SKIPPABLE_KINDS)} can: every other device needs its device nodes, "
                              "files or host changes on the node)")
        if bad := sorted(set(self.binding_conditions) - set(BINDABLE_KINDS)):
            raise ConfigError(f"--binding-conditions: {', '.join(bad)} not one of {', '.join(BINDABLE_KINDS)} "
                              "(the kinds whose prepare changes the host)")
        try:
            self.compute_shares  # noqa: B018  (parsed once, here, so a bad value stops the start)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if self.gpu_host_memory_overhead < 0:
            raise ConfigError(f"--gpu-host-memory-overhead must be >= 0, not {self.gpu_host_memory_overhead}")

    @functools.cached_property
    def compute_shares(self) -> ComputeShares | None:
        """The request policy of a shared GPU's compute (`--gpu-compute-shares`); None: off."""
        from agent.computeshare import ComputeShares

        return ComputeShares.parse(self.gpu_compute_shares)

    @functools.cached_property
    def plugin_resources(self) -> PluginResources:
        """The extended resource names a device plugin may serve this node's GPUs under
        (`--device-plugin-resources`, `agent.health.pluginholds`)."""
        from agent.names import PluginResources

        return PluginResources.parse(self.device_plugin_resources)

    @functools.cached_property
    def binding_kinds(self) -> frozenset[Kind]:
        """The device kinds published with binding conditions (`--binding-conditions`)."""
        from agent.kinds import Kind

        return frozenset(Kind(k) for k in self.binding_conditions)

    # Paths the kubelet and the runtime know about.
    @functools.cached_property
    def plugin_dir(self) -> Path:
        return self.kubelet_dir / "plugins" / self.driver_name

    @functools.cached_property
    def registry_dir(self) -> Path:
        return self.kubelet_dir / "plugins_registry"

    @functools.cached_property
    def pod_resources_socket(self) -> Path:
        """The kubelet's pod resources service (`agent.kube.podresources`): where the kubelet makes it, in
        its root directory."""
        return self.kubelet_dir / "pod-resources" / "kubelet.sock"

    @functools.cached_property
    def metadata_dir(self) -> Path:
        return self.plugin_dir / "dra-device-metadata"

    @functools.cached_property
    def dra_socket(self) -> Path:
        if not self.rolling_update_pod_uid:
            return self.plugin_dir / "dra.sock"
        return _fit_socket(self.plugin_dir, f"dra-{self.rolling_update_pod_uid}.sock",
                           self.rolling_update_pod_uid, "dra-")

    @functools.cached_property
    def registration_socket(self) -> Path:
        if not self.rolling_update_pod_uid:
            return self.registry_dir / f"{self.driver_name}-reg.sock"
        uid = self.rolling_update_pod_uid
        return _fit_socket(self.registry_dir, f"{self.driver_name}-{uid}-reg.sock", uid,
                           f"{self.driver_name}-", "-reg")

    @functools.cached_property
    def claims_state_dir(self) -> Path:
        return self.state_dir / "claims"

    @functools.cached_property
    def sim_root(self) -> Path:
        """The simulated machine (`--nvml sim`): its sysfs, /proc, /dev and control directory."""
        return self.state_dir / "nvml-sim"

    @functools.cached_property
    def cdi_vendor(self) -> str:
        return self.driver_name

    @functools.cached_property
    def metrics_endpoint(self) -> tuple[str | None, int] | None:
        """(host, port) for the metrics and probes server; host None is every interface; None: off."""
        return parse_address(self.metrics_address) if self.metrics_address else None

    @functools.cached_property
    def probe_endpoint(self) -> tuple[str | None, int] | None:
        """(host, port) of the probes' own listener; None: the probes are served on the metrics listener."""
        return parse_address(self.probe_address, "--probe-address") if self.probe_address else None


def parse_address(text: str, flag: str = "--metrics-address") -> tuple[str | None, int]:
    """`HOST:PORT`, `:PORT` (every interface) or `[IPV6]:PORT`; port 0 lets the kernel choose."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{flag} must be HOST:PORT or :PORT, not {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"{flag} {text!r}: write an IPv6 address in brackets, [ADDRESS]:PORT")
    return host or None, int(port)


def _fit_socket(directory: Path, name: str, uid: str, prefix: str, suffix: str = "") -> Path:
    """Keep a socket path under the unix limit, hashing the pod UID when it would not fit."""
    path = directory / name
    if len(os.fsencode(str(path))) < UNIX_PATH_MAX:
        return path
    digest = hashlib.sha256(uid.encode()).hexdigest()[:16]
    path = directory / f"{prefix}{digest}{suffix}.sock"
    if len(os.fsencode(str(path))) >= UNIX_PATH_MAX:
        raise ConfigError(f"socket path {path} is longer than {UNIX_PATH_MAX - 1} bytes")
    return path


SETTINGS_HELP = "dra-agent help settings"  # where every setting is listed


def add_arguments(parser: argparse.ArgumentParser, shown: Collection[str] | None = None) -> None:
    """Every setting as a flag of `parser`; `--help` lists those named in `shown` (all when None) and
    says where the others are listed."""
    group = parser.add_argument_group("settings (each also an environment variable)")
    for opt in OPTIONS:
        visible = shown is None or opt.dest in shown
        group.add_argument(opt.flag, dest=opt.dest, default=None, metavar=opt.metavar,
                           help=option_help(opt) if visible else argparse.SUPPRESS)
    if shown is not None:
        parser.epilog = (f"It takes every other setting of the agent too, as a flag or an environment variable: "
                         f"{SETTINGS_HELP} lists them.")


def option_help(opt: Option) -> str:
    return f"{opt.help} [${opt.env}]" + (f" (default: {opt.default})" if opt.default not in (None, "") else "")


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not true or false")


def settings_from(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None,
                  **overrides: Any) -> Settings:
    """Flags beat environment beats defaults; `overrides` (for tests) beat everything."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        raw = getattr(args, opt.dest, None) if args is not None else None
        if raw is None:
            raw = env.get(opt.env)
            if raw == "" and not opt.empty:
                raw = None
        if raw is None:
            continue
        try:
            values[opt.dest] = parse_bool(raw) if opt.kind is bool else opt.kind(raw)
        except ValueError as exc:
            raise ConfigError(f"{opt.flag} / ${opt.env}: {raw!r} is not a valid {opt.kind.__name__}") from exc
    values.update(overrides)
    return build_settings(values)


def build_settings(values: Mapping[str, Any]) -> Settings:
    kw: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        if key == "nvml" and isinstance(value, str):
            value = NvmlMode.parse(value)
        elif key in ("nic_include", "nic_exclude", "nic_passthrough", "node_ips", "skip_node_operations",
                     "binding_conditions") \
                and isinstance(value, str):
            value = _globs(value)
        elif key in ("driver_root", "kubelet_dir", "cdi_dir", "static_cdi_dir", "state_dir", "sysfs_root",
                     "dev_root", "kubeconfig", "offline", "offline_fallback", "taint_policy", "probe_socket") \
                and not isinstance(value, Path):
            value = Path(os.path.abspath(os.path.expanduser(str(value))))
        kw[key] = value
    return Settings(**kw)


def describe(settings: Settings) -> Sequence[tuple[str, str]]:
    """(flag, value) pairs for the first log lines."""
    return [(opt.flag, str(getattr(settings, opt.dest))) for opt in OPTIONS]
