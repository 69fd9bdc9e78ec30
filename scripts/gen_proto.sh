#!/usr/bin/env bash
# Regenerate the committed gRPC stubs in shared/pb/ from proto/specsplit/v1/verify.proto.
# The -I mapping names the file shared/pb/verify.proto inside protoc, so the generated
# verify_pb2_grpc.py imports `shared.pb.verify_pb2`; the wire names stay specsplit.v1.*.
# CI reruns this and fails on any diff (stubs drifted from the .proto).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
mkdir -p shared/pb
"$PY" -m grpc_tools.protoc -Ishared/pb=proto/specsplit/v1 --python_out=. --pyi_out=. --grpc_python_out=. \
  shared/pb/verify.proto
touch shared/pb/__init__.py
