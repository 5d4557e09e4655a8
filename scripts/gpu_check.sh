#!/usr/bin/env bash
# The checks that need a CUDA device, in under 8 minutes on one GPU: the tests marked `gpu`
# (the default run and full mode through `orbitrl train`, the reference pulled to the device
# from its int8 host copy, train.tiers with pinned host memory and a side stream, the decode
# runner's CUDA graphs, the paged attention kernels against their torch references), then
# the benchmarks that run on CUDA, at sizes that fit the budget, printing their tables.
#
#     bash scripts/gpu_check.sh               # everything (exit 0: passed)
#     bash scripts/gpu_check.sh --preflight   # only: packages import, a device is present
#
# Offline machines: packages that do not import there are installed from the wheels in
# .whl/ (or GPU_CHECK_WHEELS; scripts/gpu_wheels.sh makes them where pip can download)
# into a temporary folder;
# a package still missing stops the check at once, named. PYTHON picks the interpreter
# (default python3); GPU_CHECK_LOG=FILE also writes everything printed to FILE.
# Each part runs under its own time limit (an overrun fails that part instead of stalling);
# every part runs even when one before it failed, and the check exits 1 at the end if any
# did. A module that does not import stops it with exit status 1 before any GPU work, no
# CUDA device with 2. To a machine reached through a copy of the working tree, bring the
# ignored .whl/ folder along.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${GPU_CHECK_LOG:-}" ]]; then
    exec > >(tee -a "$GPU_CHECK_LOG") 2>&1
fi
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# output reaches the log as it is printed (a part killed by its limit keeps what it printed);
# nothing tries the network (transformers' continuous batching may probe the Hub)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# what the package imports (pyproject's dependencies) and what the checks run
mods="torch triton transformers safetensors tokenizers yaml tqdm numpy matplotlib torchao pytest"
missing() { "$PY" - "$@" <<'PYEOF'
import importlib, sys
gone = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception:
        gone.append(m)
print(" ".join(gone))
PYEOF
}
gone=$(missing $mods)
wheels=${GPU_CHECK_WHEELS:-.whl}
if [[ -n "$gone" ]] && compgen -G "$wheels/*.whl" > /dev/null; then
    site="${TMPDIR:-/tmp}/orbitrl-gpu-site"
    echo "gpu_check: not installed: $gone; installing the wheels in $wheels/ into $site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"
    gone=$(missing $mods)
fi
if [[ -n "$gone" ]]; then
    echo "gpu_check: FAILED: these Python modules do not import here: $gone (on a machine" \
         "without a package index, bring wheels made by scripts/gpu_wheels.sh in $wheels/)" >&2
    exit 1
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: FAILED: torch sees no CUDA device on this machine; these checks need one" >&2
    exit 2
fi

"$PY" -c "import torch, triton, transformers, torchao; print('gpu_check: device', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| torchao', torchao.__version__)"
# what the checks need beyond importing: from_config/from_pretrained(dtype=...) (transformers
# 4.56), torchao's int8 and NF4 tensors (the frozen bases)
if ! "$PY" - <<'PYEOF'
import sys
import transformers
from packaging.version import Version
from orbitrl.model import quant
bad = []
if Version(transformers.__version__) < Version("4.56"):
    bad.append(f"transformers {transformers.__version__} (the checks need 4.56 or newer)")
try:
    quant._torchao()
except ImportError as e:
    bad.append(f"torchao's Int8Tensor / NF4Tensor ({e})")
if bad:
    print("gpu_check: FAILED: " + "; ".join(bad), file=sys.stderr)
sys.exit(1 if bad else 0)
PYEOF
then
    exit 1
fi

if [[ "${1:-}" == "--preflight" ]]; then
    echo "gpu_check: preflight passed (packages import, a CUDA device is present)"
    exit 0
fi

start=$SECONDS
failed=()  # every part runs; the check fails at the end if any part did
# only the files that hold gpu tests: a module skipped at import elsewhere (an optional
# package missing) must not read as a skipped gpu test
files=$(grep -rlE "pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu" tests --include="test_*.py" | sort || true)
if [[ -z "$files" ]]; then
    echo "gpu_check: FAILED: no test file under tests/ has gpu-marked tests" >&2
    exit 1
fi
echo "== tests marked gpu in" $files "(limit 230 s)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# SIGINT at the limit: pytest stops as on Ctrl-C and still prints its failures and summary;
# a test stuck for 90 s dumps every thread's stack; the slowest tests' times are printed
if ! timeout -s INT -k 15 230 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider \
        -o faulthandler_timeout=90 --durations=15 $files 2>&1 | tee "$log"; then
    failed+=("gpu tests")
elif grep -qE "[0-9]+ skipped" "$log"; then  # with a device present none may be skipped
    echo "gpu_check: gpu tests were skipped on a machine with a CUDA device" >&2
    failed+=("gpu tests (skipped)")
fi

echo "== benchmarks/bench_tiers.py --quick: tiers and the pulled reference on CUDA (limit 45 s)"
timeout 45 "$PY" benchmarks/bench_tiers.py --quick --steps 4 --tiers 1,2,4 || failed+=("bench_tiers")

echo "== benchmarks/bench_engine_gpu.py --quick: rollout against transformers (limit 150 s)"
timeout 150 "$PY" benchmarks/bench_engine_gpu.py --quick || failed+=("bench_engine_gpu")

echo "== benchmarks/bench_attention_kernels.py: paged decode, Triton vs gather + SDPA (limit 45 s)"
timeout 45 "$PY" benchmarks/bench_attention_kernels.py --quick || failed+=("bench_attention_kernels")

if (( ${#failed[@]} )); then
    echo "gpu_check: FAILED after $((SECONDS - start)) s: ${failed[*]}" >&2
    exit 1
fi
echo "gpu_check: passed in $((SECONDS - start)) s"
