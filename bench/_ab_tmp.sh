ab() {
  DRAMA_OVERLAP=$1 timeout 110 python3 bench/backbone.py --preset full --device cuda --prefill 256 512 1024 --batch 1 128 --context 256 --steps 20 --warmup 3 --decode-graphs --served-warm-up 2>&1 | grep -E "^ +[0-9]+ +[0-9TF]|Error|error" | sed "s/^/ov=$1 /"
}
ab 1; ab 0
cp -r /tmp/triton-cache /tmp/test-cache
TRITON_CACHE_DIR=/tmp/test-cache timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_overlap.py tests/test_gdn_prefill_front.py tests/test_prefill_graphs.py tests/test_moe_decode.py -k "warps_and_column or piece" > /tmp/bench-out/t.log 2>&1; grep -E '^E  |^FAILED|passed|failed' /tmp/bench-out/t.log | head -30
ab 0; ab 1
