"""The registration socket as the kubelet sees it: its plugin manager's calls over grpc-go
(tests/gocheck/kubeletreg), gRPC's Python client, and the order in which the agent's sockets appear.
The agent serves registration with grpcio (agent/kubelet/registration.py), from messages generated
from proto/registration.proto."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from agentkit import DRIVER, REPO, roots
from gocheck import build

from agent.config import Settings
from agent.kubelet import client as kc
from agent.kubelet.registration import RegistrationServer
from agent.pb import registration_pb2

VERSIONS = ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]


@pytest.fixture(scope="module")
def kubeletreg() -> Path:
    return build.GOCHECK.for_test("kubeletreg")


@pytest.fixture
def settings(short_tmp: Path) -> Settings:
    return roots(short_tmp)


@pytest.fixture
async def server(settings: Settings) -> AsyncIterator[RegistrationServer]:
    started = RegistrationServer(settings)
    await started.start()
    yield started
    await started.stop()


def kubelet_calls(binary: Path, socket_path: Path, rounds: int,
                  rejection: str | None = None) -> list[dict[str, object]]:
    done = subprocess.run([str(binary), str(socket_path), str(rounds), *([rejection] if rejection else [])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


async def kubelet(binary: Path, socket_path: Path, rounds: int,
                  rejection: str | None = None) -> list[dict[str, object]]:
    """`kubelet_calls` off the event loop the server answers on."""
    return await asyncio.to_thread(kubelet_calls, binary, socket_path, rounds, rejection)


async def test_the_kubelets_client_gets_the_plugin_info_and_registers_it(kubeletreg: Path, settings: Settings,
                                                                         server: RegistrationServer) -> None:
    rounds = await kubelet(kubeletreg, settings.registration_socket, 3)  # three rounds on one connection
    assert rounds == [{"type": "DRAPlugin", "name": DRIVER, "endpoint": str(settings.dra_socket),
                       "supportedVersions": VERSIONS, "infoError": "", "notifyError": ""}] * 3
    assert server.state.registered is True and server.state.error == "" and server.state.info_calls == 3


async def test_a_rejection_is_recorded_with_its_reason(kubeletreg: Path, settings: Settings,
                                                       server: RegistrationServer) -> None:
    rounds = await kubelet(kubeletreg, settings.registration_socket, 1, "version v1.DRAPlugin is not supported ✗")
    assert rounds[0]["notifyError"] == ""
    assert server.state.registered is False and server.state.error == "version v1.DRAPlugin is not supported ✗"


async def test_get_info_without_the_health_stream_lists_only_dra(kubeletreg: Path, settings: Settings) -> None:
    server = RegistrationServer(settings, health=False)
    await server.start()
    try:
        (answer,) = await kubelet(kubeletreg, settings.registration_socket, 1)
        assert answer["supportedVersions"] == VERSIONS[:2]
    finally:
        await server.stop()


async def test_each_registration_is_told_to_the_agent_and_an_unknown_method_is_unimplemented(
        settings: Settings, server: RegistrationServer) -> None:
    told: list[bool] = []
    server.state.on_registered = lambda: told.append(True)
    async with kc.channel(settings.registration_socket) as ch:
        bogus = ch.unary_unary("/pluginregistration.Registration/Bogus")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await bogus(b"", timeout=10)
        assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
        notify = ch.unary_unary("/pluginregistration.Registration/NotifyRegistrationStatus",
                                request_serializer=registration_pb2.RegistrationStatus.SerializeToString,
                                response_deserializer=registration_pb2.RegistrationStatusResponse.FromString)
        for registered in (True, False, True):
            await notify(registration_pb2.RegistrationStatus(plugin_registered=registered), timeout=10)
    assert told == [True, True]  # a rejection tells nothing


async def test_a_replaced_socket_is_left_alone_and_a_removed_one_comes_back(kubeletreg: Path, settings: Settings,
                                                                             server: RegistrationServer) -> None:
    path = settings.registration_socket
    assert not await server.restore()  # nothing to do while the socket is there
    path.unlink()
    assert await server.restore()
    assert (await kubelet(kubeletreg, path, 1))[0]["endpoint"] == str(settings.dra_socket)
    assert server.state.registered is True
    # Another agent's socket in its place: neither restored over nor removed at stop.
    path.unlink()
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(path))
    try:
        assert not await server.restore()
        await server.stop()
        assert path.exists()
    finally:
        other.close()


def test_the_registration_socket_appears_only_once_the_dra_socket_it_names_answers(kubeletreg: Path,
                                                                                    short_tmp: Path) -> None:
    """`dra-agent run`: the kubelet calls the endpoint GetInfo names right after registering the plugin
    (NodeWatchResources, then the prepares of pods waiting for the driver). A DRA socket not there yet
    fails those calls, and the real kubelet 1.37 then left a pod whose prepare failed so unstarted for a
    minute (tests/cluster/test_cluster_kubelet.py). So from the moment the registration socket exists,
    its endpoint is there and answers."""
    s = roots(short_tmp)
    argv = [sys.executable, "-m", "agent", "run", "--nvml", "sim", "--node-name", s.node_name, "--driver-name",
            s.driver_name, "--offline", str(s.offline), "--kubelet-dir", str(s.kubelet_dir), "--cdi-dir",
            str(s.cdi_dir), "--static-cdi-dir", str(s.static_cdi_dir), "--state-dir", str(s.state_dir),
            "--metrics-address", ""]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not s.registration_socket.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.001)
        assert s.dra_socket.exists(), "the registration socket is there before the DRA socket it names"
        (answer,) = kubelet_calls(kubeletreg, s.registration_socket, 1)
        assert answer["endpoint"] == str(s.dra_socket)
        assert answer["notifyError"] == ""
        # The endpoint's first call succeeds (an empty NodePrepareResources, as a kubelet probes it).
        assert list(asyncio.run(kc.empty_prepare(s.dra_socket)).claims) == []
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "the kubelet registered the plugin" in err
    assert not s.registration_socket.exists() and not s.dra_socket.exists()
