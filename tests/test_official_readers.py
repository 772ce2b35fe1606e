"""What the agent writes for a prepared claim, read by code no one here wrote.

`make run`'s example claims (examples/seed.py) are prepared over the running agent's DRA socket,
as the kubelet prepares them; then the Go checker of tests/gocheck reads the CDI directories with
the CDI project's cache (what container runtimes use), injects each claim's CDI IDs from the
kubelet response into an OCI runtime spec, and reads each device metadata file with the reader of
k8s.io/dynamic-resource-allocation, in both API versions of the stream. This test holds what those
libraries report against what docs/claims.md ("What a prepared claim gets") and CONTRACT promise, per
device kind: the metadata file mounted at its contract path, each kind's device nodes and
environment, and the same devices and attributes (pciBusID, a NIC's networkData) as the kubelet
response and the published ResourceSlices.

Claims that cannot be prepared together (gpu-eight holds every GPU) are prepared in rounds: each
round prepares every remaining claim that the node can take beside the others of the round, is
checked, and is unprepared.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from agentkit import DRIVER, REPO, Quickstart, claim, make_node, nic, result, roots, write_claim
from conftest import need_root

from agent import quantity
from agent.claims import metadata
from agent.config import Settings
from agent.kubelet import client as kc
from agent.model import PCI_BUS_ID
from agent.names import ClaimRef

NODE = "node-gocheck"
V1BETA1, V1ALPHA1 = metadata.API_VERSIONS
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"
# Fields of the metadata file the upstream API types do not have (agent/claims/metadata.py says why).
AGENT_ADDITIONS = ("shareID", "consumedCapacity")
SHARE_UIDS = ("6a0f7c1e-0000-4000-8000-000000000001", "6a0f7c1e-0000-4000-8000-000000000002")
SHARE_IDS = ("6a0f7c1e-5a8e-4000-8000-00000000000a", "6a0f7c1e-5a8e-4000-8000-00000000000b")
VGPU_UID = "6a0f7c1e-0000-4000-8000-000000000003"
TOOLKIT_KIND = "nvidia.com/gpu"


@dataclass
class Seeded:
    """One example claim as seeded, and what preparing it returned."""

    path: Path
    obj: dict[str, Any]
    devices: list[Any] = field(default_factory=list)  # the kubelet response's devices

    @property
    def ref(self) -> ClaimRef:
        meta = self.obj["metadata"]
        return ClaimRef(meta["namespace"], meta["name"], meta["uid"])

    @property
    def uid(self) -> str:
        return str(self.obj["metadata"]["uid"])

    @property
    def pod_claim_name(self) -> str:
        return str((self.obj["metadata"].get("annotations") or {}).get(POD_CLAIM_NAME, ""))

    def cdi_ids(self) -> list[str]:
        return [i for d in self.devices for i in d.cdi_device_ids]

    def results(self) -> list[dict[str, Any]]:
        return list(self.obj["status"]["allocation"]["devices"]["results"])

    def config_env(self) -> dict[str, str]:
        """The extra variables the claim's opaque DeviceConfig gives its devices."""
        out: dict[str, str] = {}
        for entry in self.obj["status"]["allocation"]["devices"].get("config") or []:
            params = entry.get("opaque", {}).get("parameters", {})
            if params.get("kind") == "DeviceConfig":
                out.update(params.get("env") or {})
        return out


def published_devices(offline: Path) -> dict[str, dict[str, Any]]:
    """Every device of the node's pool in the offline ResourceSlices, by name, once the whole pool is
    there (as many slices of one generation as each says the pool has: publishing starts after the
    DRA socket opens)."""
    deadline = time.monotonic() + 60
    while True:
        slices = [yaml.safe_load(p.read_text()) for p in sorted((offline / "resourceslices").glob("*.yaml"))]
        pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices}
        if len(pools) == 1 and next(iter(pools))[1] == len(slices):
            return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}
        assert time.monotonic() < deadline, f"the pool was not published whole: {pools}"
        time.sleep(0.05)


def write_toolkit_spec(static_cdi_dir: Path, published: Mapping[str, Mapping[str, Any]]) -> None:
    """A stand-in for the NVIDIA Container Toolkit's spec in the static directory: one device per GPU,
    named by UUID, that sets a variable of its own (what the runtime injects from the static directory)."""
    gpus = sorted(attr(d, "uuid") for d in published.values() if attr(d, "type") == "gpu")
    static_cdi_dir.mkdir(parents=True, exist_ok=True)
    (static_cdi_dir / "nvidia.yaml").write_text(yaml.safe_dump({
        "cdiVersion": "0.3.0", "kind": TOOLKIT_KIND,
        "devices": [{"name": u, "containerEdits": {"env": [f"{toolkit_env(u)}=injected"]}} for u in gpus]}))


