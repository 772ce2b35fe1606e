"""Which GPUs a device plugin holds (agent/health/pluginholds.py): from the Node's extended resources and the
device-plugin device IDs the kubelet's pod resources service lists, in every ID form the NVIDIA device plugin
uses. The agent, the real API server and the kubelet's service: tests/cluster/test_cluster_device_plugin.py;
the real kubelet with a device plugin registered: tests/cluster/test_cluster_kubelet.py."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, Settings
from agent.health.pluginholds import (
    IN_USE,
    SERVING,
    UNKNOWN,
    GpuRef,
    NodeResources,
    assigned_ids,
    holds,
    node_resources,
)
from agent.kube.podresources import ContainerHolds, NodePods, PluginDevices, PodHolds
from agent.names import PluginResources

GPUS = [GpuRef(f"gpu-{i}", f"GPU-{i}0000000-aaaa-bbbb-cccc-dddddddddddd", i) for i in range(4)]
NAMES = PluginResources.parse("nvidia.com/gpu,nvidia.com/mig-*")
NOT_SERVING = NodeResources({"nvidia.com/gpu": 0}, {"nvidia.com/gpu": 4})


def pods(*held: tuple[str, str, tuple[str, ...]]) -> NodePods:
    """Pods named by their index, each with one container holding (resource, IDs)."""
    return NodePods(tuple(PodHolds("team", f"pod-{i}", (ContainerHolds("main", (PluginDevices(res, ids),), ()),))
                          for i, (_, res, ids) in enumerate(held)))


def held_by(*held: tuple[str, str, tuple[str, ...]], mig: dict[str, str] | None = None) -> dict[str, str]:
    return {name: h.reason for name, h in
            holds(GPUS, NOT_SERVING, assigned_ids(pods(*held), NAMES), mig).items()}


def test_the_names_are_exact_names_and_prefixes_and_a_bad_one_is_refused_clearly() -> None:
    assert NAMES.matches("nvidia.com/gpu") and NAMES.matches("nvidia.com/mig-1g.10gb")
    assert not NAMES.matches("nvidia.com/gpu.shared") and not NAMES.matches("example.com/gpu")
    assert not PluginResources.parse("") and not Settings(device_plugin_resources="").plugin_resources
    with pytest.raises(ConfigError, match=r"--device-plugin-resources: 'gpu' is not an extended resource name"):
        Settings(device_plugin_resources="nvidia.com/gpu,gpu")


def test_every_gpu_is_held_while_a_device_plugin_serves_one_of_the_names() -> None:
    node = node_resources({"nvidia.com/mig-1g.10gb": "7", "cpu": "32", "example.com/gpu": "8"}, {}, NAMES)
    out = holds(GPUS, node, {}, None)
    assert {n: h.reason for n, h in out.items()} == {g.device: SERVING for g in GPUS}
    assert "nvidia.com/mig-1g.10gb (allocatable 7)" in out["gpu-0"].detail
    # Another resource's count (one the plugin's names do not match) holds nothing.
    assert holds(GPUS, node_resources({"example.com/gpu": "8"}, {}, NAMES), {}, None) == {}


@pytest.mark.parametrize("ids", [("GPU-20000000-aaaa-bbbb-cccc-dddddddddddd",), ("2",),
                                 ("GPU-20000000-aaaa-bbbb-cccc-dddddddddddd::3",), ("2::0",)],
                         ids=["uuid", "index", "uuid-replica", "index-replica"])
def test_once_none_serves_only_the_gpus_pods_still_have_are_held(ids: tuple[str, ...]) -> None:
    assert held_by(("", "nvidia.com/gpu", ids)) == {"gpu-2": IN_USE}


def test_a_mig_device_holds_its_gpu_by_uuid_or_by_index() -> None:
    assert held_by(("", "nvidia.com/mig-1g.10gb", ("MIG-feed",)),
                   mig={"MIG-feed": "GPU-30000000-aaaa-bbbb-cccc-dddddddddddd"}) == {"gpu-3": IN_USE}
    assert held_by(("", "nvidia.com/mig-1g.10gb", ("1:0",))) == {"gpu-1": IN_USE}


def test_an_id_that_names_no_gpu_holds_every_gpu() -> None:
    assert held_by(("", "nvidia.com/gpu", ("GPU-0",)), ("", "nvidia.com/mig-2g.20gb", ("MIG-unknown",))) == {
        g.device: UNKNOWN for g in GPUS}


def test_other_resources_and_no_pods_hold_nothing() -> None:
    assert held_by(("", "example.com/fpga", ("2",))) == {}
    assert held_by() == {}


def test_before_the_kubelet_has_answered_a_node_a_device_plugin_was_on_holds_every_gpu() -> None:
    assert {h.reason for h in holds(GPUS, NOT_SERVING, None).values()} == {UNKNOWN}
    assert len(holds(GPUS, NOT_SERVING, None)) == len(GPUS)
    # A Node that never had one: nothing to wait for.
    assert holds(GPUS, NodeResources({}, {}), None) == {}
    assert holds(GPUS, None, None) == {}
