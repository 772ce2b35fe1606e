"""Claim status writes against the real API server, for claims whose opaque parameters it stores other than as
it encodes them.

The API server 1.37.2 keeps a claim's opaque `parameters` as the bytes it was sent (the scheduler copies them
into the allocation), and refuses any status write after which those bytes differ from its own re-encoding:
keys out of sorted order defeat every server-side apply, spaces every patch, whoever sends it. The claims here
are sent as such bytes (not through the tests' REST client, which sends compact JSON with sorted keys), and
the agent still writes their status (by update, with the stored bytes), keeps another driver's entry, leaves
the stored bytes as they were, and removes its entries at unprepare.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from agent.claims.allocation import config_api_version
from agent.health.statusupdate import StoredRaw, decode_stored

from .clusterkit import DRIVER, ApiFailure, eventually
from .workloads import Namespace, NodeAgent, allocated, our_status, prepared

pytestmark = pytest.mark.cluster

OTHER = "other.example.com"  # another driver, whose device the claims also get (its slice made here)
API_VERSION = config_api_version(DRIVER)
# The same configuration, as a user's program may write it: keys in the order it likes, or with spaces
# (Python's json.dumps, the Kubernetes Python client's encoder, writes ", " and ": ").
PARAMETERS = {
    "unsorted": '{"kind":"DeviceConfig","env":{"ZETA":"1","ALPHA":"2"},"apiVersion":"' + API_VERSION + '"}',
    "spaces": json.dumps({"apiVersion": API_VERSION, "env": {"ALPHA": "2", "ZETA": "1"}, "kind": "DeviceConfig"}),
}
OTHER_DATA = '{"model": "x1", "firmware": "7"}'  # the other driver's entry's data, as it writes it
APPLY_REFUSED = "refuses every server-side apply"


def other_driver(ns: Namespace, node: str) -> str:
    """A DeviceClass of the other driver, and one device of it on `node` (made once)."""
    api = ns.cluster.admin
    with contextlib.suppress(ApiFailure):
        api.post("/apis/resource.k8s.io/v1/deviceclasses", {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": OTHER},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{OTHER}'"}}]}})
    with contextlib.suppress(ApiFailure):
        api.post("/apis/resource.k8s.io/v1/resourceslices", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{OTHER}-{node}"},
            "spec": {"driver": OTHER, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                  "resourceSliceCount": 1},
                     "devices": [{"name": "x"}]}})
    return OTHER


def claim_text(name: str, parameters: str) -> str:
    """A ResourceClaim for one GPU of ours and the other driver's device, with `parameters` as they are
    (the rest of it compact)."""
    head = json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                       "spec": {"devices": {"requests": [
                           {"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}},
                           {"name": "other", "exactly": {"deviceClassName": OTHER}}], "config": []}}},
                      separators=(",", ":"))
    config = '[{"requests":["gpu"],"opaque":{"driver":"' + DRIVER + '","parameters":' + parameters + "}}]"
    return head.replace('"config":[]', f'"config":{config}')


def other_entry_written(ns: Namespace, name: str, parameters: str, pool: str) -> None:
    """The other driver writes its entry by update, its data with spaces: the body is the claim as the
    API server answers it, with the parameters as stored (an update of other bytes is refused)."""
    api = ns.cluster.admin
    text = api.client.get(ns.path("resourceclaims", name)).text.rstrip()
    compact = json.dumps(json.loads(parameters), separators=(",", ":"))
    assert text.count(compact) == 2 and text.endswith("}}"), text  # spec and allocation; status last
    entry = '{"driver": "' + OTHER + '", "pool": "' + pool + '", "device": "x", "data": ' + OTHER_DATA + "}"
    body = text.replace(compact, parameters)[:-2] + f',"devices":[{entry}]}}}}'
    api.request("PUT", ns.path("resourceclaims", name) + "/status", body)


def stored(ns: Namespace, name: str) -> StoredRaw:
    """The claim's raw fields as the API server holds them: its protobuf answer carries them as stored."""
    r = ns.cluster.admin.client.get(ns.path("resourceclaims", name),
                                    headers={"Accept": "application/vnd.kubernetes.protobuf"})
    assert r.status_code == 200, r.text
    return decode_stored(r.content)


