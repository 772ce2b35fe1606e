"""Device binding conditions (resource.k8s.io/v1, `DRADeviceBindingConditions`, beta and on by default
since 1.36): devices whose host work is slow are published with a condition the scheduler waits for.

A device of a kind named by `--binding-conditions` carries `bindingConditions: [HostPrepared]` and
`bindingFailureConditions: [HostPrepareFailed]` in its slice. The scheduler copies both into each
allocation result of such a device, reserves the claim for the pod, and waits in PreBind (polling the
claim every 5 s, for at most its `bindingTimeout`, 600 s by default) until every binding condition is
True in the claim's `status.devices` entry of that device (matched by driver, pool and device); a True
failure condition fails the binding and the next scheduling attempt deallocates the claim. The agent
watches the claims allocated on its node, prepares such a claim as soon as it is allocated
(`agent.engine.prebind`) and writes the condition (`agent.health.claimstatus`), so the pod is bound
only once the slow work (a vfio-pci rebind, a MIG instance, a mediated device) is done, and the
kubelet's NodePrepareResources later finds the claim prepared.

The API's rules (1.37): at most 4 of each; each a qualified name; no duplicates; the two lists do not
overlap; one is required when the other is given. `bindsToNode` is not set: a device of a slice with
`nodeName` is already allocated to that node alone (the allocation's node selector names it).
"""

from __future__ import annotations

from agent.kinds import Kind

BINDING_CONDITION = "HostPrepared"  # True once the claim is prepared on the node
BINDING_FAILURE_CONDITION = "HostPrepareFailed"  # True when preparing it failed: the scheduler tries again

BINDING_CONDITIONS = (BINDING_CONDITION,)
BINDING_FAILURE_CONDITIONS = (BINDING_FAILURE_CONDITION,)


def bindable_kinds() -> tuple[str, ...]:
    """The kinds `--binding-conditions` may name: those whose prepare changes the host (a PCI function
    bound to vfio-pci, a GPU partition made), the slow work worth doing before the pod is bound."""
    return tuple(str(k) for k in Kind if k.passthrough or k.partition_kind is not None)
