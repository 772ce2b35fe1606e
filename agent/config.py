"""One frozen settings object, built from command-line flags and environment variables.

Every setting is a flag and an environment variable (the flag wins). The table
`OPTIONS` is the single source: argparse and `--help` are made from it, and the settings table of
docs/configuration.md is checked against it (tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNIX_PATH_MAX = 108  # sun_path, including the terminating NUL
# Device kinds whose claims may skip the kubelet's prepare and unprepare (`--skip-node-operations`): what
# such a claim gets from prepare is a CPU list or a NUMA node's name in its environment, which a claim
# taken for node-allocatable accounting alone does without.
SKIPPABLE_KINDS = ("cpu", "memory")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Option:
    dest: str
    flag: str
    env: str
    default: Any
    help: str
    kind: Callable[[str], Any] = str  # a type, or a parser whose __name__ reads as one (`quantity`)
    metavar: str | None = None
    empty: bool = False  # an empty value (flag or environment) is a value, not "unset"


def quantity(text: str) -> int:
    """A byte count as a Kubernetes quantity (`256Mi`, `1G`, `1048576`)."""
    from agent.quantity import parse_int

    return parse_int(text)


def _default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/dra-agent"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "dra-agent")


# Clear of Prometheus (9090), node-exporter (9100), DCGM exporter (9400) and the kubelet (10248, 10250).
# The agent runs with hostNetwork, so the port is taken on the node itself; deploy/ probes it.
DEFAULT_METRICS_ADDRESS = ":9477"

OPTIONS: tuple[Option, ...] = (
    Option("driver_name", "--driver-name", "DRA_DRIVER_NAME", "dra.example.com",
           "DRA driver name (a DNS subdomain); also the CDI vendor"),
    Option("node_name", "--node-name", "NODE_NAME", None,
           "this node's name (default: the host name)"),
    Option("nvml", "--nvml", "DRA_NVML", "auto",
           "GPU discovery: auto (real NVML if it loads), real, or sim[:PROFILE]", metavar="MODE"),
    Option("kubelet_dir", "--kubelet-dir", "DRA_KUBELET_DIR", "/var/lib/kubelet",
           "kubelet root: sockets under plugins/ and plugins_registry/", metavar="DIR"),
    Option("cdi_dir", "--cdi-dir", "DRA_CDI_DIR", "/var/run/cdi",
           "directory for the per-claim CDI specs (dynamic CDI dir)", metavar="DIR"),
    Option("static_cdi_dir", "--static-cdi-dir", "DRA_STATIC_CDI_DIR", "/etc/cdi",
           "static CDI dir, searched (with --cdi-dir) for the NVIDIA toolkit's GPU specs", metavar="DIR"),
    Option("state_dir", "--state-dir", "DRA_STATE_DIR", None,
           "durable per-claim records (default /var/lib/dra-agent as root, else ~/.local/state/dra-agent)",
           metavar="DIR"),
    Option("sysfs_root", "--sysfs-root", "DRA_SYSFS_ROOT", "/sys", "sysfs mount point", metavar="DIR"),
    Option("dev_root", "--dev-root", "DRA_DEV_ROOT", "/dev",
           "host directory holding the device nodes (nvidia*, vfio)", metavar="DIR"),
    Option("kubeconfig", "--kubeconfig", "KUBECONFIG", None,
           "kubeconfig file; wins over the in-cluster config (default: in-cluster, then ~/.kube/config)",
           metavar="FILE"),
    Option("offline", "--offline", "DRA_OFFLINE", None,
           "talk to no API server: slices to DIR/resourceslices, claims from DIR/resourceclaims",
           metavar="DIR"),
    Option("offline_fallback", "--offline-fallback", "DRA_OFFLINE_FALLBACK", None,
           "like --offline DIR, but only when no cluster is configured, reachable and knows this node",
           metavar="DIR"),
    Option("nic_include", "--nic-include", "DRA_NIC_INCLUDE", "",
           "comma-separated interface-name globs to publish even if virtual", metavar="GLOBS"),
    Option("nic_exclude", "--nic-exclude", "DRA_NIC_EXCLUDE", "",
           "comma-separated interface-name globs never to publish", metavar="GLOBS"),
    Option("nic_passthrough", "--nic-passthrough", "DRA_NIC_PASSTHROUGH", "",
           "comma-separated interface-name globs: PFs without SR-IOV VFs that also get a passthrough (VFIO) "
           "variant (every VF gets one anyway; --nic-exclude wins)", metavar="GLOBS"),
    Option("rescan_interval", "--rescan-interval", "DRA_RESCAN_INTERVAL", 60.0,
           "seconds between NVML and sysfs rescans", kind=float, metavar="SECONDS"),
    Option("netlink_debounce", "--netlink-debounce", "DRA_NETLINK_DEBOUNCE", 0.5,
           "seconds to wait after a netlink event before rescanning NICs", kind=float, metavar="SECONDS"),
    Option("rolling_update_pod_uid", "--rolling-update-pod-uid", "DRA_ROLLING_UPDATE_POD_UID", "",
           "this agent pod's UID: use per-pod socket names so two agents can overlap", metavar="UID"),
    Option("allow_unsafe_roots", "--allow-unsafe-roots", "DRA_ALLOW_UNSAFE_ROOTS", False,
           "start even when a directory the agent writes below is writable by others or owned by "
           "another user (true/false)", kind=bool, metavar="BOOL"),
    Option("claim_fetch_concurrency", "--claim-fetch-concurrency", "DRA_CLAIM_FETCH_CONCURRENCY", 16,
           "ResourceClaim GETs in flight at once", kind=int, metavar="N"),
    Option("api_timeout", "--api-timeout", "DRA_API_TIMEOUT", 10.0,
           "seconds for one API server request", kind=float, metavar="SECONDS"),
    Option("gc_grace_period", "--gc-grace-period", "DRA_GC_GRACE_PERIOD", 600.0,
           "seconds a prepared claim's ResourceClaim must stay gone (deleted, or re-created with another "
           "UID) before the claim is unprepared here; checked at start and every min(grace/4, 60) s",
           kind=float, metavar="SECONDS"),
    Option("dynamic_mig", "--dynamic-mig", "DRA_DYNAMIC_MIG", True,
           "publish every MIG placement of MIG-capable GPUs as a device on the GPU's counter set; prepare "
           "creates the GPU and compute instance (true/false)", kind=bool, metavar="BOOL"),
    Option("vgpu_types", "--vgpu-types", "DRA_VGPU_TYPES", "auto",
           "vGPU (mediated device) types to publish where a GPU's host driver offers them, one device per "
           "instance: auto (every type with --compatibility-groups, none without), none, or a comma list of "
           "type ids or names (one type without --compatibility-groups)", metavar="TYPES"),
    Option("gpu_sharing", "--gpu-sharing", "DRA_GPU_SHARING", False,
           "also publish each GPU as gpu-<minor>-shared, a memory capacity several claims take shares of "
           "(DRAConsumableCapacity; true/false)", kind=bool, metavar="BOOL"),
    Option("compatibility_groups", "--compatibility-groups", "DRA_COMPATIBILITY_GROUPS", False,
           "publish compatibility groups (mig, vgpu) on counter consumptions; only for clusters with the "
           "DRADeviceCompatibilityGroups gate on (true/false)", kind=bool, metavar="BOOL"),
    Option("kubevirt_cpu", "--kubevirt-cpu", "DRA_KUBEVIRT_CPU", False,
           "publish CPU devices as KubeVirt's CPUsWithDRA asks for them: capacity dra.cpu/cpu (instead of "
           "cpus), attribute dra.cpu/socketID, shared by claims whatever the Node declares (true/false)",
           kind=bool, metavar="BOOL"),
    Option("numa_node_list", "--numa-node-list", "DRA_NUMA_NODE_LIST", "auto",
           "publish resource.kubernetes.io/numaNode as a list (the node, then its socket's nearest nodes; "
           "DRAListTypeAttributes): auto (where the Node declares DRAListTypeAttributes), true or false",
           metavar="MODE"),
    Option("partition_type_attribute", "--partition-type-attribute", "DRA_PARTITION_TYPE_ATTRIBUTE", False,
           "put MIG and vGPU devices in slices of their own that name their partitionType attribute "
           "(partitionTypeAttribute, for ResourcePoolStatusRequest summaries; DRAPartitionableDevicesType; "
           "true/false)", kind=bool, metavar="BOOL"),
    Option("skip_node_operations", "--skip-node-operations", "DRA_SKIP_NODE_OPERATIONS", "",
           "comma list of device kinds (cpu, memory) whose claims need no prepare on the node: their slices "
           "say skipNodeOperations where the Node declares DRAOptionalNodeOperations", metavar="KINDS"),
    Option("gpu_host_memory_overhead", "--gpu-host-memory-overhead", "DRA_GPU_HOST_MEMORY_OVERHEAD", 256 * 2**20,
           "host memory a container using a GPU device costs, published as nodeAllocatableResources "
           "memory overhead when the Node declares DRANodeAllocatableResources (a quantity: 256Mi)",
           kind=quantity, metavar="QUANTITY"),
    Option("gpu_probe_interval", "--gpu-probe-interval", "DRA_GPU_PROBE_INTERVAL", 1.0,
           "seconds between probes of every GPU for a lost, recovered or reset GPU (two NVML calls each)",
           kind=float, metavar="SECONDS"),
    Option("taint_policy", "--taint-policy", "DRA_TAINT_POLICY", None,
           "YAML file laid over the default taint policy (XID -> effect, lost GPU, link down and its "
           "hold time; docs/health.md)", metavar="FILE"),
    Option("metrics_address", "--metrics-address", "DRA_METRICS_ADDRESS", DEFAULT_METRICS_ADDRESS,
           "HOST:PORT for /metrics, /healthz and /readyz (HTTP; no HOST: every interface; "
           "empty: off)", metavar="HOST:PORT", empty=True),
    Option("stop_with_parent", "--stop-with-parent", "DRA_STOP_WITH_PARENT", False,
           "run: stop, as on SIGTERM, when the process that started the agent exits (`make run` sets it) "
           "(true/false)", kind=bool, metavar="BOOL"),
    Option("log_format", "--log-format", "DRA_LOG_FORMAT", "auto",
           "auto (text on a terminal, else JSON), json or text", metavar="FORMAT"),
    Option("log_level", "--log-level", "DRA_LOG_LEVEL", "info", "debug, info, warning or error",
           metavar="LEVEL"),
)


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
    kubelet_dir: Path = Path("/var/lib/kubelet")
    cdi_dir: Path = Path("/var/run/cdi")
    static_cdi_dir: Path = Path("/etc/cdi")
    state_dir: Path = field(default_factory=lambda: Path(_default_state_dir()))
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    kubeconfig: Path | None = None
    offline: Path | None = None
    offline_fallback: Path | None = None
    nic_include: tuple[str, ...] = ()
    nic_exclude: tuple[str, ...] = ()
    nic_passthrough: tuple[str, ...] = ()
    rescan_interval: float = 60.0
    netlink_debounce: float = 0.5
    rolling_update_pod_uid: str = ""
    allow_unsafe_roots: bool = False
    claim_fetch_concurrency: int = 16
    api_timeout: float = 10.0
    gc_grace_period: float = 600.0
    dynamic_mig: bool = True
    vgpu_types: str = "auto"
    gpu_sharing: bool = False
    compatibility_groups: bool = False
    kubevirt_cpu: bool = False
    numa_node_list: str = "auto"
    partition_type_attribute: bool = False
    skip_node_operations: tuple[str, ...] = ()
    gpu_host_memory_overhead: int = 256 * 2**20
    gpu_probe_interval: float = 1.0
    taint_policy: Path | None = None
    metrics_address: str = DEFAULT_METRICS_ADDRESS
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
        if self.metrics_address:
            parse_address(self.metrics_address)
        from agent.vgpupolicy import VgpuPolicy

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
        if self.gpu_host_memory_overhead < 0:
            raise ConfigError(f"--gpu-host-memory-overhead must be >= 0, not {self.gpu_host_memory_overhead}")

    # Paths the kubelet and the runtime know about.
    @functools.cached_property
    def plugin_dir(self) -> Path:
        return self.kubelet_dir / "plugins" / self.driver_name

    @functools.cached_property
    def registry_dir(self) -> Path:
        return self.kubelet_dir / "plugins_registry"

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


def parse_address(text: str) -> tuple[str | None, int]:
    """`HOST:PORT`, `:PORT` (every interface) or `[IPV6]:PORT`; port 0 lets the kernel choose."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--metrics-address must be HOST:PORT or :PORT, not {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"--metrics-address {text!r}: write an IPv6 address in brackets, [ADDRESS]:PORT")
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
        elif key in ("nic_include", "nic_exclude", "nic_passthrough", "skip_node_operations") \
                and isinstance(value, str):
            value = _globs(value)
        elif key in ("kubelet_dir", "cdi_dir", "static_cdi_dir", "state_dir", "sysfs_root", "dev_root",
                     "kubeconfig", "offline", "offline_fallback", "taint_policy") and not isinstance(value, Path):
            value = Path(os.path.abspath(os.path.expanduser(str(value))))
        kw[key] = value
    return Settings(**kw)


def describe(settings: Settings) -> Sequence[tuple[str, str]]:
    """(flag, value) pairs for the first log lines."""
    return [(opt.flag, str(getattr(settings, opt.dest))) for opt in OPTIONS]
