#!/usr/bin/env bash
# Run one command with NVIDIA MPS (the Multi-Process Service): the stages are separate processes,
# and without MPS the GPU time-slices between their contexts, so a codec chunk waits behind a
# backbone step instead of running beside it (bench/timeline.py shows it). MPS puts every
# process's kernels on one shared context, so they can overlap.
#
#   bash bench/with_mps.sh python3 -m bench.timeline --random-weights full --device cuda
#
# The control daemon is started for the command and stopped after it (pipe and log directories
# under /tmp unless CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY are set); the card's own
# settings (compute mode and the rest) are not touched. Exit 3: MPS is not available here.
set -uo pipefail
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/drama-mps/pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/drama-mps/log}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if ! command -v nvidia-cuda-mps-control > /dev/null; then
  echo "with_mps: nvidia-cuda-mps-control not found"; exit 3
fi
nvidia-cuda-mps-control -d || { echo "with_mps: the MPS control daemon did not start"; exit 3; }
trap 'echo quit | nvidia-cuda-mps-control; sleep 1' EXIT
echo "with_mps: MPS daemon up (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
"$@"
