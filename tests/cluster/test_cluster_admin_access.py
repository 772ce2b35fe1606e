"""Admin access through the real scheduler: a monitoring claim (`adminAccess: true`, in a namespace labelled
`resource.kubernetes.io/admin-access: "true"`, which the API server requires) is allocated a GPU that another
pod's claim holds, and the agent prepares both: the monitor's without any exclusivity check or change to the
device, the holder's untouched."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .clusterkit import ApiFailure, Cluster, eventually
from .workloads import (
    BUS,
    Namespace,
    NodeAgent,
    allocated,
    claim_spec,
    our_status,
    prepared,
    published,
    request,
    string,
)

pytestmark = pytest.mark.cluster

ADMIN_LABEL = "resource.kubernetes.io/admin-access"
GPU = "gpu-3"


@pytest.fixture
def admin_ns(cluster: Cluster) -> Iterator[Namespace]:
    space = Namespace(cluster, "admin-access-monitoring").create()
    cluster.admin.merge_patch(f"/api/v1/namespaces/{space.name}", {"metadata": {"labels": {ADMIN_LABEL: "true"}}})
    yield space
    space.clean()


def monitor_request(bus: str) -> dict[str, object]:
    req = request("gpu", "gpu", selectors=[f"{BUS} == '{bus}'"])
    req["exactly"]["adminAccess"] = True  # type: ignore[index]
    return req


def test_a_monitored_gpu_is_passed_through_to_a_vm_and_both_are_prepared(
        scheduled: NodeAgent, ns: Namespace, admin_ns: Namespace) -> None:
    bus = string(published(scheduled)[GPU], "resource.kubernetes.io/pciBusID")
    # Outside a labelled namespace the API server refuses admin access.
    with pytest.raises(ApiFailure) as refused:
        ns.claim("monitor", claim_spec(monitor_request(bus)))
    assert refused.value.status in (403, 422) and ADMIN_LABEL in refused.value.message, refused.value.message

    admin_ns.claim("monitor", claim_spec(monitor_request(bus)))
    admin_ns.pod("monitor", scheduled.node, claims={"gpu": "monitor"})
    admin_ns.scheduled("monitor")
    (monitor,) = admin_ns.claims_of("monitor").values()
    (result,) = monitor["status"]["allocation"]["devices"]["results"]
    assert (result["device"], result.get("adminAccess")) == (GPU, True)
    # Admin access holds nothing for the scheduler: the GPU's passthrough form goes to a VM.
    ns.claim("vm", claim_spec(request("vm", "gpu-passthrough", selectors=[f"{BUS} == '{bus}'"])))
    ns.pod("vm", scheduled.node, claims={"vm": "vm"})
    ns.scheduled("vm")
    (vm,) = ns.claims_of("vm").values()

    # The agent prepares both (the VM's form excludes the native one for any claim but a monitor's), the
    # monitor's without binding or checking anything, the VM's bound to vfio-pci.
    monitor_uid, vm_uid = monitor["metadata"]["uid"], vm["metadata"]["uid"]
    assert prepared(scheduled.prepare(monitor)[monitor_uid]) == allocated(monitor)
    assert prepared(scheduled.prepare(vm)[vm_uid]) == allocated(vm)
    (variant,) = [r[2] for r in allocated(vm)]
    assert scheduled.cli("vfio", "status").stdout.count(variant) >= 1
    eventually(lambda: our_status(admin_ns.get("resourceclaims", "monitor")), "the monitor's status")
    eventually(lambda: our_status(ns.get("resourceclaims", "vm")), "the VM's status")

    # Prepared in the other order too: the monitor again, beside the bound VM.
    assert scheduled.unprepare(monitor)[monitor_uid].get("error", "") == ""
    assert prepared(scheduled.prepare(monitor)[monitor_uid]) == allocated(monitor)

    # What kube-scheduler 1.37.2 does not allow: admin access to a device whose counters another claim's
    # device consumed (the allocator checks counters for admin access too; docs/tests.md).
    admin_ns.claim("late-monitor", claim_spec(monitor_request(bus)))
    admin_ns.pod("late-monitor", scheduled.node, claims={"gpu": "late-monitor"})
    assert admin_ns.unschedulable("late-monitor")["reason"] == "Unschedulable"

    for claim in (monitor, vm):
        assert scheduled.unprepare(claim)[claim["metadata"]["uid"]].get("error", "") == ""
