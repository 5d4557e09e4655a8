#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index: the Python packages that
# scripts/gpu_check.sh needs beyond what a CUDA PyTorch image usually holds (torch, triton,
# transformers, safetensors, tokenizers, pyyaml, tqdm, numpy, matplotlib, pytest). Run it
# where pip can download, then bring the folder along with the checkout; gpu_check.sh
# installs from it (offline, into a temporary folder) whatever does not import there.
#
#     bash scripts/gpu_wheels.sh [DIR] [PYTHON_VERSION]     # default .whl and 3.12
#
# torchao 0.17 loads its extensions with torch >= 2.11 (older torch: pick an older torchao
# with TORCHAO=0.x.y); NF4 and int8 frozen bases need it, the default run uses NF4.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${2:-3.12}
mkdir -p "$dir"
plat=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    plat+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp "${plat[@]}" -d "$dir" "torchao==${TORCHAO:-0.17.0}"
ls -l "$dir"
