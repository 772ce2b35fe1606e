"""The registration socket as the kubelet sees it: its plugin manager's calls over grpc-go
(tests/gocheck/kubeletreg), gRPC's C core (the Python client), and clients that misbehave.

The agent serves registration without gRPC (agent/kubelet/registration.py, h2server.py, hpack.py),
so that GetInfo is answered before gRPC is even imported; these tests hold that server to the
clients the kubelet and the tools use, and to RFC 7541's own examples for its header decoding.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from agentkit import DRIVER, REPO, roots
from gocheck import build

from agent.config import Settings
from agent.kubelet import client as kc
from agent.kubelet import hpack
from agent.kubelet.registration import RegistrationServer
from agent.pb import registration_pb2

VERSIONS = ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]


@pytest.fixture(scope="module")
def kubeletreg() -> Path:
    try:
        return build.binary("kubeletreg")
    except build.GoMissing as e:
        pytest.skip(str(e))
    except build.BuildFailed as e:
        pytest.fail(str(e))


@pytest.fixture
def settings(short_tmp: Path) -> Settings:
    return roots(short_tmp)


@pytest.fixture
def server(settings: Settings) -> Iterator[RegistrationServer]:
    started = RegistrationServer(settings)
    started.start()
    yield started
    started.stop()


def kubelet_calls(binary: Path, socket_path: Path, rounds: int,
                  rejection: str | None = None) -> list[dict[str, object]]:
    done = subprocess.run([str(binary), str(socket_path), str(rounds), *([rejection] if rejection else [])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_the_kubelets_client_gets_the_plugin_info_and_registers_it(kubeletreg: Path, settings: Settings,
                                                                   server: RegistrationServer) -> None:
    # Three rounds on one connection: from the second on, grpc-go's header encoder refers to the
    # entries its first request added to HPACK's dynamic table.
    rounds = kubelet_calls(kubeletreg, settings.registration_socket, 3)
    assert rounds == [{"type": "DRAPlugin", "name": DRIVER, "endpoint": str(settings.dra_socket),
                       "supportedVersions": VERSIONS, "infoError": "", "notifyError": ""}] * 3
    assert server.state.registered is True and server.state.error == "" and server.state.info_calls == 3


def test_a_rejection_is_recorded_with_its_reason(kubeletreg: Path, settings: Settings,
                                                 server: RegistrationServer) -> None:
    rounds = kubelet_calls(kubeletreg, settings.registration_socket, 1, "version v1.DRAPlugin is not supported ✗")
    assert rounds[0]["notifyError"] == ""
    assert server.state.registered is False and server.state.error == "version v1.DRAPlugin is not supported ✗"


def test_get_info_without_the_health_stream_lists_only_dra(kubeletreg: Path, settings: Settings) -> None:
    server = RegistrationServer(settings, health=False)
    server.start()
    try:
        (answer,) = kubelet_calls(kubeletreg, settings.registration_socket, 1)
        assert answer["supportedVersions"] == VERSIONS[:2]
    finally:
        server.stop()


async def test_many_calls_on_one_connection_never_run_out_of_flow_control_credit(
        settings: Settings, server: RegistrationServer) -> None:
    # 2,000 notifications of 200 bytes are six times the 64 KiB the client may send before the
    # server gives credit back: a server that never did would leave the calls hanging.
    message = "x" * 200
    async with kc.channel(settings.registration_socket) as ch:
        notify = ch.unary_unary("/pluginregistration.Registration/NotifyRegistrationStatus",
                                request_serializer=registration_pb2.RegistrationStatus.SerializeToString,
                                response_deserializer=registration_pb2.RegistrationStatusResponse.FromString)
        for i in range(2000):
            await notify(registration_pb2.RegistrationStatus(plugin_registered=False, error=f"{i} {message}"),
                         timeout=10)
    assert server.state.error == f"1999 {message}"


async def test_an_unknown_method_is_unimplemented_and_the_connection_goes_on(
        settings: Settings, server: RegistrationServer) -> None:
    async with kc.channel(settings.registration_socket) as ch:
        bogus = ch.unary_unary("/pluginregistration.Registration/Bogus")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await bogus(b"", timeout=10)
        assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/pluginregistration.Registration/Bogus" in (failed.value.details() or "")
        info = await ch.unary_unary("/pluginregistration.Registration/GetInfo",
                                    response_deserializer=registration_pb2.PluginInfo.FromString)(b"", timeout=10)
        assert list(info.supported_versions) == VERSIONS


def _h2_request(path: bytes, message: bytes, *, compressed: bool = False) -> bytes:
    """A client preface, an empty SETTINGS and one unary call on stream 1, headers as plain literals."""
    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload

    block = b"".join(hpack.encode_literal(n, v) for n, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b"content-type", b"application/grpc")))
    body = bytes([1 if compressed else 0]) + struct.pack(">I", len(message)) + message
    return (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 0x4, 1, block)
            + frame(0, 0x1, 1, body))


def _read_frames(sock: socket.socket) -> list[tuple[int, int, int, bytes]]:
    """Frames until the server ends stream 1 or closes the connection."""
    data, frames = b"", []
    sock.settimeout(10)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return frames
        data += chunk
        while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
            length = int.from_bytes(data[:3], "big")
            frames.append((data[3], data[4], int.from_bytes(data[5:9], "big"), data[9:9 + length]))
            data = data[9 + length:]
            if frames[-1][2] == 1 and frames[-1][1] & 0x1 and frames[-1][0] in (0, 1):
                return frames


def test_a_compressed_message_is_refused_and_garbage_closes_only_its_connection(
        settings: Settings, server: RegistrationServer) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(settings.registration_socket))
        sock.sendall(_h2_request(b"/pluginregistration.Registration/GetInfo", b"", compressed=True))
        frames = _read_frames(sock)
    headers = hpack.Decoder().decode(frames[-1][3])
    assert frames[-1][0] == 1 and (b"grpc-status", b"12") in headers  # UNIMPLEMENTED, trailers only
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(settings.registration_socket))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(65536)  # the server's SETTINGS; then the connection is closed
        while sock.recv(65536):
            pass
    with socket.socket(socket.AF_UNIX) as sock:  # and the server goes on
        sock.connect(str(settings.registration_socket))
        sock.sendall(_h2_request(b"/pluginregistration.Registration/GetInfo", b""))
        frames = _read_frames(sock)
    data = next(payload for kind, _, stream, payload in frames if kind == 0 and stream == 1)
    assert registration_pb2.PluginInfo.FromString(data[5:]).name == DRIVER


def test_a_replaced_socket_is_left_alone_and_a_removed_one_comes_back(kubeletreg: Path, settings: Settings,
                                                                       server: RegistrationServer) -> None:
    path = settings.registration_socket
    assert not server.restore()  # nothing to do while the socket is there
    path.unlink()
    assert server.restore()
    assert kubelet_calls(kubeletreg, path, 1)[0]["endpoint"] == str(settings.dra_socket)
    assert server.state.registered is True
    # Another agent's socket in its place: neither restored over nor removed at stop.
    path.unlink()
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(path))
    try:
        assert not server.restore()
        server.stop()
        assert path.exists()
    finally:
        other.close()


def test_rfc7541_request_examples_with_huffman_coding() -> None:
    """RFC 7541 C.4: three requests on one connection, the dynamic table growing to 57, 110 and 164."""
    decoder = hpack.Decoder()
    first = decoder.decode(bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff"))
    assert first == [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
                     (b":authority", b"www.example.com")]
    assert decoder.size == 57
    second = decoder.decode(bytes.fromhex("828684be5886a8eb10649cbf"))
    assert second == [*first, (b"cache-control", b"no-cache")] and decoder.size == 110
    third = decoder.decode(bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"))
    assert third == [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/index.html"),
                     (b":authority", b"www.example.com"), (b"custom-key", b"custom-value")]
    assert decoder.size == 164
    with pytest.raises(hpack.HpackError):
        hpack.huffman_decode(b"\xff\xff\xff\xff")  # EOS inside a string
    with pytest.raises(hpack.HpackError):
        decoder.decode(b"\xff\x00")  # an index past both tables


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
