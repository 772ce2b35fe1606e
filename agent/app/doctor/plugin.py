"""Doctor checks of the agent as the kubelet sees it: the kubelet's plugin directories, the
agent's own directories, its registration and DRA sockets, its probes, and the kubelet's pod resources
service the agent reads."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import grpc
import httpx2

from agent.app.doctor.base import Checks
from agent.app.doctor.results import Result, failed, passed, skipped
from agent.app.httpserver import DRIVER_HEADER, NODE_HEADER, POD_UID_HEADER, VERSION_HEADER
from agent.fsutil import UnsafeRoot, check_root
from agent.kube.podresources import PodResourcesClient, PodResourcesUnavailable
from agent.kubelet import client as kc


class PluginChecks(Checks):
    def kubelet_dirs(self) -> list[Result]:
        s = self.s
        name = "kubelet plugin directories"
        if not s.kubelet_dir.is_dir():
            return [failed(name, f"{s.kubelet_dir} does not exist",
                           "give --kubelet-dir / $DRA_KUBELET_DIR the kubelet's --root-dir (default "
                           "/var/lib/kubelet); in a pod, mount its plugins and plugins_registry from the host")]
        missing = [p for p in (s.kubelet_dir / "plugins", s.registry_dir) if not p.is_dir()]
        if missing:
            return [failed(name, f"missing: {', '.join(map(str, missing))}",
                           "the kubelet creates them when it starts: is the kubelet running with root directory "
                           f"{s.kubelet_dir}? In a pod, mount both from the host")]
        return [passed(name, f"{s.kubelet_dir / 'plugins'} and {s.registry_dir} exist")]

    def agent_dirs(self) -> list[Result]:
        """The roots the agent refuses to start on (`assembly.prepare_roots`)."""
        s = self.s
        roots = [("state directory", s.state_dir), ("records directory", s.claims_state_dir),
                 ("CDI directory", s.cdi_dir), ("plugin directory", s.plugin_dir),
                 ("metadata directory", s.metadata_dir), ("plugin registry directory", s.registry_dir)]
        problems = []
        for what, path in roots:
            if not os.path.lexists(path):
                continue  # the agent creates it
            try:
                check_root(path, what)
            except UnsafeRoot as exc:
                problems.append(str(exc))
            except OSError as exc:
                problems.append(f"{what} {path}: {exc.strerror or exc}")
        name = "directory ownership and modes"
        if not problems:
            return [passed(name, f"the agent's directories are owned by uid {os.geteuid()} and not writable by "
                           "group or others (those missing are created at start)")]
        if s.allow_unsafe_roots:
            return [failed(name, "; ".join(problems), "chown/chmod them (--allow-unsafe-roots starts anyway)",
                           blocking=False)]
        return [failed(name, "; ".join(problems), "chown them to the agent's user and chmod go-w (the agent "
                       "refuses to start otherwise; --allow-unsafe-roots overrides)")]

    async def registration(self) -> list[Result]:
        s = self.s
        name = "registration socket"
        path = s.registration_socket
        results = self._other_registrations()
        if not _is_socket(path):
            return [failed(name, f"no socket at {path}", "start the agent (dra-agent run, or its DaemonSet pod: "
                           "kubectl logs shows why it stopped); the kubelet finds plugins by this socket"),
                    *results]
        try:
            info = await kc.get_info(path)
        except grpc.aio.AioRpcError as exc:
            return [failed(name, f"GetInfo on {path}: {exc.code().name}: {exc.details()}",
                           "a socket that nobody answers is left by an agent that died: restart the agent"), *results]
        problems = []
        if info.name != s.driver_name:
            problems.append(f"it names driver {info.name!r}, not {s.driver_name!r}")
        if info.endpoint != str(s.dra_socket):
            problems.append(f"its endpoint is {info.endpoint}, not {s.dra_socket}")
        if problems:
            return [failed(name, f"GetInfo answered, but {'; '.join(problems)}",
                           "give doctor the agent's settings (--driver-name, --kubelet-dir, "
                           "--rolling-update-pod-uid)"), *results]
        return [passed(name, f"GetInfo answers: {info.name}, endpoint {info.endpoint}, "
                       f"{', '.join(info.supported_versions)}"), *results]

    def _other_registrations(self) -> list[Result]:
        """Registration sockets of this driver other than ours: a rolling update, or leftovers."""
        s = self.s
        try:
            names = sorted(os.listdir(s.registry_dir))
        except OSError:
            return []
        pattern = re.compile(re.escape(s.driver_name) + r"(-.+)?-reg\.sock")
        others = [s.registry_dir / n for n in names
                  if pattern.fullmatch(n) and s.registry_dir / n != s.registration_socket]
        if not others:
            return []
        return [passed("other registration sockets", f"{', '.join(map(str, others))}: another agent of this "
                       "driver (a rolling update with --rolling-update-pod-uid); the kubelet uses the newest")]

    async def dra_socket(self) -> list[Result]:
        s = self.s
        name = "DRA socket"
        path = s.dra_socket
        if not _is_socket(path):
            return [failed(name, f"no socket at {path}", "start the agent; it opens this socket before the "
                           "registration socket")]
        mode = stat.S_IMODE(os.stat(path).st_mode)
        try:
            await kc.empty_prepare(path, timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            return [failed(name, f"NodePrepareResources on {path}: {exc.code().name}: {exc.details()}",
                           "restart the agent; its log says what it was doing")]
        if mode & 0o077:
            return [failed(name, f"{path} has mode {mode:04o}: other users can call it", "restart the agent "
                           "(it binds its sockets 0600)", blocking=False)]
        return [passed(name, f"{path} answers NodePrepareResources (mode {mode:04o})")]

    async def probes(self) -> list[Result]:
        s = self.s
        name = "probes (/healthz, /readyz)"
        # The probes' own listener where the agent has one, else the metrics listener.
        flag, address = ("--probe-address", s.probe_address) if s.probe_address else ("--metrics-address",
                                                                                     s.metrics_address)
        endpoint = s.probe_endpoint or s.metrics_endpoint
        if endpoint is None:
            return [skipped(name, "--metrics-address and --probe-address are empty: the agent serves no probes")]
        host, port = endpoint
        host = host or "127.0.0.1"
        base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        if port == 0:
            return [skipped(name, f"{flag} {address}: the port is chosen at start (the agent logs it)")]
        answers = {}
        try:
            async with httpx2.AsyncClient(timeout=5.0, trust_env=False) as client:
                for path in ("/healthz", "/readyz"):
                    answers[path] = await client.get(base + path)
        except httpx2.HTTPError as exc:
            return [failed(name, f"{base}: {exc or type(exc).__name__}", "is the agent running, with this "
                           f"{flag}? (its first log lines say where it serves)", blocking=False)]
        if (stranger := self._stranger(base, answers["/healthz"])) is not None:
            return [stranger]
        bad = [line[3:] for r in answers.values() for line in r.text.splitlines() if line.startswith("[-]")]
        if bad:
            return [failed(name, "; ".join(bad), "see the failing checks: the kubelet registers the plugin when "
                           "it sees the registration socket; slices are published once the Node is read")]
        version = answers["/healthz"].headers.get(VERSION_HEADER, "?")
        return [passed(name, f"dra-agent {version}: " + "; ".join(
            line[3:] for r in answers.values() for line in r.text.splitlines()
            if line.startswith("[+]") and "event-loop" not in line))]


    def _stranger(self, base: str, answer: httpx2.Response) -> Result | None:
        """A failure when what answered is not the agent of these settings (its identity headers), else None."""
        s = self.s
        name = "probes (/healthz, /readyz)"
        driver, node = answer.headers.get(DRIVER_HEADER), answer.headers.get(NODE_HEADER)
        if driver is None or node is None:
            return failed(name, f"{base} answers, but does not name itself a dra-agent (no {DRIVER_HEADER} and "
                          f"{NODE_HEADER} headers)", "another program holds the port, so the kubelet's probes "
                          "reach it and not the agent: give doctor the agent's --metrics-address, or move one of them")
        if (driver, node) != (s.driver_name, s.node_name):
            return failed(name, f"{base} is the agent of driver {driver} on node {node}, not {s.node_name}"
                          if driver == s.driver_name else f"{base} is the agent of driver {driver} on node {node}, "
                          f"not of {s.driver_name}", "give doctor the agent's settings (--driver-name, --node-name, "
                          "--metrics-address)")
        pod = answer.headers.get(POD_UID_HEADER, "")
        if s.rolling_update_pod_uid and pod != s.rolling_update_pod_uid:
            return failed(name, f"{base} is answered by another agent of {driver} on {node} (pod {pod or 'unnamed'}, "
                          f"not {s.rolling_update_pod_uid})", "during a rolling update the agent being replaced "
                          "holds the port until it exits; else give doctor the agent's --rolling-update-pod-uid",
                          blocking=False)
        return None


    async def pod_resources(self) -> list[Result]:
        """The kubelet's pod resources service answers: garbage collection reads which claims pods here use."""
        s = self.s
        name = "kubelet pod resources"
        if s.offline is not None:
            return [skipped(name, f"offline (--offline {s.offline}): garbage collection reads the claim files")]
        kubelet = PodResourcesClient(s.pod_resources_socket, timeout=2.0)
        try:
            pods = await kubelet.list()
        except PodResourcesUnavailable as exc:
            return [failed(name, f"{exc}", "until it answers, garbage collection collects nothing (a claim whose "
                           "pod went without an unprepare stays prepared); the agent serves the kubelet all the same",
                           blocking=False)]
        finally:
            await kubelet.close()
        return [passed(name, f"{s.pod_resources_socket} answers: {len(pods.pods)} pods, "
                       f"{len(pods.claims_in_use())} claims in use (what garbage collection reads)")]


    def device_plugin(self) -> list[Result]:
        """What the running agent holds for a device plugin serving the GPUs (`agent.health.pluginholds`)."""
        from agent.health.pluginholds import KEY, SERVING, read_saved
        from agent.health.requests import health_dir

        s = self.s
        name = "device plugin"
        if not s.plugin_resources:
            return [skipped(name, "--device-plugin-resources is empty: no device plugin is looked for")]
        if s.offline is not None:
            return [skipped(name, f"offline (--offline {s.offline}): no Node and no kubelet to ask")]
        try:
            view = read_saved(health_dir(s))
        except FileNotFoundError:
            return [skipped(name, "the agent has saved no device plugin holds here (not running yet)")]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [failed(name, f"the saved holds are unreadable: {exc}", "the running agent writes them again at "
                           "its next change; restart it to write them now", blocking=False)]
        if not view.held:
            return [passed(name, f"no GPU held: no device plugin serves {view.names} here and no pod has a GPU "
                           "from one")]
        reasons = sorted({h.detail for h in view.held.values()})
        serving = any(h.reason == SERVING for h in view.held.values())
        detail = (f"{len(view.held)} GPUs held, published with taint {s.driver_name}/{KEY} (NoSchedule): "
                  + "; ".join(reasons) + (f"; the kubelet's pod resources service: {view.pods_error}"
                                          if view.pods_error else ""))
        fix = ("turn the device plugin off on this node (docs/migration.md): each GPU no device-plugin pod has comes "
               "free at once, the others when their pods end") if serving else (
               "they come free when the device plugin's pods on them end (docs/migration.md)")
        return [failed(name, detail, fix, blocking=False)]


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False

