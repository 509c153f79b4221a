"""Backbone service layer: the chunk plan and targets (pure functions), request validation, and
the scheduler driving the real engine against a real tower server.

The end-to-end Generate tests over gRPC are in test_generate_e2e.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch

from drama.backbone.v1 import backbone_pb2
from services.backbone.scheduler import (ChunkEnd, FramesOut, GenerateError, Job, Prompt, Rows,
                                         Sampling, Scheduler, Started, TowerStep, Usage,
                                         audio_rows, check_context, plan_chunk, row_targets,
                                         text_rows)
from services.common.tensors import codes_to_wire, ids_to_bytes

N = 10            # tiny checkpoint codebooks
SEMANTIC_START = 284


def _text(*ids: int) -> Rows:
    return text_rows(torch.tensor(ids), N)


def _audio(n_frames: int, first: int = 0) -> Rows:
    codes = (torch.arange(n_frames * N).reshape(N, n_frames) + first) % 32   # [N, T]
    return audio_rows(codes, SEMANTIC_START)


def _prompt(system=None, history=(), turns=((10, 11),), open_=(20, 21), close=(22,)) -> Prompt:
    return Prompt(system=system if system is not None else _text(),
                  history=list(history), user_turns=[_text(*t) for t in turns],
                  assistant_open=_text(*open_), assistant_close=_text(*close))


# --------------------------------------------------------------------------------------------
# Rows, targets and the chunk plan
# --------------------------------------------------------------------------------------------

def test_audio_rows_token_id_is_semantic_start_plus_c0():
    codes = torch.tensor([[3, 7]] + [[1, 2]] * (N - 1))      # [N, 2]
    rows = audio_rows(codes, SEMANTIC_START)
    assert rows.token_ids.tolist() == [SEMANTIC_START + 3, SEMANTIC_START + 7]
    assert rows.frames[:, 0].tolist() == [3, 7] and rows.frames.shape == (2, N)
    assert (rows.n_text, rows.n_audio) == (0, 2)


def test_targets_are_the_next_rows_frame_where_it_is_audio():
    rows = Rows.cat([_text(1), _audio(2), _text(2, 3), _audio(1, first=5)])
    targets = row_targets(rows.frames)
    assert targets[0].tolist() == rows.frames[1].tolist()     # text -> audio
    assert targets[1].tolist() == rows.frames[2].tolist()     # audio -> audio
    assert (targets[2] == -1).all()                            # audio -> text
    assert (targets[3] == -1).all()                            # text -> text
    assert targets[4].tolist() == rows.frames[5].tolist()     # text -> audio
    assert (targets[5] == -1).all()                            # last row: the draw row


def test_first_chunk_is_system_history_turn_open():
    system, take = Rows.cat([_text(1, 2), _audio(3)]), _text(7, 7, 7)
    prompt = _prompt(system=system, history=[take], turns=[(10, 11), (12,)])
    rows = plan_chunk(prompt, 0, None, row_budget=100, semantic_start_token_id=SEMANTIC_START)
    expect = Rows.cat([system, take, _text(10, 11, 20, 21)])
    assert torch.equal(rows.token_ids, expect.token_ids) and torch.equal(rows.frames, expect.frames)


def test_later_chunk_splices_the_previous_chunk_and_its_frames():
    prompt = _prompt(system=_text(1), history=[_text(7)], turns=[(10, 11), (12,)])
    previous = _audio(4).frames.T                                  # [N, 4]
    rows = plan_chunk(prompt, 1, previous, row_budget=100, semantic_start_token_id=SEMANTIC_START)
    expect = Rows.cat([_text(1), _text(7), _text(10, 11, 20, 21),
                       audio_rows(previous, SEMANTIC_START), _text(22), _text(12, 20, 21)])
    assert torch.equal(rows.token_ids, expect.token_ids) and torch.equal(rows.frames, expect.frames)


def test_trimming_drops_history_oldest_first_then_the_previous_chunk():
    old, new = _text(7, 7, 7), _text(8, 8)
    prompt = _prompt(system=_text(1), history=[old, new], turns=[(10,), (12,)])
    previous = _audio(2).frames.T
    plan = lambda budget: plan_chunk(prompt, 1, previous, row_budget=budget,
                                     semantic_start_token_id=SEMANTIC_START)
    # whole: 1 + 3 + 2 + (1 + 2 + 2 + 1) + (1 + 2) = 15 rows
    assert len(plan(15)) == 15
    assert 7 not in plan(14).token_ids.tolist() and 8 in plan(14).token_ids.tolist()
    assert len(plan(10)) == 10 and 8 not in plan(10).token_ids.tolist()        # history gone
    assert plan(9).token_ids.tolist() == [1, 12, 20, 21]                       # previous gone too
    with pytest.raises(GenerateError) as info:
        plan(3)
    assert info.value.status == "OUT_OF_RANGE"


@pytest.mark.parametrize("sizes, budget, param", [
    ((8, 1, 1), 9, "references"), ((1, 8, 1), 9, "history"), ((1, 1, 8), 9, "text")],
    ids=["references", "history", "text"])
def test_first_chunk_is_never_trimmed_and_names_the_largest_part(sizes, budget, param):
    n_system, n_history, n_text = sizes
    prompt = _prompt(system=_text(*[1] * n_system), history=[_text(*[7] * n_history)],
                     turns=[[10] * (n_text - 1)], open_=(20,))
    check_context(prompt, budget + 1)                     # fits exactly with one row to spare
    with pytest.raises(GenerateError) as info:
        check_context(prompt, budget)
    assert (info.value.status, info.value.drama_code, info.value.param) == (
        "OUT_OF_RANGE", "context_length_exceeded", param)


def test_a_later_chunk_that_cannot_fit_even_alone_is_refused_at_admission():
    prompt = _prompt(system=_text(1), turns=[(10,), [12] * 20])
    with pytest.raises(GenerateError) as info:
        check_context(prompt, 10)
    assert info.value.param == "text"
