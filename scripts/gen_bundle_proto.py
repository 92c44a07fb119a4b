"""Regenerate ``memaudit/federated/flower/transport/bundle_pb2.py`` from ``bundle.proto``.

Flower ships its protobuf modules, not its ``.proto`` files, so protoc is given Flower's
descriptors (from the installed flwr, the pinned 1.42.0) as a descriptor set. protoc comes from
grpcio-tools 1.70.0, whose generated code (protobuf 5.29.0, as Flower 1.42's own) loads with every
protobuf runtime Flower 1.42 allows; it is needed only to regenerate, not to run or test:

    pip install --target /tmp/gt grpcio-tools==1.70.0 --no-deps
    PYTHONPATH=/tmp/gt python scripts/gen_bundle_proto.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = "memaudit/federated/flower/transport/bundle.proto"


def flower_descriptors() -> bytes:
    """A ``FileDescriptorSet`` of Flower's fleet.proto and node.proto with their dependencies."""
    from flwr.proto import fleet_pb2, node_pb2
    from google.protobuf import descriptor_pb2

    out, seen = descriptor_pb2.FileDescriptorSet(), set()

    def add(fd) -> None:
        if fd.name in seen:
            return
        for dep in fd.dependencies:
            add(dep)
        seen.add(fd.name)
        fd.CopyToProto(out.file.add())

    add(fleet_pb2.DESCRIPTOR)
    add(node_pb2.DESCRIPTOR)
    return out.SerializeToString()


def main() -> int:
    with tempfile.NamedTemporaryFile(suffix=".pb") as f:
        f.write(flower_descriptors())
        f.flush()
        return subprocess.call([sys.executable, "-m", "grpc_tools.protoc", f"--descriptor_set_in={f.name}",
                                "-I.", "--python_out=.", PROTO], cwd=ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
