"""Rows, targets and the chunk plan (API.md §3.4, MODEL.md §3, §8.2-§8.3): pure functions over
tensors, no engine, no gRPC. `scheduler.py` turns a request's prompt parts into each chunk's
timeline rows with `plan_chunk` and re-exports everything here.

`GenerateError` lives here because the context checks raise it (OUT_OF_RANGE naming the part
that does not fit); the scheduler raises it for every other session failure too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class GenerateError(Exception):
    """A session's failure, named by gRPC status (`status` is a `grpc.StatusCode` name) with the
    API's error code and field path (API.md §3.2); the servicer maps it onto the call."""

    def __init__(self, status: str, message: str, *, drama_code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.drama_code, self.param = status, message, drama_code, param


@dataclass(frozen=True)
class Rows:
    """A run of timeline rows (MODEL.md §3): `token_ids` int64 [n] and `frames` int64 [n, N],
    all -1 on a text row; an audio row's token id is semantic_start + its c_0."""

    token_ids: Tensor
    frames: Tensor

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def __getitem__(self, rows: slice) -> "Rows":
        return Rows(self.token_ids[rows], self.frames[rows])

    @property
    def n_audio(self) -> int:
        return int((self.frames[:, 0] >= 0).sum())

    @property
    def n_text(self) -> int:
        return len(self) - self.n_audio

    @staticmethod
    def cat(parts: list["Rows"]) -> "Rows":
        return Rows(torch.cat([p.token_ids for p in parts]), torch.cat([p.frames for p in parts]))


def text_rows(token_ids: Tensor, num_codebooks: int) -> Rows:
    """Text rows for token ids [n]."""
    token_ids = token_ids.to(torch.int64)
    return Rows(token_ids, torch.full((token_ids.shape[0], num_codebooks), -1, dtype=torch.int64))


def audio_rows(codes: Tensor, semantic_start_token_id: int) -> Rows:
    """Audio rows for codes [N, T] (codebook-major): row j carries frame codes[:, j]."""
    frames = codes.to(torch.int64).T.contiguous()
    return Rows(frames[:, 0] + semantic_start_token_id, frames)


def row_targets(frames: Tensor) -> Tensor:
    """Each row's target (MODEL.md §3): the next row's frame where that row is audio, else -1.
    The last row's target is -1 (it is the draw row, or its successor is not known yet)."""
    targets = torch.full_like(frames, -1)
    next_is_audio = frames[1:, 0] >= 0
    targets[:-1][next_is_audio] = frames[1:][next_is_audio]
    return targets


@dataclass
class Prompt:
    """A request's prompt parts (API.md §3.4), already as rows."""

    system: Rows                 # the reference system turn (empty without references)
    history: list[Rows]          # previous takes, oldest first (user + assistant turns each)
    user_turns: list[Rows]       # one per text chunk
    assistant_open: Rows
    assistant_close: Rows


def _context_error(sizes: dict[str, int], budget: int, chunk: int) -> GenerateError:
    largest = max(sizes, key=sizes.get)
    return GenerateError(
        "OUT_OF_RANGE",
        f"chunk {chunk}: prompt of {sum(sizes.values())} rows does not fit the context "
        f"({budget} rows left after max_new_tokens); largest part: {largest}",
        drama_code="context_length_exceeded", param=largest)


def check_context(prompt: Prompt, row_budget: int) -> None:
    """Raise OUT_OF_RANGE unless every chunk can fit `row_budget` (= max_context - max_new_tokens):
    the first chunk whole (it is never trimmed), later chunks with all previous takes dropped.
    `param` names the largest contributor (API.md §2.2)."""
    current = len(prompt.user_turns[0]) + len(prompt.assistant_open)
    sizes = {"references": len(prompt.system), "history": sum(len(t) for t in prompt.history),
             "text": current}
    if sum(sizes.values()) > row_budget:
        raise _context_error(sizes, row_budget, 0)
    for index, turn in enumerate(prompt.user_turns[1:], start=1):
        sizes = {"references": len(prompt.system), "text": len(turn) + len(prompt.assistant_open)}
        if sum(sizes.values()) > row_budget:
            raise _context_error(sizes, row_budget, index)


def plan_chunk(prompt: Prompt, index: int, previous_frames: Tensor | None, *, row_budget: int,
               semantic_start_token_id: int) -> Rows:
    """Chunk `index`'s prompt rows (API.md §3.4, MODEL.md §8.3):

        system ‖ history ‖ (index > 0: user_turns[index-1] ‖ assistant_open ‖ previous_frames ‖
        assistant_close) ‖ user_turns[index] ‖ assistant_open

    `previous_frames` [N, T] are the frames generated for chunk index-1. When the rows exceed
    `row_budget`, previous takes are dropped oldest first (history, then the previous chunk);
    the first chunk is never trimmed (`check_context` refused it at admission).
    """
    takes = list(prompt.history)
    if index > 0:
        takes.append(Rows.cat([prompt.user_turns[index - 1], prompt.assistant_open,
                               audio_rows(previous_frames, semantic_start_token_id),
                               prompt.assistant_close]))
    current = [prompt.user_turns[index], prompt.assistant_open]
    fixed = len(prompt.system) + sum(len(p) for p in current)
    while index > 0 and takes and fixed + sum(len(t) for t in takes) > row_budget:
        takes.pop(0)
    rows = Rows.cat([prompt.system, *takes, *current])
    if len(rows) > row_budget:
        raise _context_error({"references": len(prompt.system), "history": len(rows) - fixed,
                              "text": fixed - len(prompt.system)}, row_budget, index)
    return rows
