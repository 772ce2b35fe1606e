"""Every setting of the agent as a flag and an environment variable: the table `OPTIONS`, with each
one's default, help text and parser. `agent.config` builds `Settings` from it (and re-exports it);
argparse and `--help` are made from it, and docs/configuration.md is checked against it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


def default_state_dir() -> str:
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
    Option("driver_root", "--driver-root", "DRA_DRIVER_ROOT", "/",
           "where the NVIDIA driver is installed, as the agent sees it: / on the host, or a mount of the host's "
           "/ (host install) or of /run/nvidia/driver (containerized driver); libnvidia-ml.so.1 is loaded from "
           "below it", metavar="DIR"),
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
    Option("node_ips", "--node-ips", "DRA_NODE_IPS", "",
           "comma-separated addresses of this Node (the DaemonSet gives status.hostIPs): a NIC holding one, "
           "or below a link that does (its bridge, bond, VLAN), is the node's uplink, like one below a default "
           "route, and never moved into a pod or passed through", metavar="IPS"),
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
           "seconds a prepared claim must stay unused by every pod on the node (the kubelet's pod resources "
           "service says; offline: its claim file gone) before it is looked up and, its ResourceClaim gone "
           "(deleted, or re-created with another UID), unprepared here; checked at start and then once a grace "
           "period",
           kind=float, metavar="SECONDS"),
    Option("device_plugin_resources", "--device-plugin-resources", "DRA_DEVICE_PLUGIN_RESOURCES",
           "nvidia.com/gpu,nvidia.com/mig-*",
           "comma list of the extended resource names (a trailing * for a prefix) a device plugin may serve this "
           "node's GPUs under: while one serves them, and while its pods hold GPUs, those GPUs are published with "
           "a NoSchedule taint <driver>/device-plugin so no claim gets a GPU a device plugin gives out; empty: "
           "no device plugin is looked for (docs/migration.md)", metavar="NAMES", empty=True),
    Option("dynamic_mig", "--dynamic-mig", "DRA_DYNAMIC_MIG", True,
           "publish every MIG placement of the profiles --mig-profiles names on MIG-capable GPUs as a device on "
           "the GPU's counter set; prepare "
           "creates the GPU and compute instance (true/false)", kind=bool, metavar="BOOL"),
    Option("mig_profiles", "--mig-profiles", "DRA_MIG_PROFILES", "1g,2g,3g,7g",
           "the MIG profiles whose placements --dynamic-mig publishes: all, or a comma list of profile names "
           "(1g.10gb, 1g.10gb+me) and compute sizes (3g: the GPU's profile of 3 compute slices without media "
           "extensions and with the least memory, 3g.40gb on an H100); every placement is a device the "
           "scheduler reads for every pod (docs/benchmarks.md)", metavar="PROFILES"),
    Option("vgpu_types", "--vgpu-types", "DRA_VGPU_TYPES", "auto",
           "vGPU (mediated device) types to publish where a GPU's host driver offers them, one device per "
           "instance: auto (every type with --compatibility-groups, none without), none, or a comma list of "
           "type ids or names (one type without --compatibility-groups)", metavar="TYPES"),
    Option("gpu_sharing", "--gpu-sharing", "DRA_GPU_SHARING", False,
           "also publish each GPU as gpu-<minor>-shared, memory and compute capacities several claims take "
           "shares of "
           "(DRAConsumableCapacity; true/false)", kind=bool, metavar="BOOL"),
    Option("gpu_compute_shares", "--gpu-compute-shares", "DRA_GPU_COMPUTE_SHARES", "0.1/0.05/1/0.05",
           "the compute a shared GPU (--gpu-sharing) also offers, 1 the whole GPU: the request policy's "
           "default, min, max and step as fractions, each a whole percentage (MPS's thread percentage), or "
           "off (DRAFractionalCapacityRange; computePercent on a server without it)",
           metavar="DEFAULT/MIN/MAX/STEP"),
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
    Option("binding_conditions", "--binding-conditions", "DRA_BINDING_CONDITIONS", "",
           "comma list of device kinds (vfio, mig, vgpu) published with binding conditions: the agent "
           "prepares their claims as soon as they are allocated here and the scheduler binds the pod once "
           "that is done (DRADeviceBindingConditions; README: Binding conditions)", metavar="KINDS"),
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
           "HTTP /metrics, and probes without --probe-address (no HOST: any; empty: off)",
           metavar="HOST:PORT", empty=True),
    Option("probe_address", "--probe-address", "DRA_PROBE_ADDRESS", "",
           "HTTP listener of the probes alone (the DaemonSet: 127.0.0.1:9478)", metavar="HOST:PORT",
           empty=True),
    Option("probe_socket", "--probe-socket", "DRA_PROBE_SOCKET", None,
           "unix socket of the probes, for the kubelet's exec probes (python3 -m agent.app.probeclient; "
           "the DaemonSet: /run/dra-agent/probe.sock, in an emptyDir)", metavar="PATH"),
    Option("stop_with_parent", "--stop-with-parent", "DRA_STOP_WITH_PARENT", False,
           "run: stop, as on SIGTERM, when the process that started the agent exits (`make run` sets it) "
           "(true/false)", kind=bool, metavar="BOOL"),
    Option("log_format", "--log-format", "DRA_LOG_FORMAT", "auto",
           "auto (text on a terminal, else JSON), json or text", metavar="FORMAT"),
    Option("log_level", "--log-level", "DRA_LOG_LEVEL", "info", "debug, info, warning or error",
           metavar="LEVEL"),
)
