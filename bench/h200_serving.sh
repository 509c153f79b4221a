#!/usr/bin/env bash
# The serving benchmarks of issues #7 and #8 on one CUDA machine, full size, random weights.
#
#   bash bench/h200_serving.sh all        one stack (128 sessions x 4096 rows) for everything:
#                                         bench.e2e's requests (TTFA, RTF, peak memory), the
#                                         concurrency sweep, the voice-prefix TTFA, batch invariance;
#                                         then the stack stops and bench.e2e times each stage in-process
#   bash bench/h200_serving.sh e2e        bench.e2e alone, with its own single-stream stack
#
# Environment: OUT (default ./bench-out), DEVICE (cuda), PRESET (full), SWEEP (1,8,32,64,128),
# DURATION (15 s per level), FRAMES (100 per request); SKIP_E2E=1 / SKIP_VOICE=1 / SKIP_INVARIANCE=1 /
# SKIP_MICRO=1 leave out bench.e2e's requests, the voice-prefix run, the batch-invariance run, or the
# in-process stage timings; SPY_CONCURRENCY=N adds bench.host_profile (py-spy on every process, carry
# its wheel) over N streams at a time after the sweep, SPY_REQUESTS (2N) requests of FRAMES frames;
# LONG_FRAMES=F adds a sweep of LONG_SWEEP (128) streams of F frames each, LONG_DURATION (4) s. Stage settings pass through the
# environment, e.g. DRAMA_PREFILL_LANE=0 (the prefill lane, on by default on CUDA), DRAMA_PREFILL_INTERVAL_MS=200 or DRAMA_CODEC_GRAPH_LENGTHS=1,2,4,8 to compare a
# sweep with and without them (bench/stage_metrics.py shows which stage is busy). Every Python command is echoed to
# $OUT/commands.txt before it runs, so the log says exactly what produced each figure.
set -uo pipefail
OUT=${OUT:-bench-out}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-full}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-all}
status=0

run() {
  echo "+ $*" | tee -a "$OUT/commands.txt"
  "$@" || status=$?
}

if [[ $part == e2e ]]; then
  run python3 -m bench.e2e --preset "$PRESET" --device "$DEVICE" --budget-s 90 --micro-steps 30 \
      --ready-timeout 300 --log-dir "$OUT/e2e-logs" --json "$OUT/e2e.json" --markdown "$OUT/e2e.md"
fi

if [[ $part == all ]]; then
  info=$(mktemp -u); url_file=$(mktemp -u)
  stack_cmd=(python3 -m bench.stack --device "$DEVICE" --max-sessions "${SESSIONS:-128}" --max-context 4096
             --info-file "$info" --url-file "$url_file" --log-dir "$OUT/stack-logs")
  if [[ $PRESET == full ]]; then stack_cmd+=(--random-weights full); fi
  echo "+ ${stack_cmd[*]}" | tee -a "$OUT/commands.txt"
  # The stages print their step histograms every 2 s (bench/stage_metrics.py reads them back).
  OTEL_METRICS_EXPORTER=console OTEL_METRIC_EXPORT_INTERVAL=2000 "${stack_cmd[@]}" > "$OUT/stack.log" 2>&1 &
  stack=$!
  for _ in $(seq 1200); do
    [[ -f $url_file ]] && break
    kill -0 $stack 2>/dev/null || break
    sleep 0.5
  done
  if [[ ! -f $url_file ]]; then
    echo "the stack did not come up"; tail -40 "$OUT/stack.log"; tail -60 "$OUT"/stack-logs/*.log
    exit 1
  fi
  url=$(cat "$url_file")
  cat "$OUT/stack.log"
  grep -h "memory\|warm\|graph" "$OUT"/stack-logs/*.log | grep -v resource_metrics | head -20
  smi=""
  if command -v nvidia-smi > /dev/null; then   # card memory every 2 s (peak = the largest line)
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 2 > "$OUT/gpu_memory.csv" 2>&1 &
    smi=$!
  fi
  [[ ${SKIP_E2E:-0} == 1 ]] || run python3 -m bench.e2e --preset "$PRESET" --device "$DEVICE" --stack-info "$info" \
      --skip-micro --budget-s 60 --json "$OUT/e2e_stack.json"
  run python3 -m bench.load --url "$url" --sweep "${SWEEP:-1,8,32,64,128}" --duration "${DURATION:-15}" \
      --max-new-tokens "${FRAMES:-100}" --formats pcm --sample-rate 44100 --ramp-s 2 --json "$OUT/load.json"
  run python3 -m bench.stage_metrics "$OUT/stack-logs" --load "$OUT/load.json" --json "$OUT/stage_metrics.json"
  # Long streams: the sweep's 100-frame (4.6 s) requests hide a per-stream RTF a little above 1
  # behind the 1 s start buffer; LONG_FRAMES=400 (18.6 s) shows whether the load is held in real time.
  [[ -z ${LONG_FRAMES:-} ]] || run python3 -m bench.load --url "$url" --sweep "${LONG_SWEEP:-128}" \
      --duration "${LONG_DURATION:-4}" --max-new-tokens "$LONG_FRAMES" --formats pcm --sample-rate 44100 --ramp-s 2 \
      --json "$OUT/load_long.json"
  [[ -z ${SPY_CONCURRENCY:-} ]] || run python3 -m bench.host_profile --stack-info "$info" \
      --concurrency "$SPY_CONCURRENCY" --requests "${SPY_REQUESTS:-$((2 * SPY_CONCURRENCY))}" \
      --frames "${FRAMES:-100}" --max-seconds 180 --rate 200 --top 45 --out "$OUT/spy" --json "$OUT/host_profile.json"
  [[ ${SKIP_VOICE:-0} == 1 ]] || run python3 -m bench.voice_prefix --url "$url" --reference-s 20 --repeats 5 \
      --frames 4 --json "$OUT/voice_prefix.json"
  [[ ${SKIP_INVARIANCE:-0} == 1 ]] || run python3 -m bench.batch_invariance --url "$url" --batches 8 32 \
      --frames 24 --json "$OUT/batch_invariance.json"
  kill $smi $stack 2>/dev/null; wait $stack
  for log in "$OUT"/stack-logs/*.log; do echo "== $log"; grep -v resource_metrics "$log" | tail -n 3; done
  [[ -n $smi ]] && echo "peak card memory while serving: $(sort -t, -k2 -n "$OUT/gpu_memory.csv" | tail -1)"
  echo "Triton kernels first compiled after SERVING (kernel_watch; a request paid for each):"
  grep -h "after SERVING\|kernel_watch" "$OUT"/stack-logs/*.log | grep -v resource_metrics | head -20
  [[ ${SKIP_MICRO:-0} == 1 ]] || run python3 -m bench.e2e --preset "$PRESET" --device "$DEVICE" --micro-only --stack-json "$OUT/e2e_stack.json" \
      --micro-steps 20 --json "$OUT/e2e.json" --markdown "$OUT/e2e.md"
fi
exit $status
