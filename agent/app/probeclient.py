"""The kubelet's exec probe: `python3 -m agent.app.probeclient live|ready SOCKET`.

Asks the agent's probe socket (`--probe-socket`, served by `agent.app.httpserver.SocketServer`) for
`/healthz` (live) or `/readyz` (ready), prints the answer's `[+]`/`[-]` lines (the kubelet keeps a failed
probe's output in the pod's events) and exits 0 when the agent answered 200, 1 otherwise, 2 on a usage
error. A unix socket in the pod's own directory: no connection to the node's ports, which any pod may
fill, comes between the kubelet and the agent (docs/metrics.md, "Endpoints and probes").

The kubelet starts it every few seconds, so it imports nothing of the agent and nothing of the standard
library beyond sockets: a process start is most of its cost (docs/metrics.md gives the figures).
"""

import socket
import sys
import time

PATHS = {"live": "/healthz", "ready": "/readyz"}
# Under the DaemonSet's timeoutSeconds (5), so that a slow agent is reported in our words, not the
# kubelet's; /healthz itself waits at most 2 s for each gRPC server (`agent.app.probes.PROBE_TIMEOUT`).
TIMEOUT = 4.0
MAX_ANSWER = 1 << 20
USAGE = "usage: python3 -m agent.app.probeclient live|ready SOCKET"


class ProbeFailed(Exception):
    """No answer from the agent on its probe socket (nothing listens, or it did not answer in time)."""


def ask(path: str, what: str, timeout: float = TIMEOUT) -> tuple[int, str]:
    """(HTTP status, body) of `/healthz` (`live`) or `/readyz` (`ready`) on the unix socket at `path`."""
    deadline = time.monotonic() + timeout
    answer = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(f"GET {PATHS[what]} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
            # The agent answers one request per connection and closes it: the answer is all there is.
            while len(answer) <= MAX_ANSWER:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
    except OSError as exc:  # also a timeout
        raise ProbeFailed(f"{path}: {exc.strerror or exc or type(exc).__name__}") from exc
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split(b" ")
    if len(status_line) < 2 or not status_line[1].isdigit():
        raise ProbeFailed(f"{path}: not an HTTP answer: {answer[:80]!r}")
    return int(status_line[1]), body.decode("utf-8", "replace")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in PATHS:
        print(USAGE, file=sys.stderr)
        return 2
    what, path = argv
    try:
        status, body = ask(path, what)
    except ProbeFailed as exc:
        print(f"{what}: no answer from the agent on {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(body)
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