def toolkit_env(uuid: str) -> str:
    return "TOOLKIT_" + uuid.upper().replace("-", "_")


def run_checker(binary: Path, workdir: Path, cdi_dirs: list[Path], claims: Mapping[str, list[str]],
                files: list[Path]) -> dict[str, Any]:
    request = workdir / "gocheck-request.json"
    request.write_text(json.dumps({"cdiDirs": [str(d) for d in cdi_dirs], "claims": dict(claims),
                                   "metadataFiles": [str(f) for f in files]}))
    done = subprocess.run([str(binary), str(request)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def without_additions(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests of one of our objects without the fields the API types lack."""
    return [{**r, "devices": [{k: v for k, v in d.items() if k not in AGENT_ADDITIONS} for d in r["devices"]]}
            for r in requests]


def env_of(spec: Mapping[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in (spec.get("process") or {}).get("env") or [])


def prefix(device: str) -> str:
    return "DRA_" + device.upper().replace("-", "_")


def attr(dev: Mapping[str, Any], name: str) -> Any:
    """A published attribute's value, whatever its type."""
    value = dev.get("attributes", {}).get(name)
    return None if value is None else next(iter(value.values()))


class Checker:
    """The assertions for one round, over the checker's report."""

    def __init__(self, report: dict[str, Any], published: dict[str, dict[str, Any]], cdi_dir: Path,
                 metadata_dir: Path) -> None:
        self.report = report
        self.published = published
        self.metadata_dir = metadata_dir
        # Our own specs, for each device node's host path (the library fills in the numbers from it).
        self.host_paths: dict[str, str] = {}
        for f in cdi_dir.glob("*.json"):
            for dev in json.loads(f.read_bytes())["devices"]:
                for n in dev["containerEdits"].get("deviceNodes") or []:
                    self.host_paths[n["path"]] = n.get("hostPath", n["path"])

    def specs_load(self, cdi_dir: Path) -> None:
        cdi = self.report["cdi"]
        assert cdi["specErrors"] == {} and cdi["dirErrors"] == {}, cdi
        ours = {str(f) for f in cdi_dir.iterdir()}
        assert {p for p in cdi["specs"] if Path(p).parent == cdi_dir} == ours, "a spec file the CDI cache did not load"
        for path, spec in cdi["specs"].items():
            # CONTRACT 7: the lowest cdiVersion the fields need, and at most what podman 4 / containerd 1.7 take.
            assert spec["version"] == spec["minimumVersion"], (path, spec)
            assert tuple(map(int, spec["version"].split("."))) <= (0, 5, 0), (path, spec)

    def claim(self, seeded: Seeded) -> None:
        injected = self.report["cdi"]["claims"][seeded.uid]
        assert injected["error"] == "" and not injected["unresolved"], (seeded.ref, injected)
        spec = injected["spec"]
        env = env_of(spec)
        nodes = {d["path"]: d for d in (spec.get("linux") or {}).get("devices") or []}
        mounts = {m["destination"]: m for m in spec.get("mounts") or []}
        by_request: dict[str, list[Any]] = {}
        for d in seeded.devices:
            by_request.setdefault(d.request_names[0], []).append(d)
        for request, devices in by_request.items():
            # CONTRACT 6: the metadata device's ID comes with the first device of its request.
            assert f"{DRIVER}/metadata={seeded.uid}_{request}" in devices[0].cdi_device_ids, (seeded.ref, request)
            self.metadata_file(seeded, request, devices, mounts)
        for d in seeded.devices:
            self.device(seeded, d, env, nodes)
        for key, value in seeded.config_env().items():
            assert env.get(key) == value, (seeded.ref, key)
        # Every node the spec gives is the host's node, with its numbers.
        for path, node in nodes.items():
            st = os.stat(self.host_paths[path])
            assert (node["type"], node["major"], node["minor"]) == ("c", os.major(st.st_rdev), os.minor(st.st_rdev))

    def device(self, seeded: Seeded, answered: Any, env: dict[str, str], nodes: Mapping[str, Any]) -> None:
        """docs/claims.md: each kind's device nodes and variables."""
        name = answered.device_name
        dev = self.published[name]
        kind, p = attr(dev, "type"), prefix(name)
        where = f"{seeded.ref.name}: {name}"
        assert env[f"{p}_NAME"] == name, where
        if (bus := attr(dev, PCI_BUS_ID)) is not None:
            assert env[f"{p}_PCI_BUS_ID"] == bus, where
        ctl = {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
        if kind in ("gpu", "shared"):  # docs/claims.md: the toolkit's own device ID too, where its spec defines the GPU
            assert f"{TOOLKIT_KIND}={attr(dev, 'uuid')}" in answered.cdi_device_ids, where
            assert env[toolkit_env(attr(dev, "uuid"))] == "injected", where
        if kind == "gpu":
            assert env[f"{p}_UUID"] == attr(dev, "uuid"), where
            assert {f"/dev/nvidia{attr(dev, 'minor')}", *ctl} <= set(nodes), (where, sorted(nodes))
        elif kind == "mig":
            parent = next(d for d in self.published.values()
                          if attr(d, "type") == "gpu" and attr(d, "uuid") == attr(dev, "parentUUID"))
            assert env[f"{p}_UUID"].startswith("MIG-"), where
            assert {f"/dev/nvidia{attr(parent, 'minor')}", *ctl} <= set(nodes), (where, sorted(nodes))
            caps = [n for n in nodes if n.startswith("/dev/nvidia-caps/nvidia-cap")]
            assert len(caps) >= 2, (where, sorted(nodes))  # the GPU instance's and the compute instance's
        elif kind == "nic":
            assert env[f"{p}_INTERFACE"] == attr(dev, "ifName"), where
            assert env[f"{p}_MAC"] == attr(dev, "macAddress"), where
        elif kind == "shared":  # docs/partitions.md "Shared GPUs": the GPU's nodes, its UUID, the share and its limit
            result = next(r for r in seeded.results() if r["device"] == name)
            limit = quantity.parse_int(result["consumedCapacity"]["memory"])
            assert {f"/dev/nvidia{attr(dev, 'minor')}", *ctl} <= set(nodes), (where, sorted(nodes))
            assert env[f"{p}_UUID"] == attr(dev, "uuid"), where
            assert env[f"{p}_SHARE_ID"] == result["shareID"], where
            assert env[f"{p}_MEMORY_LIMIT"] == str(limit), where
            ordinal = env["CUDA_VISIBLE_DEVICES"].split(",").index(str(attr(dev, "uuid")))
            assert f"{ordinal}={limit >> 20}M" in env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split(","), where
        elif kind == "vfio":
            group = attr(dev, "iommuGroup")
            assert {"/dev/vfio/vfio", f"/dev/vfio/{group}"} <= set(nodes), (where, sorted(nodes))
            assert not [n for n in nodes if n.startswith("/dev/nvidia")], (where, sorted(nodes))
        elif kind == "vgpu":  # the mdev's own IOMMU group, and nothing of the GPU's
            groups = [n for n in nodes if re.fullmatch(r"/dev/vfio/[0-9]+", n)]
            assert "/dev/vfio/vfio" in nodes and len(groups) == 1, (where, sorted(nodes))
            assert not [n for n in nodes if n.startswith("/dev/nvidia")], (where, sorted(nodes))
        else:
            raise AssertionError(f"{where}: no expectations for device type {kind!r}")

    def metadata_file(self, seeded: Seeded, request: str, devices: list[Any], mounts: Mapping[str, Any]) -> None:
        host = metadata.host_file(self.metadata_dir, seeded.uid, request)
        info = self.report["metadata"][str(host)]
        where = f"{seeded.ref.name}/{request}"
        assert info["error"] == "", (where, info["error"])
        # The contract's path (CONTRACT 6) is the library's, and the injected spec mounts the file there.
        official = info["resourceClaimTemplatePath"] if seeded.pod_claim_name else info["resourceClaimPath"]
        assert official == metadata.container_file(DRIVER, seeded.ref.name, request, seeded.pod_claim_name)
        assert official in mounts, (where, sorted(mounts))
        mount = mounts[official]
        assert mount["source"] == str(host) and {"ro", "bind"} <= set(mount["options"]), (where, mount)

        raw = metadata.parse_stream(host.read_bytes())
        objects = info["objects"]
        assert [o["source"] for o in objects] == [V1BETA1, V1ALPHA1], where
        # Strict decoding finds no field the API types lack but the agent's documented additions.
        for error in info["strictErrors"]:
            unknown = re.findall(r'unknown field "(?:[^"]*\.)?([^".]+)"', error)
            assert len(unknown) == error.count("unknown field") and set(unknown) <= set(AGENT_ADDITIONS), (
                where, error)
        for obj, ours in zip(objects, raw, strict=True):
            assert obj["errors"] == {} and obj["validation"] == {}, (where, obj["errors"], obj["validation"])
            for version in (V1BETA1, V1ALPHA1):
                decoded = obj["as"][version]
                assert decoded["apiVersion"] == version and decoded["kind"] == "DeviceMetadata", where
                # What the library decoded is what the file says, field for field.
                meta = {k: decoded["metadata"].get(k) for k in ("name", "namespace", "uid", "generation")}
                assert meta == ours["metadata"], where
                assert decoded.get("podClaimName") == ours.get("podClaimName"), where
                assert decoded["requests"] == without_additions(ours["requests"]), where
        self.devices_match(seeded, request, devices, objects[-1]["as"][V1ALPHA1])

    def devices_match(self, seeded: Seeded, request: str, devices: list[Any], decoded: Mapping[str, Any]) -> None:
        """The decoded devices are the response's, with every published attribute and a NIC's network data."""
        where = f"{seeded.ref.name}/{request}"
        found = [(r["name"], d) for r in decoded["requests"] for d in r["devices"]]
        assert all(name.split("/")[0] == request for name, _ in found), where
        assert sorted((d["pool"], d["name"]) for _, d in found) == sorted(
            (d.pool_name, d.device_name) for d in devices), where
        results = {r["device"]: r for r in seeded.results()}
        for name, dev in found:
            assert name == results[dev["name"]]["request"], where  # `gpu/h100` for a subrequest
            assert dev["driver"] == DRIVER, where
            published = self.published[dev["name"]]
            missing = {k: v for k, v in published.get("attributes", {}).items() if dev["attributes"].get(k) != v}
            assert not missing, (where, dev["name"], missing)
            kind = attr(published, "type")
            if kind == "mig":  # docs/partitions.md: the metadata's `uuid` is the MIG device's
                assert dev["attributes"]["uuid"]["string"].startswith("MIG-"), where
            if kind == "vgpu":  # docs/partitions.md: the mdev's UUID, which KubeVirt reads before pciBusID
                assert re.fullmatch(r"[0-9a-f-]{36}", dev["attributes"]["mdevUUID"]["string"]), where
            net = dev.get("networkData")
            if kind == "nic":
                assert net is not None, where
                assert net["interfaceName"] == attr(published, "ifName"), where
                assert net["hardwareAddress"] == attr(published, "macAddress"), where
                ips = [attr(published, k) for k in ("ipv4", "ipv6") if attr(published, k) is not None]
                assert sorted(net.get("ips") or []) == sorted(ips), where
            elif kind == "vfio" and attr(published, "nativeType") == "nic":
                mac = next((c["opaque"]["parameters"].get("mac") for c in
                            seeded.obj["status"]["allocation"]["devices"].get("config") or []), None)
                assert net == {"hardwareAddress": mac or attr(published, "macAddress")}, where
            else:
                assert net is None, where


async def prepare_in_rounds(quick: Quickstart, settings: Settings, claims: list[Seeded], checker: Path) -> set[str]:
    """Prepare every claim over the running agent's DRA socket, in as few rounds as the node allows; check
    each round with the official libraries, then unprepare it. The device types that were checked."""
    assert settings.offline is not None
    kinds: set[str] = set()
    async with kc.DRAClient(settings.dra_socket) as client:
        remaining = list(claims)
        while remaining:
            # The devices as published before the round and after its prepares: a MIG device's GPU in MIG mode is
            # no longer published whole once the round made its instance (the GPUs are rescanned after it).
            published = published_devices(settings.offline)
            prepared, errors = [], {}
            for claim in remaining:
                entry = (await client.prepare([claim.ref])).claims[claim.uid]
                if entry.error:
                    errors[claim.ref.name] = entry.error
                else:
                    claim.devices = list(entry.devices)
                    prepared.append(claim)
            assert prepared, f"claims that cannot be prepared even alone: {errors}"
            try:
                published |= published_devices(settings.offline)
                files = sorted(settings.metadata_dir.rglob("metadata.json"))
                report = run_checker(checker, quick.root, [settings.static_cdi_dir, settings.cdi_dir],
                                     {c.uid: c.cdi_ids() for c in prepared}, files)
                check = Checker(report, published, settings.cdi_dir, settings.metadata_dir)
                check.specs_load(settings.cdi_dir)
                assert set(report["metadata"]) == {str(f) for f in files}
                for claim in prepared:
                    check.claim(claim)
                    kinds.update(attr(published[d.device_name], "type") for d in claim.devices)
                # One container given every claim of the round: the edits do not conflict.
                together = report["cdi"]["all"]
                assert together["error"] == "", together["error"]
            finally:
                reply = await client.unprepare([c.ref for c in prepared])
                assert all(e.error == "" for e in reply.claims.values()), reply
            remaining = [c for c in remaining if all(c is not p for p in prepared)]
    return kinds


async def test_official_libraries_read_what_every_example_claim_gets(short_tmp: Path, checker: Path) -> None:
    need_root()  # the simulated machine's device nodes (mknod), which the CDI library stats
    quick = Quickstart.seeded(short_tmp, NODE)
    settings = roots(short_tmp, node_name=NODE)
    assert settings.offline is not None
    examples = sorted((REPO / "examples" / "resourceclaims").rglob("*.yaml"))
    files = sorted((settings.offline / "resourceclaims").rglob("*.yaml"))
    seeded = [Seeded(p, yaml.safe_load(p.read_text())) for p in files]
    # Every example is seeded on the simulated machine (the NIC one with the first NIC this host publishes).
    assert [s.path.name for s in seeded] == [p.name for p in examples]
    with quick.agent():
        write_toolkit_spec(settings.static_cdi_dir, published_devices(settings.offline))
        kinds = await prepare_in_rounds(quick, settings, seeded, checker)
    assert kinds >= {"gpu", "mig", "nic", "vfio"}


async def test_official_libraries_read_shares_and_vgpus(short_tmp: Path, checker: Path) -> None:
    """The GPU forms no example claims: two shares of one GPU (`--gpu-sharing`) and a vGPU (`--vgpu-types`,
    on GPUs without MIG placements)."""
    need_root()
    quick = Quickstart.seeded(short_tmp, NODE)
    quick.env.update({"DRA_GPU_SHARING": "true", "DRA_VGPU_TYPES": "nvidia-1022", "DRA_DYNAMIC_MIG": "false"})
    settings = roots(short_tmp, node_name=NODE)
    assert settings.offline is not None
    with quick.agent():
        published = published_devices(settings.offline)
        write_toolkit_spec(settings.static_cdi_dir, published)
        # On another GPU than the shares: all three are prepared, and injected into one container, together.
        shared = attr(published["gpu-0-shared"], "uuid")
        vgpu = next(name for name, d in sorted(published.items())
                    if attr(d, "type") == "vgpu" and attr(d, "parentUUID") != shared)
        claims = [
            claim("share-a", SHARE_UIDS[0], [result("gpu-0-shared", "gpu", pool=NODE, shareID=SHARE_IDS[0],
                                                    consumedCapacity={"memory": "4Gi"})]),
            claim("share-b", SHARE_UIDS[1], [result("gpu-0-shared", "gpu", pool=NODE, shareID=SHARE_IDS[1],
                                                    consumedCapacity={"memory": "10Gi"})],
                  annotations={POD_CLAIM_NAME: "mps"}),
            claim("vgpu-one", VGPU_UID, [result(vgpu, "vgpu", pool=NODE)]),
        ]
        seeded = [Seeded(write_claim(settings.offline / "resourceclaims", obj), obj) for obj in claims]
        kinds = await prepare_in_rounds(quick, settings, seeded, checker)
    assert kinds == {"shared", "vgpu"}


async def test_the_metadata_of_a_nic_with_many_addresses_passes_the_official_validation(
        tmp_path: Path, checker: Path) -> None:
    """The API type holds at most 16 IPs in a device's networkData: a NIC with more gets the first 16 in
    its metadata file, as in its claim status, so a reader that validates the file accepts it."""
    ips = [f"10.0.{i}.5/24" for i in range(20)] + ["2001:db8::5/64"]
    node = await make_node(tmp_path, nics=[nic(ips=ips)])
    uid = "6a0f7c1e-0000-4000-8000-000000000004"
    write_claim(node.claims_dir, claim("nic-many", uid, [result("nic-0000-3b-00-0", "nic")]))
    out = await node.engine.prepare([ClaimRef("default", "nic-many", uid)])
    assert out[uid].error == "", out[uid].error
    host = metadata.host_file(node.settings.metadata_dir, uid, "nic")
    ids = [i for d in out[uid].devices for i in d.cdi_device_ids]
    report = run_checker(checker, tmp_path, [node.settings.cdi_dir], {uid: ids}, [host])
    info = report["metadata"][str(host)]
    assert [o["source"] for o in info["objects"]] == [V1BETA1, V1ALPHA1]
    for obj in info["objects"]:
        assert obj["errors"] == {} and obj["validation"] == {}, (obj["errors"], obj["validation"])
        for version in (V1BETA1, V1ALPHA1):
            (request,) = obj["as"][version]["requests"]
            (device,) = request["devices"]
            assert device["networkData"] == {"interfaceName": "ens1f0", "ips": ips[:16],
                                             "hardwareAddress": "02:00:00:00:00:01"}
