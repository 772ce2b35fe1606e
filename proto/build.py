"""Generate the Python gRPC modules for the .proto files in this directory.

Used by `make` (into the source tree) and by the package build (into the
wheel), so an installed `dra-agent` always carries code made from these files.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE = "agent/pb"
PROTOS = (
    "registration.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "health_v1.proto",
    "health_v1alpha1.proto",
    "podresources_v1.proto",  # the kubelet's pod resources service, which the agent calls
    "k8s_claim.proto",  # not gRPC: a ResourceClaim's protobuf encoding, in part (agent/health/statusupdate.py)
)


def generate(out_root: Path) -> list[Path]:
    """Write `agent/pb/*_pb2*.py` under `out_root`; return the files written."""
    from grpc_tools import protoc

    out = Path(out_root)
    target = out / PACKAGE
    target.mkdir(parents=True, exist_ok=True)
    include = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={include}",
        # A virtual path, so the generated modules import each other as agent.pb.*.
        f"--proto_path={PACKAGE}={PROTO_DIR}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(f"{PACKAGE}/{name}" for name in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    init = target / "__init__.py"
    init.write_text('"""Generated gRPC modules (see proto/build.py)."""\n')
    return sorted(target.glob("*.py*"))


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR.parent
    for path in generate(root):
        print(path.relative_to(root))
