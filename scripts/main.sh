#!/usr/bin/env bash
# The main job on its built-in default: set-up, build, then run. Today it runs the core smoke
# example (a transformer block trained through our autograd); it grows into the full pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
./build/tools/bert-smoke "$@"
