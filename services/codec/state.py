"""What a decode stream carries between calls (MODEL.md §7.5).

One `StreamState` holds B independent streams, batch-first, so the states of several sessions
can be stacked into one decode call and split again afterwards:
- `position` [B] int64: frames decoded so far (the post module's next RoPE position);
- `tensors`: name -> [B, ...]: per post-module layer the K (after RoPE) and V of the last
  window-1 frames; per causal conv the last k_e - s inputs; per decoder transposed conv the
  previous input frame. Keys are the owning module's name (plus "/k", "/v" for attention).

Nothing else is carried: no overlap, no crossfade, no held-back frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class StreamState:
    position: Tensor                                   # [B] int64
    tensors: dict[str, Tensor] = field(default_factory=dict)

    @property
    def tails(self) -> dict[str, Tensor]:
        return self.tensors

    @property
    def batch_size(self) -> int:
        return self.position.shape[0]

    @staticmethod
    def cat(states: list["StreamState"]) -> "StreamState":
        """Stack streams along the batch dim (all states must come from the same codec)."""
        if len(states) == 1:
            return states[0]
        return StreamState(torch.cat([s.position for s in states]),
                           {k: torch.cat([s.tensors[k] for s in states]) for k in states[0].tensors})

    def split(self) -> list["StreamState"]:
        """One single-stream state per batch row (views, no copies)."""
        if self.batch_size == 1:
            return [self]
        return [StreamState(self.position[b:b + 1], {k: v[b:b + 1] for k, v in self.tensors.items()})
                for b in range(self.batch_size)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
