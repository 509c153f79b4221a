"""Takes kept in memory for `history: [{"take_id"}]` and GET /v1/takes/{id} (API.md §2.2).

Codes are small (10 int16 per frame), so an LRU bounded by DRAMA_TAKE_STORE_MB with a TTL of
DRAMA_TAKE_TTL_S is enough; nothing is persisted.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


def new_take_id() -> str:
    return f"take_{secrets.token_hex(16)}"


@dataclass
class Take:
    id: str
    text: str                   # the request's text as synthesized (speaker tags included)
    codes: np.ndarray           # [N, T] int16, all chunks concatenated
    speakers: list[int]
    sample_rate: int
    seed: int
    created_at: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + 4 * len(self.text) + 256

    def to_json(self) -> dict:
        return {"object": "take", "id": self.id, "text": self.text, "speakers": self.speakers,
                "vq_codes": self.codes.astype(int).tolist(), "sample_rate": self.sample_rate,
                "seed": self.seed, "created_at": int(self.created_at)}


class TakeStore:
    def __init__(self, max_mb: float = 256.0, ttl_s: float = 3600.0, clock=time.monotonic):
        self.max_bytes = int(max_mb * 1024 * 1024)
        self.ttl_s = ttl_s
        self._clock = clock
        self._takes: OrderedDict[str, tuple[float, Take]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, take: Take) -> None:
        with self._lock:
            self._remove(take.id)
            self._takes[take.id] = (self._clock(), take)
            self._bytes += take.nbytes
            while self._bytes > self.max_bytes and self._takes:
                self._remove(next(iter(self._takes)))

    def get(self, take_id: str) -> Take | None:
        with self._lock:
            entry = self._takes.get(take_id)
            if entry is None:
                return None
            stored_at, take = entry
            if self._clock() - stored_at > self.ttl_s:
                self._remove(take_id)
                return None
            self._takes.move_to_end(take_id)
            return take

    def _remove(self, take_id: str) -> None:
        entry = self._takes.pop(take_id, None)
        if entry is not None:
            self._bytes -= entry[1].nbytes

    def __len__(self) -> int:
        return len(self._takes)
