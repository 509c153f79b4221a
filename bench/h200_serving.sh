#!/usr/bin/env bash
# The serving benchmarks of issues #7 and #8 on one CUDA machine, full size, random weights.
#
#   bash bench/h200_serving.sh e2e        bench.e2e: TTFA, RTF, per-stage ms, peak memory (~4 min)
#   bash bench/h200_serving.sh serving    one stack (128 sessions x 4096 rows), then the concurrency
#                                         sweep, the voice-prefix TTFA and batch invariance (~5 min)
#
# Outputs (logs, JSON, markdown) go to $OUT (default ./bench-out). Every Python command is echoed
# before it runs, so the log says exactly what produced each figure.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-e2e}
status=0

run() {
  echo "+ $*" | tee -a "$OUT/commands.txt"
  "$@" || status=$?
}

if [[ $part == e2e ]]; then
  run python3 -m bench.e2e --preset full --device cuda --budget-s 90 --micro-steps 30 \
      --ready-timeout 300 --log-dir "$OUT/e2e-logs" --json "$OUT/e2e.json" --markdown "$OUT/e2e.md"
fi

if [[ $part == serving ]]; then
  url_file=$(mktemp -u)
  echo "+ python3 -m bench.stack --random-weights full --device cuda --max-sessions 128 --max-context 4096" \
      | tee -a "$OUT/commands.txt"
  python3 -m bench.stack --random-weights full --device cuda --max-sessions 128 --max-context 4096 \
      --url-file "$url_file" --log-dir "$OUT/stack-logs" > "$OUT/stack.log" 2>&1 &
  stack=$!
  for _ in $(seq 600); do
    [[ -f $url_file ]] && break
    kill -0 $stack 2>/dev/null || break
    sleep 0.5
  done
  if [[ ! -f $url_file ]]; then
    echo "the stack did not come up"; tail -40 "$OUT/stack.log"; tail -40 "$OUT"/stack-logs/*.log
    exit 1
  fi
  url=$(cat "$url_file")
  cat "$OUT/stack.log"
  # Card memory every 2 s while the sweep runs (peak = the largest line).
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 2 > "$OUT/gpu_memory.csv" 2>&1 &
  smi=$!
  grep -h "memory" "$OUT"/stack-logs/*.log | head -20
  run python3 -m bench.load --url "$url" --sweep "${SWEEP:-1,8,32,64,128}" --duration "${DURATION:-15}" \
      --max-new-tokens "${FRAMES:-100}" --formats pcm --sample-rate 44100 --ramp-s 2 --json "$OUT/load.json"
  run python3 -m bench.voice_prefix --url "$url" --reference-s 20 --repeats 5 --frames 4 \
      --json "$OUT/voice_prefix.json"
  run python3 -m bench.batch_invariance --url "$url" --batches 8 32 --frames 24 --json "$OUT/batch_invariance.json"
  kill $smi $stack; wait $stack
  echo "peak card memory during the serving runs: $(sort -t, -k2 -n "$OUT/gpu_memory.csv" | tail -1)"
  tail -5 "$OUT"/stack-logs/*.log
fi
exit $status
