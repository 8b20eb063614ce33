#!/usr/bin/env bash
# Issue 13's serving goal in one device call: `kvik serve` on Llama-3.1-8B shapes (dummy weights,
# bf16, default engine arguments), wait until healthy, warm up, then `kvik bench serve` at
# Poisson 16 req/s, 960 requests of 1024 prompt tokens and 256 output tokens. The bench scrapes the
# server's /metrics before and after the timed requests and prints the client's and the server's
# median TPOT and p99 TTFT (and every other metric) side by side; this script then checks the
# goals: every request completes, median TPOT < 10 ms, p99 TTFT < 250 ms, server within 10% of
# the client.
#
#   bench/serve_gpu.sh                 # on the H200 (about 1-2 min of start-up, 70 s of requests)
#   bench/serve_gpu.sh --small         # the same path on the CPU: the default model, 2 req/s,
#                                      # 20 requests of 64 in / 16 out
#
# Everything is an environment variable with the defaults below (SERVE_ARGS: more `kvik serve`
# options, e.g. "--enforce-eager"). Written to $OUT (default ./gpu-results): the bench's JSON
# (<date>_serve-16rps_<system>.json, with the server's figures under "server_metrics" and the
# roofline), the server's log and its final /metrics. Exit status: 0 when every goal holds, 1 when
# one does not, 2 when the run itself failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [[ "${1:-}" == "--small" ]]; then
    : "${MODEL:=smollm2-135m-instruct}" "${LOAD_FORMAT:=auto}" "${DTYPE:=auto}" "${DEVICE:=cpu}"
    : "${RATE:=2}" "${NUM_PROMPTS:=20}" "${INPUT_LEN:=64}" "${OUTPUT_LEN:=16}"
    : "${WARMUP_PROMPTS:=2}" "${SERVE_ARGS:=--max-model-len 512}"
    : "${GOAL_TPOT_MS:=}" "${GOAL_P99_TTFT_MS:=}"  # the CPU has no latency goal
elif [[ -n "${1:-}" ]]; then
    echo "usage: bench/serve_gpu.sh [--small]" >&2
    exit 2
fi
MODEL="${MODEL:-$ROOT/bench/models/llama-3.1-8b}"
LOAD_FORMAT="${LOAD_FORMAT:-dummy}"
DTYPE="${DTYPE:-bfloat16}"
DEVICE="${DEVICE:-cuda}"
RATE="${RATE:-16}"
NUM_PROMPTS="${NUM_PROMPTS:-960}"
INPUT_LEN="${INPUT_LEN:-1024}"
OUTPUT_LEN="${OUTPUT_LEN:-256}"
WARMUP_PROMPTS="${WARMUP_PROMPTS:-8}"
SERVE_ARGS="${SERVE_ARGS:-}"
GOAL_TPOT_MS="${GOAL_TPOT_MS-10}"
GOAL_P99_TTFT_MS="${GOAL_P99_TTFT_MS-250}"
GOAL_AGREEMENT="${GOAL_AGREEMENT:-0.10}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-240}"
PORT="${PORT:-8765}"
OUT="${OUT:-$ROOT/gpu-results}"
mkdir -p "$OUT"
URL="http://127.0.0.1:$PORT"
STAMP="$(date -u +%Y-%m-%dT%H%MZ)"
SYSTEM="kvik${SERVE_ARGS:+-$(echo "$SERVE_ARGS" | tr -cs 'A-Za-z0-9.' '-' | sed 's/^-*//; s/-$//')}"
RESULT="$OUT/${STAMP}_serve-${RATE}rps_${SYSTEM}.json"
LOG="$OUT/${STAMP}_serve-${RATE}rps_server.log"
export TQDM_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [[ -z "${KVIK_BENCH_COMMIT:-}" ]] && git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
    export KVIK_BENCH_COMMIT="$(git -C "$ROOT" rev-parse HEAD)"
fi

log() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }

# shellcheck disable=SC2086  # SERVE_ARGS is a list of options
"$PYTHON" -m kvik serve "$MODEL" --port "$PORT" --load-format "$LOAD_FORMAT" --dtype "$DTYPE" \
    --device "$DEVICE" $SERVE_ARGS >"$LOG" 2>&1 &
SERVER=$!
stop_server() {
    if kill -0 "$SERVER" 2>/dev/null; then
        kill -TERM "$SERVER" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$SERVER" 2>/dev/null || true
    fi
    wait "$SERVER" 2>/dev/null || true
}
trap stop_server EXIT
log "kvik serve $MODEL (pid $SERVER; log $LOG)"

