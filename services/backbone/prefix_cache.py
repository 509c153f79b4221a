"""The voice-prefix cache (issue #8): a bounded LRU of per-session state snapshots, keyed by the
exact prefix rows.

Every chunk of a request with references starts its timeline with the same rows: the reference
system turn (API.md §3.4 `system`, MODEL.md §8.2). Both stages' state after those rows depends
on nothing else (the backbone is causal; the tower's residual layers on the prefix's last row use
that row's target, which is none because the system turn ends with text rows followed by the
text row `<|im_start|>`; the scheduler checks this per chunk). So after a session has computed
the prefix, each stage copies its per-session state out of its pool (the backbone:
`BackboneEngine.snapshot`; the tower: every layer's KV rows), and a later session with the same
prefix copies it back in and only prefills the rest.

The cache is held in device memory and bounded in bytes (`DRAMA_PREFIX_CACHE_MB`, default
`default_capacity_mb`): adding an entry evicts least-recently-used ones until it fits, nothing is
ever spilled to host memory. A restore copies out of the entry, so evicting an entry that was just
used is always safe. Both stages evict on their own; the tower answers a restore whose snapshot
is gone with FAILED_PRECONDITION and the backbone falls back to a full prefill.

Pure Python over tensors: no gRPC and no model code here.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Generic, Protocol, TypeVar

import torch

GPU_DEFAULT_MB = 1024
CPU_DEFAULT_MB = 64


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


Entry = TypeVar("Entry", bound=Sized)


def default_capacity_mb(device: str) -> int:
    """The cache budget when DRAMA_PREFIX_CACHE_MB is unset: 1024 MiB on a GPU, 64 on the CPU."""
    return CPU_DEFAULT_MB if str(device).startswith("cpu") else GPU_DEFAULT_MB


def prefix_key(model_identity: str, token_ids: torch.Tensor, frames: torch.Tensor) -> str:
    """SHA-256 (hex) of the model identity and the exact prefix rows: token ids int64 [L] and
    frames int64 [L, N] (-1 on text rows). Two prefixes share a key only if every row is equal."""
    digest = hashlib.sha256()
    digest.update(model_identity.encode())
    digest.update(b"\0" + str(tuple(frames.shape)).encode() + b"\0")
    digest.update(token_ids.to(torch.int64).contiguous().numpy().tobytes())
    digest.update(frames.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


class PrefixCache(Generic[Entry]):
    """key -> snapshot, at most `capacity_bytes` of snapshots (their `nbytes`), LRU eviction.

    capacity_bytes 0 disables the cache: `get` always misses and `put` stores nothing.
    Counters `hits`, `misses`, `evictions` are for tests and logs.
    """

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()

    @classmethod
    def from_mb(cls, capacity_mb: float) -> "PrefixCache":
        return cls(int(capacity_mb * 2 ** 20))

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        """The entry (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str, entry: Entry) -> bool:
        """Store (or replace) an entry, evicting least-recently-used ones until it fits.
        An entry larger than the whole budget is not stored (False)."""
        self.discard(key)
        size = entry.nbytes
        if size > self.capacity_bytes:
            return False
        while self.used_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= evicted.nbytes
            self.evictions += 1
        self._entries[key] = entry
        self.used_bytes += size
        return True

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0
