#!/usr/bin/env bash
# The checks that need a CUDA device, in under 8 minutes on one GPU: the tests marked `gpu`
# (the default run and full mode through `orbitrl train`, the reference pulled to the device
# from its int8 host copy, train.tiers with pinned host memory and a side stream, the paged
# attention kernels against their torch references), then the benchmarks that run on CUDA, at
# sizes that fit the budget, printing their tables.
#
#     bash scripts/gpu_check.sh
#
# Each part runs under its own time limit (an overrun fails the check instead of stalling).
# Without a CUDA device it stops at once with exit status 2.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: FAILED: torch sees no CUDA device on this machine; these checks need one" >&2
    exit 2
fi
python -c "import torch; print('gpu_check: device', torch.cuda.get_device_name(0), '| torch', torch.__version__)"

start=$SECONDS
echo "== tests marked gpu (limit 200 s)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
timeout 200 python -m pytest -q -m gpu -rs tests 2>&1 | tee "$log"
if grep -qE "[0-9]+ skipped" "$log"; then  # with a device present none may be skipped
    echo "gpu_check: FAILED: gpu tests were skipped on a machine with a CUDA device" >&2
    exit 1
fi

echo "== benchmarks/bench_tiers.py: tiers and the pulled reference on CUDA (limit 100 s)"
timeout 100 python benchmarks/bench_tiers.py --steps 4 --tiers 1,2,4

echo "== benchmarks/bench_engine_gpu.py --quick: rollout against transformers (limit 90 s)"
timeout 90 python benchmarks/bench_engine_gpu.py --quick

echo "== benchmarks/bench_attention_kernels.py: paged decode, Triton vs gather + SDPA (limit 60 s)"
timeout 60 python benchmarks/bench_attention_kernels.py --quick

echo "gpu_check: passed in $((SECONDS - start)) s"
