"""How fast this machine's disk reads a checkpoint: the floor under the backbone's start from disk.

    python3 bench/disk_read.py out/ckpt-full --threads 1 2 4 8 [--block-mib 16] [--gib 8]

For each thread count: the shards' pages dropped from the page cache first (POSIX_FADV_DONTNEED, no
root needed), then the threads read whole shards (one shard per thread at a time, as the loader's
readers do) in one of two ways, each its own row:
  buffered  read() of --block-mib blocks through the page cache (what the loader's memory maps and
            POSIX_FADV_WILLNEED amount to, minus the copies to the GPU)
  direct    O_DIRECT preads of --block-mib into an aligned buffer: the disk's own rate, no page cache
Stops each run after --gib GiB, so a slow disk does not take minutes per row.
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from pathlib import Path


def drop(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths: list[Path], threads: int, block: int, limit: int, direct: bool) -> tuple[int, float]:
    """(bytes read, seconds) with `threads` readers taking whole files from a shared queue."""
    queue, lock, total = list(paths), threading.Lock(), [0]

    def reader() -> None:
        buffer = mmap.mmap(-1, block)            # page-aligned, as O_DIRECT needs
        view = memoryview(buffer)
        while True:
            with lock:
                if not queue or total[0] >= limit:
                    return
                path = queue.pop(0)
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                offset = 0
                while True:
                    n = os.preadv(fd, [view], offset)
                    if n <= 0:
                        break
                    offset += n
                    with lock:
                        total[0] += n
                        if total[0] >= limit:
                            break
                    if n < block:
                        break
            finally:
                os.close(fd)

    started = time.perf_counter()
    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return total[0], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--block-mib", type=int, default=16)
    parser.add_argument("--gib", type=float, default=8.0, help="stop each run after this many GiB")
    parser.add_argument("--modes", nargs="+", default=["buffered", "direct"], choices=["buffered", "direct"])
    args = parser.parse_args()
    paths = sorted(args.checkpoint.glob("*.safetensors"), key=lambda p: -p.stat().st_size)
    if not paths:
        raise SystemExit(f"no .safetensors files in {args.checkpoint}")
    size = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} shards, {size / 2 ** 30:.2f} GiB in {args.checkpoint}; "
          f"blocks of {args.block_mib} MiB, at most {args.gib} GiB per run")
    print(f"{'mode':>9} {'threads':>7} {'GiB':>7} {'s':>7} {'GB/s':>7}")
    for mode in args.modes:
        for threads in args.threads:
            drop(paths)
            nbytes, seconds = read_all(paths, threads, args.block_mib * 2 ** 20, int(args.gib * 2 ** 30),
                                       direct=mode == "direct")
            print(f"{mode:>9} {threads:>7} {nbytes / 2 ** 30:>7.2f} {seconds:>7.2f} {nbytes / seconds / 1e9:>7.2f}",
                  flush=True)
    drop(paths)


if __name__ == "__main__":
    main()
