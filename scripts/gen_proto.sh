#!/usr/bin/env bash
# Regenerates adapterserve/proto/adapterserve_pb2*.py from adapterserve/proto/adapterserve.proto.
#
# grpcio-tools is pinned to 1.66.2 and runs in a throwaway venv: its generated code
# needs protobuf >= 5.27.2 and grpcio >= 1.66.2 at run time, so the checked-in
# modules import under every protobuf/grpcio that ray[serve] and grpcio 1.84 accept.
set -euo pipefail
cd "$(dirname "$0")/.."
GRPC_TOOLS_VERSION=1.66.2
VENV="${TMPDIR:-/tmp}/adapterserve-protoc-${GRPC_TOOLS_VERSION}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "grpcio-tools==${GRPC_TOOLS_VERSION}"
fi
# -I . keeps the package path in the generated imports (adapterserve.proto.adapterserve_pb2).
"$VENV/bin/python" -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  adapterserve/proto/adapterserve.proto
echo "generated: $(ls adapterserve/proto/adapterserve_pb2*)"