def stored_parameters(ns: Namespace, name: str) -> bytes:
    (params,) = stored(ns, name).parameters
    assert params is not None
    return params


def stored_data(ns: Namespace, name: str) -> dict[str, bytes | None]:
    """Driver -> the stored `data` of its entry."""
    entries = ns.get("resourceclaims", name)["status"].get("devices") or []
    return {e["driver"]: raw for e, raw in zip(entries, stored(ns, name).data, strict=True)}


def test_status_of_a_claim_with_parameter_keys_out_of_order(scheduled: NodeAgent, ns: Namespace) -> None:
    status_is_written(scheduled, ns, "unsorted")


def test_status_of_a_claim_with_spaces_in_its_parameters(scheduled: NodeAgent, ns: Namespace) -> None:
    status_is_written(scheduled, ns, "spaces")


def status_is_written(scheduled: NodeAgent, ns: Namespace, form: str) -> None:
    text = PARAMETERS[form]
    other_driver(ns, scheduled.node)
    ns.cluster.admin.post(ns.path("resourceclaims"), claim_text("gpu", text))
    ns.pod("gpu", scheduled.node, claims={"gpu": "gpu"})
    ns.scheduled("gpu")
    (claim,) = ns.claims_of("gpu").values()
    assert stored_parameters(ns, "gpu") == text.encode()
    # The API server's own view: an apply of a status entry is refused for either form (the agent's
    # first write meets this).
    entry = {"driver": DRIVER, "pool": scheduled.node, "device": "gpu-0"}
    apply = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "gpu", "namespace": ns.name}, "status": {"devices": [entry]}}
    r = ns.cluster.admin.client.patch(ns.path("resourceclaims", "gpu") + "/status",
                                      params={"fieldManager": "test", "force": "true"}, content=json.dumps(apply),
                                      headers={"Content-Type": "application/apply-patch+yaml"})
    assert r.status_code == 422 and "status.allocation" in r.text, r.text
    other_entry_written(ns, "gpu", text, scheduled.node)

    uid = claim["metadata"]["uid"]
    assert scheduled.proc is not None
    gave_up = scheduled.proc.metric('dra_agent_claim_status_writes_total{result="gave_up"}')
    assert prepared(scheduled.prepare(claim)[uid]) == allocated(claim)
    (result,) = allocated(claim)  # ours only

    def ours() -> list[dict[str, Any]] | None:
        found = our_status(ns.get("resourceclaims", "gpu"))
        return found if [(e["pool"], e["device"]) for e in found] == [result[1:3]] else None

    (written,) = eventually(ours, "the agent's status entry")
    assert [(c["type"], c["status"], c["reason"]) for c in written["conditions"]] == [("Ready", "True", "Prepared")]
    assert written["data"]["uuid"].startswith("GPU-")
    after = ns.get("resourceclaims", "gpu")
    others = [{k: v for k, v in e.items() if v is not None} for e in after["status"]["devices"]
              if e["driver"] != DRIVER]
    assert others == [{"driver": OTHER, "pool": scheduled.node, "device": "x", "data": json.loads(OTHER_DATA)}]
    assert stored_data(ns, "gpu")[OTHER] == OTHER_DATA.encode()  # its bytes, spaces and all
    assert stored_parameters(ns, "gpu") == text.encode()  # the claim's bytes are what the user sent
    assert after["status"]["allocation"] == claim["status"]["allocation"]
    warned = [m for m in scheduled.proc.messages("warning") if APPLY_REFUSED in m and uid in m]
    assert len(warned) == 1, warned

    # Unprepare removes ours (by update: this claim refuses applies), and only ours.
    assert scheduled.unprepare(claim)[uid].get("error", "") == ""
    eventually(lambda: not our_status(ns.get("resourceclaims", "gpu")), "the agent's entry removed")
    assert [e["driver"] for e in ns.get("resourceclaims", "gpu")["status"]["devices"]] == [OTHER]
    assert stored_data(ns, "gpu") == {OTHER: OTHER_DATA.encode()}
    assert stored_parameters(ns, "gpu") == text.encode()
    assert scheduled.proc.metric('dra_agent_claim_status_writes_total{result="gave_up"}') == gave_up
