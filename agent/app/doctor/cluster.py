"""Doctor checks of the cluster: the API server, this Node, and the RBAC permissions the
agent uses (one SelfSubjectAccessReview each). With `--offline` no API server is asked."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import kube
from agent.app.doctor.base import Checks
from agent.app.doctor.results import Result, failed, passed, skipped
from agent.config import Settings
from agent.events import NAMESPACE as EVENTS_NAMESPACE


@dataclass(frozen=True, slots=True)
class Permission:
    verb: str
    group: str
    resource: str
    why: str
    namespaced: bool = False
    named: str = ""  # the object the permission is for: "node" (this Node), "driver" (the driver's name)
    namespace: str = ""  # the one namespace it is granted in (a Role's); "": every namespace, or none
    blocking: bool = True  # False: only a command a person runs needs it, not the agent

    def __str__(self) -> str:
        return f"{self.verb} {self.resource}{'.' + self.group if self.group else ''}"


# Every API call the agent makes: agent/kube/__init__.py and agent/health/pluginholds.py (the Node),
# agent/claims/sources.py and watch.py (claims), agent/publish/apiserver.py (slices), agent/health/statussinks.py
# and statusupdate.py (claim status), agent/health/taintrules.py (`dra-agent taints`), agent/events.py (Events).
# A permission the agent does not use is not asked for.
PERMISSIONS: tuple[Permission, ...] = (
    Permission("get", "", "nodes", "read this Node: its UID (slice owner) and declared features", named="node"),
    Permission("get", "resource.k8s.io", "resourceclaims", "read a claim the kubelet asks to prepare",
               namespaced=True),
    Permission("list", "resource.k8s.io", "resourceslices", "read this node's published slices"),
    Permission("watch", "resource.k8s.io", "resourceslices", "see at once what others change in this node's slices"),
    Permission("get", "resource.k8s.io", "resourceslices", "read back a slice whose create answer was lost"),
    Permission("create", "resource.k8s.io", "resourceslices", "publish devices"),
    Permission("update", "resource.k8s.io", "resourceslices", "republish changed devices"),
    Permission("delete", "resource.k8s.io", "resourceslices", "remove slices of an older generation"),
    Permission("patch", "resource.k8s.io", "resourceclaims/status",
               "report the status.devices entries of prepared claims (server-side apply)", namespaced=True),
    # What the API server also checks for that write (DRAResourceClaimGranularStatusAuthorization, on by
    # default since 1.36): the driver's own entries, of claims allocated on the writer's node.
    Permission("associated-node:patch", "resource.k8s.io", "resourceclaims/driver",
               "write status.devices entries of this driver for claims on this node", namespaced=True,
               named="driver"),
    # The same write as an update, for a claim whose opaque parameters the API server refuses every apply of
    # (agent/health/statusupdate.py).
    Permission("update", "resource.k8s.io", "resourceclaims/status",
               "report the status.devices entries of a claim no server-side apply can change (update)",
               namespaced=True),
    Permission("associated-node:update", "resource.k8s.io", "resourceclaims/driver",
               "write status.devices entries of this driver for claims on this node (update)", namespaced=True,
               named="driver"),
    # agent/events.py: Events on the Node (an unreadable claim record set aside), in the namespace a Node's Events
    # live in, the only one deploy/ grants. Best effort: the log, the metric and /readyz say it too, so the agent
    # works without it.
    Permission("create", "events.k8s.io", "events", "post Events about this node (an unreadable claim record set "
               "aside)", namespaced=True, blocking=False, namespace=EVENTS_NAMESPACE),
    Permission("list", "resource.k8s.io", "devicetaintrules",
               "list the DeviceTaintRules an administrator made for this node's devices (dra-agent taints)"),
    # `dra-agent pool status` (agent/app/poolstatus.py): the agent itself never asks.
    Permission("create", "resource.k8s.io", "resourcepoolstatusrequests",
               "ask for this node's pool status (dra-agent pool status)", blocking=False),
    Permission("get", "resource.k8s.io", "resourcepoolstatusrequests",
               "read the pool status asked for (dra-agent pool status)", blocking=False),
    Permission("delete", "resource.k8s.io", "resourcepoolstatusrequests",
               "remove the pool status request once read (dra-agent pool status)", blocking=False),
)


# With --binding-conditions only (deploy/overlays/binding-conditions grants it): agent/claims/watch.py.
BINDING_CONDITIONS: tuple[Permission, ...] = (
    Permission("watch", "resource.k8s.io", "resourceclaims",
               "watch claims, to prepare those allocated here before their pods are bound (--binding-conditions)"),
)


# Unless --device-plugin-resources is empty: agent/health/pluginholds.py.
DEVICE_PLUGIN: tuple[Permission, ...] = (
    Permission("watch", "", "nodes", "follow this Node's extended resources, which a device plugin serving the GPUs "
               "shows (--device-plugin-resources)", named="node"),
)


def permissions(settings: Settings) -> tuple[Permission, ...]:
    """The permissions the agent with these settings uses."""
    return (PERMISSIONS + (BINDING_CONDITIONS if settings.binding_conditions else ())
            + (DEVICE_PLUGIN if settings.plugin_resources else ()))


class ClusterChecks(Checks):
    async def cluster(self) -> list[Result]:
        s = self.s
        if s.offline is not None:
            return [skipped("Kubernetes API", f"offline (--offline {s.offline}): the agent talks to no API "
                            "server"), self._offline_node(s.offline),
                    skipped("RBAC", "offline: no API server to ask")]
        client, source = await kube.connect(s)
        if client is None:
            if s.offline_fallback is not None:
                return [passed("Kubernetes API", f"{source}: the agent runs offline in {s.offline_fallback} "
                               "(--offline-fallback)"), self._offline_node(s.offline_fallback),
                        skipped("RBAC", "offline: no API server to ask")]
            return [failed("Kubernetes API", source, "give --kubeconfig, or run in the agent's pod"),
                    skipped("Node", "no API server"), skipped("RBAC", "no API server")]
        try:
            results = await self._cluster(client, source)
        finally:
            await client.close()
        if s.offline_fallback is not None:
            # What fails here sends the agent offline (connection.connect), it does not stop it.
            for r in results:
                if not r.ok and r.check in ("Kubernetes API", "Node"):
                    r.blocking = False
                    r.detail += f"; the agent runs offline in {s.offline_fallback} (--offline-fallback)"
        return results

    async def _cluster(self, client: Any, source: str) -> list[Result]:
        s = self.s
        server = client.config.cluster.server
        try:
            async with asyncio.timeout(s.api_timeout):
                node = await kube.read_node(client, s.node_name)
        except kube.NodeNotFound as exc:
            return [passed("Kubernetes API", f"{server} answers ({source})"),
                    failed("Node", str(exc), "give --node-name / $NODE_NAME the Node's name (the DaemonSet "
                           "sets it from spec.nodeName)"), *await self.rbac(client)]
        except Exception as exc:
            why = "no answer in time" if isinstance(exc, TimeoutError) else kube.describe(exc)
            if kube.status_code(exc) in (401, 403):
                return [failed("Kubernetes API", f"{server}: {why}", "check the credentials (the service "
                               "account token) and RBAC: get nodes"), skipped("Node", "cannot read it"),
                        *await self.rbac(client)]
            return [failed("Kubernetes API", f"{server} ({source}): {why}", "check the network path to the "
                           "API server from this node, and --kubeconfig"),
                    skipped("Node", "no API server"), skipped("RBAC", "no API server")]
        return [passed("Kubernetes API", f"{server} answers ({source})"), _node_result(node, "the API server"),
                *await self.rbac(client)]

    def _offline_node(self, directory: Path) -> Result:
        node = kube.read_offline_node(directory, self.s.node_name)
        if not node.uid:
            return passed("Node", f"offline, no {directory / 'node.yaml'}: slices carry no owner reference, "
                          "CPU and memory are not node-allocatable")
        return _node_result(node, str(directory / "node.yaml"))

    async def rbac(self, client: Any) -> list[Result]:
        from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
        from lightkube.resources.authorization_v1 import SelfSubjectAccessReview

        async def review(p: Permission) -> tuple[Permission, bool | None, str]:
            resource, _, subresource = p.resource.partition("/")
            name = {"node": self.s.node_name, "driver": self.s.driver_name}.get(p.named)
            attributes = ResourceAttributes(verb=p.verb, group=p.group, resource=resource,
                                            subresource=subresource or None, name=name,
                                            namespace=p.namespace or None)
            try:
                async with asyncio.timeout(self.s.api_timeout):
                    answer = await client.create(SelfSubjectAccessReview(
                        spec=SelfSubjectAccessReviewSpec(resourceAttributes=attributes)))
            except Exception as exc:
                return p, None, kube.describe(exc) if not isinstance(exc, TimeoutError) else "no answer in time"
            status = answer.status
            return p, bool(status and status.allowed), (status.reason or "") if status else ""

        wanted = permissions(self.s)
        answers = await asyncio.gather(*(review(p) for p in wanted))
        errors = [f"{p}: {why}" for p, allowed, why in answers if allowed is None]
        denied = [p for p, allowed, _ in answers if allowed is False]
        if errors:
            return [failed("RBAC", "SelfSubjectAccessReview failed: " + "; ".join(errors[:3]),
                           "the API server must answer SelfSubjectAccessReviews (authorization.k8s.io/v1)",
                           blocking=False)]
        if denied:
            return [failed("RBAC", "denied: " + "; ".join(f"{p} ({p.why})" for p in denied),
                           "grant them to the agent's service account (deploy/base has the ClusterRole): "
                           "kubectl auth can-i --as=system:serviceaccount:<namespace>:<account> ...",
                           blocking=any(p.blocking for p in denied))]
        return [passed("RBAC", f"all {len(wanted)} permissions the agent uses are granted: "
                       + ", ".join(map(str, wanted)))]


def _node_result(node: kube.NodeInfo, where: str) -> Result:
    features = ", ".join(sorted(node.declared_features)) or "none"
    allocatable = ("CPU and memory are published as node-allocatable" if node.node_allocatable else
                   f"no {kube.NODE_ALLOCATABLE_FEATURE}: CPU and memory are published as plain devices")
    return passed("Node", f"{node.name} (uid {node.uid or 'unknown'}) from {where}; declared features: "
                  f"{features}; {allocatable}")

