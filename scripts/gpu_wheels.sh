#!/usr/bin/env bash
# Wheels of what the trainer path imports (rlorch.trainer.fsdp, rlorch.config.compose) beyond what
# the one-GPU machine of scripts/check_gpu.sh has (torch, transformers, safetensors, numpy, PyYAML, packaging are there):
# hydra-core, omegaconf, antlr4-python3-runtime (hydra's and omegaconf's parser), orjson
# (rlorch.jsonlines) and pysimdjson (rlorch.inference.scan, which the colocated check's orchestrator
# reads answers with), at the versions installed here, for that machine's CPython 3.12 on x86-64.
# They go into .gpu-wheels/ (git-ignored), which a device run names in `carry`;
# scripts/check_gpu_scale.sh installs them there.
# antlr4-python3-runtime 4.9.3 (omegaconf 2.3 pins 4.9.*) is published as a source archive
# only; it is pure Python, so it is built here into a py3-none-any wheel.
# Usage: bash scripts/gpu_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-wheels}
mkdir -p "$dir"
rm -f "$dir"/*.whl

version() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pins=()
for name in hydra-core omegaconf orjson pysimdjson; do pins+=("$name==$(version "$name")"); done

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "${pins[@]}"
python3 -m pip wheel -q --no-deps -w "$dir" "antlr4-python3-runtime==$(version antlr4-python3-runtime)"

ls -l "$dir"
du -sh "$dir"
