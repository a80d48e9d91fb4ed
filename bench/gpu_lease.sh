#!/usr/bin/env bash
# Everything a short lease of one GPU machine needs, in two steps:
#
#   bash bench/gpu_lease.sh prepare      # here, before asking for the machine (no GPU needed)
#   bash bench/gpu_lease.sh run "$OUT"   # there, as ONE command (about 8 minutes)
#
# prepare: writes .gpu/smollm2-8l.gguf (the embedded model's first 8 layers: its 94 MB GGUF
# does not fit the 64 MiB a call may carry) and downloads into .whl/ the one wheel the
# runtime needs that the machine's image lacks (gguf), and ignores both folders in git.
# Carry both: the device tool's `carry: [".gpu", ".whl"]`.
#
# run: uses the machine's own python3/torch/triton with runtime/ and kernels/ on PYTHONPATH;
# prints the versions, then bench/gpu_check.py (CHECK_BUDGET_S, default 240 s), then
# bench/gpu_matmul_tune.py (TUNE_BUDGET_S, default 200 s); logs and JSON go to the folder
# given (the tool's $OUT). Give the call timeout_s 600. Record the results in
# docs/benchmarks/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
prepare)
    PY=${PY:-.venv/bin/python}
    grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
    grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
    mkdir -p .gpu .whl
    "$PY" bench/truncate_gguf.py smollm2-135m .gpu/smollm2-8l.gguf --layers 8 || exit 1
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))") || exit 1
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d .whl "gguf==$version" || exit 1
    du -sh .gpu .whl
    ;;
run)
    out=${2:?usage: gpu_lease.sh run OUT_DIR}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_lease_site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/gpu_lease_site:$PWD/runtime:$PWD/kernels" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
        --format=csv | tee "$out/versions.txt"
    python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
        | tee -a "$out/versions.txt"
    # The check first (the issue's numbers; it writes its JSON after every section), then
    # the tuning sweep with what is left of the call.
    python3 bench/gpu_check.py --model .gpu/smollm2-8l.gguf --budget-s "${CHECK_BUDGET_S:-240}" \
        --out "$out/gpu_check.json" > "$out/gpu_check.log" 2>&1
    echo "gpu_check exit $?"
    sed -n '/== gpu_check summary/,$p' "$out/gpu_check.log"
    python3 bench/gpu_matmul_tune.py --budget-s "${TUNE_BUDGET_S:-200}" \
        --out "$out/gpu_matmul_tune.json" 2>&1 | tee "$out/gpu_matmul_tune.log" \
        | grep -v ' done$'
    ;;
*)
    echo "usage: bash bench/gpu_lease.sh prepare | run OUT_DIR" >&2
    exit 2
    ;;
esac