healthy() {
    "$PYTHON" -c "import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen('$URL/health', timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)"
}
until healthy; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
        log "the server exited before it was healthy:"; tail -30 "$LOG"; exit 2
    fi
    if (( SECONDS > READY_TIMEOUT_S )); then
        log "not healthy after $READY_TIMEOUT_S s:"; tail -30 "$LOG"; exit 2
    fi
    sleep 1
done
log "healthy after ${SECONDS} s"

bench() {
    "$PYTHON" -m kvik bench serve --base-url "$URL" --model "$MODEL" --input-len "$INPUT_LEN" "$@"
}
if (( WARMUP_PROMPTS > 0 )); then
    # Other prompts (another seed), all at once and short: the first requests' one-off costs
    # (kernel compiles for new shapes) stay out of the timed run, whose metrics the bench scrapes
    # after this.
    bench --num-prompts "$WARMUP_PROMPTS" --output-len 8 --seed 1000003 \
        --roofline-device none >/dev/null 2>"$OUT/${STAMP}_serve-warmup.log" \
        || { log "warm-up failed:"; tail -20 "$OUT/${STAMP}_serve-warmup.log"; exit 2; }
    log "warmed up with $WARMUP_PROMPTS requests"
fi

log "timed: Poisson $RATE req/s, $NUM_PROMPTS requests, $INPUT_LEN in / $OUTPUT_LEN out"
set +e
bench --num-prompts "$NUM_PROMPTS" --output-len "$OUTPUT_LEN" --request-rate "$RATE" \
    --output-json "$RESULT" >/dev/null
BENCH_RC=$?
set -e
"$PYTHON" -c "import urllib.request, sys
sys.stdout.write(urllib.request.urlopen('$URL/metrics', timeout=10).read().decode())" \
    >"$OUT/${STAMP}_serve-${RATE}rps_metrics.txt" || true
if [[ ! -s "$RESULT" ]]; then
    log "kvik bench serve wrote no result (exit $BENCH_RC)"; tail -20 "$LOG"; exit 2
fi
log "result: $RESULT"

# The goals, from the bench's JSON.
"$PYTHON" - "$RESULT" "$GOAL_TPOT_MS" "$GOAL_P99_TTFT_MS" "$GOAL_AGREEMENT" <<'EOF'
import json, sys

path, tpot_goal, ttft_goal, agreement = sys.argv[1:5]
result = json.load(open(path))
server = result.get("server_metrics") or {}
print(f"\n{result['completed']} of {result['num_prompts']} requests completed "
      f"({result['failed']} failed) in {result['elapsed_s']:.1f} s: {result['request_s']:.2f} req/s, "
      f"{result['output_tok_s']:,.0f} output tok/s")
print("| metric | client median | server median | client p99 | server p99 |")
print("| --- | ---: | ---: | ---: | ---: |")
for name in ("ttft", "tpot", "itl", "e2el"):
    theirs = server.get(name, {})
    cells = [result[f"median_{name}_ms"], theirs.get("median_ms"), result[f"p99_{name}_ms"],
             theirs.get("p99_ms")]
    print(f"| {name.upper()} (ms) | " + " | ".join("-" if c is None else f"{c:,.2f}" for c in cells)
          + " |")
if result.get("roofline"):
    r = result["roofline"]
    print(f"roofline on {r['device']}: {100 * r['fraction']:.1f}% of the limit ({r['bound']})")
checks = [("every request completed", result["failed"] == 0 and result["completed"] == result["num_prompts"])]
# A stream that arrives in one chunk has a TPOT of 0: that is a broken stream, not a fast one.
checks.append(("tokens streamed in separate chunks", result["median_tpot_ms"] > 0))
if tpot_goal:
    checks.append((f"median TPOT < {tpot_goal} ms", result["median_tpot_ms"] < float(tpot_goal)))
if ttft_goal:
    checks.append((f"p99 TTFT < {ttft_goal} ms", result["p99_ttft_ms"] < float(ttft_goal)))
for name, stat in (("tpot", "median"), ("ttft", "p99")):
    mine, theirs = result[f"{stat}_{name}_ms"], server.get(name, {}).get(f"{stat}_ms")
    agree = bool(theirs) and abs(theirs - mine) <= float(agreement) * mine
    checks.append((f"server {stat} {name.upper()} within {float(agreement):.0%} of the client's", agree))
for name, ok in checks:
    print(f"{'PASS' if ok else 'FAIL'}  {name}")
sys.exit(0 if all(ok for _, ok in checks) else 1)
EOF
