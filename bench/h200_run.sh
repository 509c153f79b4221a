#!/usr/bin/env bash
# One call of the lent GPU machine (the `device` tool): set the machine up, run one part, pack
# what it wrote into at most 8 files under $OUT.
#
#   bash bench/h200_run.sh serving     bench/h200_serving.sh all (one 128-session stack: requests,
#                                      sweep, stage metrics, batch invariance), in-process timings skipped;
#                                      MPS=1 runs it under an MPS daemon (the single-GPU deployment)
#   bash bench/h200_run.sh final      codec bench (FP16) + the serving part with a short sweep
#   bash bench/h200_run.sh cmd C1 C2   the given shell commands, in order, output in cmd.log
#   bash bench/h200_run.sh start       bench.start_to_ready from a full checkpoint on disk, sequential,
#                                      DRAMA_LOAD_OVERLAP=0 then 1 (the backbone's expert reads beside
#                                      its warm-up, docs/perf.md session 4)
#   bash bench/h200_run.sh stages      each stage in-process: codec bench (FP16/FP32, profile), backbone
#                                      prefill + graphed decode with a kernel profile, tower step
#
# Carry `.whl` (the wheels the machine lacks) and, if a previous call brought one back,
# `.triton-cache` (its Triton cache, compiled kernels + autotune results): a fresh machine then skips
# most of the stages' ~100 s warm-up. The cache of this call comes back as $OUT/triton-cache.tgz;
# merge it into .triton-cache/ for the next call: `bash bench/merge_triton_cache.sh <that file>`, or,
# as it holds the whole cache the call ended with, carry that file itself as `.triton-cache.tgz`
# (packed: ~15 MB where the directory takes ~60 of the tool's 64 MiB).
# `bash bench/device_wheels.sh` makes .whl. Stage settings pass through the environment.
# The copy's .git may be stale there: give BENCH_COMMIT=<sha> in the command so the JSON names the
# commit measured.
set -uo pipefail
part=${1:?serving or stages}
# `BENCH_COMMIT=$(git rev-parse ...)` in the command runs here, on the stale copy: it names an old
# commit (session 22 runs 7-8 did). Say so rather than let a JSON name the wrong commit silently.
if [[ -n ${BENCH_COMMIT:-} && ${BENCH_COMMIT} == "$(git rev-parse --short HEAD 2>/dev/null)"* ]]; then
  echo "WARNING: BENCH_COMMIT=$BENCH_COMMIT is this copy's git HEAD, which may be stale: give the sha literally" >&2
fi
OUT=${OUT:?set by the device tool}
work=/tmp/bench-out
mkdir -p "$work"
export PYTHONUNBUFFERED=1
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[[ -d .triton-cache ]] && cp -r .triton-cache/. "$TRITON_CACHE_DIR"/
# or carried packed: a call's own triton-cache.tgz kept as .triton-cache.tgz (a quarter of the bytes)
[[ -f .triton-cache.tgz ]] && tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR"
echo "triton cache at start: $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

status=0
case $part in
  serving)   # MPS=1: the stages under an MPS daemon (bench/with_mps.sh), as compose.mps.yaml deploys them
    mps=(); [[ ${MPS:-0} == 1 ]] && mps=(bash bench/with_mps.sh)
    OUT=$work SKIP_MICRO=${SKIP_MICRO:-1} timeout "${SERVING_LIMIT:-560}" "${mps[@]}" bash bench/h200_serving.sh all 2>&1 \
      | tee "$work/serving.log"
    status=${PIPESTATUS[0]} ;;
  stages)
    for cmd in \
      "python3 bench/codec.py --dtype fp16 fp32 --frames 1 4 215 --batch 8 64 --profile --out $work/codec.json" \
      "python3 bench/backbone.py --preset full --device cuda --prefill 256 1024 --batch 1 32 128 --context 256 \
--steps 10 --warmup 2 --decode-graphs --served-warm-up --profile-decode 1 32 --out $work/backbone.json" \
      "python3 bench/tower.py --steps 20 --warmup 3"; do
      echo "+ $cmd" | tee -a "$work/commands.txt"
      $cmd 2>&1 | tee -a "$work/stages.log" || status=$?
    done ;;
  final)   # the short end-of-session run: codec bench, then one serving stack (requests, sweep, invariance)
    # the prefill lane (on by default on CUDA) serves only if its CUDA test passes here
    if [[ -z ${DRAMA_PREFILL_LANE:-} ]]; then
      if timeout 90 python3 -m pytest -q -x tests/test_prefill_lane.py -k cuda 2>&1 | tail -3 | tee "$work/lane_test.log" \
          && grep -q " passed" "$work/lane_test.log" && ! grep -q "failed" "$work/lane_test.log"; then
        export DRAMA_PREFILL_LANE=1
      else
        export DRAMA_PREFILL_LANE=0
      fi
    fi
    echo "DRAMA_PREFILL_LANE=$DRAMA_PREFILL_LANE" | tee -a "$work/commands.txt"
    timeout 100 python3 bench/codec.py --dtype fp16 --frames 1 4 215 --batch 8 64 --out "$work/codec.json" 2>&1 \
      | tee "$work/codec.log"
    OUT=$work SKIP_MICRO=1 SKIP_VOICE=${SKIP_VOICE:-1} SWEEP=${SWEEP:-1,8,32,128} DURATION=${DURATION:-8} \
      timeout "${SERVING_LIMIT:-300}" bash bench/h200_serving.sh all 2>&1 | tee "$work/serving.log"
    status=${PIPESTATUS[0]} ;;
  start)   # backbone start to ready from a full checkpoint on disk, stages one after another,
           # the expert reads beside the warm-up off, then on (DRAMA_LOAD_OVERLAP; ~6 device-minutes)
    ckpt=$PWD/out/ckpt-full
    for overlap in 0 1; do
      make=(--checkpoint "$ckpt")
      [[ $overlap == 0 ]] && make+=(--make --preset full --no-inspect --keep)
      cmd="DRAMA_LOAD_OVERLAP=$overlap python3 -m bench.start_to_ready ${make[*]} --device cuda --cache cold \
--order sequential --keep-compile-cache --no-gateway --json $work/start_to_ready_overlap$overlap.json \
--logs $work/start_logs_overlap$overlap.txt"
      echo "+ $cmd" | tee -a "$work/commands.txt"
      bash -c "$cmd" 2>&1 | grep -v resource_metrics | tail -25 | tee -a "$work/start.log"
      [[ ${PIPESTATUS[0]} == 0 ]] || status=1
      grep -h "experts read\|warm-up" "$work/start_logs_overlap$overlap.txt" | tee -a "$work/start.log"
    done ;;
  cmd)   # any commands: bash bench/h200_run.sh cmd "python3 ..." "python3 ..."
    shift
    for cmd in "$@"; do
      echo "+ $cmd" | tee -a "$work/commands.txt"
      bash -c "$cmd" 2>&1 | tee -a "$work/cmd.log"
      [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done ;;
  *) echo "unknown part $part"; exit 2 ;;
esac

tar -czf "$OUT/bench-out.tgz" -C "$work" . 2>/dev/null
# only what a cache hit loads (binaries, metadata, autotune results): the IR files would push the
# carried cache past the device tool's 64 MiB
find "$TRITON_CACHE_DIR" -type f \( -name "*.llir" -o -name "*.ptx" -o -name "*.ttgir" -o -name "*.ttir" \
  -o -name "*.source" \) -delete
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
ls -la "$OUT"
exit $status
