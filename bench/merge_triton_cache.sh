#!/usr/bin/env bash
# Merge the Triton cache a device call brought back ($OUT/triton-cache.tgz of bench/h200_run.sh) into
# .triton-cache/, the cache the next call carries: every kernel directory it does not have yet.
#   bash bench/merge_triton_cache.sh /work/.device/N/triton-cache.tgz [...]
# Merge after every call that compiled something new (a serving stack compiles the decode buckets'
# kernels that a backbone benchmark at batch 1 never does): a call that starts from a partial cache
# compiles during its warm-up (session 10 run 8: an 84 s backbone warm-up instead of ~40).
# The device tool carries 64 MiB in all; the size printed at the end counts against it, and a
# call whose tree passes 64 MiB is refused. Config sweeps (bench/moe_decode.py) compile many
# kernels no served path uses: drop what was merged from such a call, e.g.
#   find .triton-cache -mindepth 1 -maxdepth 1 -newermt '2026-12-01 00:50' -exec rm -rf {} +
# (directories keep the time of their merge); the next call recompiles what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .triton-cache
for archive in "$@"; do
  tmp=$(mktemp -d)
  tar -xzf "$archive" -C "$tmp"
  added=0
  for dir in "$tmp"/*/; do
    name=$(basename "$dir")
    if [[ ! -e .triton-cache/$name ]]; then
      cp -r "$dir" ".triton-cache/$name"
      added=$((added + 1))
    fi
  done
  rm -rf "$tmp"
  echo "$archive: $added new kernel directories"
done
du -sh .triton-cache
size_mib=$(du -sm .triton-cache | cut -f1)
if (( size_mib > 48 )); then
  echo "warning: .triton-cache is ${size_mib} MiB; with .whl (~18 MiB) the device tool's 64 MiB is near (see the header)"
fi
