#!/usr/bin/env bash
# Structured outputs, argosy vs vLLM on the same model and machine, one server at a time:
# bench/structured_output.py at concurrency 8 against each. Appends JSON lines to $OUT.
#
#   VLLM=/tmp/vllm-cli VLLM_MODEL=/tmp/smollm2-hf bench/structured_output_compare.sh
# VLLM: a command taking `serve MODEL ...` (see docs/benchmarks/serving.md); unset: argosy only.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/benchmarks/structured_output/results.jsonl}
PORT=${PORT:-8125}
PY=${PY:-.venv/bin/python}
VLLM=${VLLM:-}
VLLM_MODEL=${VLLM_MODEL:-/tmp/smollm2-hf}
rm -f "$OUT"
# shellcheck source=bench/server_lifecycle.sh
source bench/server_lifecycle.sh

run_server() {  # label, "modes", server command...
  local label=$1 modes=$2
  shift 2
  local log="/tmp/structured-output-$label.log"
  "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  wait_ready "http://127.0.0.1:$PORT/v1/models" "$log" || return 1
  for mode in $modes; do
    "$PY" bench/structured_output.py --base-url "http://127.0.0.1:$PORT" --mode "$mode" \
      --label "$label" --json "$OUT"
  done
  stop_server
}

ARGOSY=("$PY" -m argosy_runtime.cli.main serve --model smollm2-135m --dtype bfloat16
        --port "$PORT" --log-level warning)
run_server argosy "compact flexible none" "${ARGOSY[@]}"
run_server argosy-no-jump "compact flexible" "${ARGOSY[@]}" --no-enable-jump-forward
if [[ -n "$VLLM" ]]; then
  # --gpu-memory-utilization sizes vLLM's CPU KV cache (this VM: see serving.md).
  V=("$VLLM" serve "$VLLM_MODEL" --served-model-name smollm2-135m --dtype bfloat16
     --port "$PORT" --gpu-memory-utilization 0.25)
  run_server vllm-xgrammar "flexible none" "${V[@]}"
  run_server vllm-guidance "flexible" "${V[@]}" --structured-outputs-config '{"backend":"guidance"}'
  # vLLM reads disable_any_whitespace from the server config, not from the request.
  run_server vllm-guidance-compact "compact" "${V[@]}" \
    --structured-outputs-config '{"backend":"guidance","disable_any_whitespace":true}'
  run_server vllm-xgrammar-compact "compact" "${V[@]}" \
    --structured-outputs-config '{"backend":"xgrammar","disable_any_whitespace":true}'
fi
