#!/usr/bin/env bash
# LoRA serving cost, argosy vs vLLM on the same model, adapter and machine, one server at a
# time: `argosy bench serve` (32 prompts, 64 in / 64 out, 8 at a time) on the base model and
# on the adapter, through the same server; then loading adapters into the running server
# (bench/lora_runtime_load.py). Results: docs/benchmarks/lora.md.
#
#   ADAPTER=/tmp/lora-smollm2 VLLM=/tmp/vllm-cli VLLM_MODEL=/tmp/smollm2-hf bench/lora_compare.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ADAPTER=${ADAPTER:?a PEFT adapter folder for SmolLM2-135M}
OUT=${OUT:-docs/benchmarks/lora}
PORT=${PORT:-8126}
PY=${PY:-.venv/bin/python}
VLLM=${VLLM:-}
VLLM_MODEL=${VLLM_MODEL:-/tmp/smollm2-hf}
mkdir -p "$OUT"
# shellcheck source=bench/server_lifecycle.sh
source bench/server_lifecycle.sh

run_server() {  # label, server command...
  local label=$1
  shift
  local log="/tmp/lora-bench-$label.log"
  "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  wait_ready "http://127.0.0.1:$PORT/v1/models" "$log" || return 1
  for model in smollm2-135m adapter; do
    "$PY" -m argosy_runtime.cli.main bench serve --base-url "http://127.0.0.1:$PORT" \
      --model "$model" --rate inf --max-concurrency 8 --num-prompts 32 --input-len 64 \
      --output-len 64 --ignore-eos --seed 0 --label "$label-$model" --json "$OUT/$label-$model.json"
  done
  "$PY" bench/lora_runtime_load.py --base-url "http://127.0.0.1:$PORT" --model smollm2-135m \
    --adapter "$ADAPTER" --cycles 5 --label "$label" --json "$OUT/runtime-load-$label.json"
  stop_server
}

run_server argosy "$PY" -m argosy_runtime.cli.main serve --model smollm2-135m --dtype bfloat16 \
  --port "$PORT" --log-level warning --lora-modules "adapter=$ADAPTER" --allow-runtime-lora-updates
if [[ -n "$VLLM" ]]; then
  export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
  run_server vllm "$VLLM" serve "$VLLM_MODEL" --served-model-name smollm2-135m --dtype bfloat16 \
    --port "$PORT" --gpu-memory-utilization 0.25 --enable-lora --max-lora-rank 16 \
    --lora-modules "adapter=$ADAPTER"
fi
"$PY" -m argosy_runtime.cli.main bench serve --compare "$OUT"/argosy-*.json "$OUT"/vllm-*.json --json "$OUT/compare.json" \
  --markdown "$OUT/compare.md"
