"""Code every stage shares: config, checkpoint reading, gRPC plumbing, telemetry.

Importing it makes Triton keep its autotuning results on disk beside the compiled kernels
(`TRITON_CACHE_AUTOTUNING`, unless the environment says otherwise): without it, every start re-times
every candidate config of fla's kernels and ours, which is most of a fresh start's warm-up, even
with a warm `TRITON_CACHE_DIR`.
"""

import os

os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
