#!/usr/bin/env bash
# Fails if a program loads both SentencePiece (which bundles protobuf-lite 3.14) and the system
# libprotobuf (3.21, used by ONNX): such a process aborts at start-up. See cmake/dependencies.cmake.
set -euo pipefail
status=0
for exe in "$@"; do
  needed=$(readelf -d "$exe" | grep NEEDED || true)
  if grep -q libsentencepiece <<<"$needed" && grep -q libprotobuf <<<"$needed"; then
    echo "FAIL: $exe needs both libsentencepiece and libprotobuf"
    status=1
  else
    echo "ok: $(basename "$exe")"
  fi
done
exit $status
