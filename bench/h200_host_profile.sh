#!/usr/bin/env bash
# Where the host time of single-stream requests goes, per process (bench/host_profile.py), on a
# full-size random-weight stack on one CUDA device. Writes $OUT/host_profile.json, $OUT/spy/*.txt
# (py-spy raw samples) and $OUT/stack-logs.
#
#   OUT=/tmp/bench-out bash bench/h200_host_profile.sh        (needs py-spy: carry its wheel in .whl)
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
info=$(mktemp -u); url_file=$(mktemp -u)
python3 -m bench.stack --device "${DEVICE:-cuda}" --random-weights "${PRESET:-full}" --max-sessions 8 \
    --max-context 4096 --info-file "$info" --url-file "$url_file" --log-dir "$OUT/stack-logs" > "$OUT/stack.log" 2>&1 &
stack=$!
for _ in $(seq 600); do
  [[ -f $url_file ]] && break
  kill -0 $stack 2>/dev/null || break
  sleep 0.5
done
if [[ ! -f $url_file ]]; then echo "the stack did not come up"; tail -30 "$OUT/stack.log"; exit 1; fi
cat "$OUT/stack.log"
python3 -m bench.host_profile --stack-info "$info" --requests "${REQUESTS:-30}" --frames "${FRAMES:-4}" \
    --top "${TOP:-45}" --out "$OUT/spy" --json "$OUT/host_profile.json"
status=$?
kill $stack 2>/dev/null; wait $stack
exit $status
