"""services/backbone/overlap: kernels beside the main stream (issue #7).

On the CPU `beside` runs its work in place. On CUDA the work runs on a side stream, eagerly and
inside a captured CUDA graph, and the backbone's rows with the overlap are the same bits as with
the same split GEMMs run one after another on one stream: the side stream changes when kernels
run, never what they compute (a race would show as different bits)."""

from __future__ import annotations

import pytest
import torch

from services.backbone import overlap
from services.backbone.engine import BackboneEngine
from services.backbone.weights import random_backbone
from tests.test_backbone_gpu import MID, copy_to

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_in_place_off_cuda():
    assert not overlap.active(torch.device("cpu"))
    a, b = torch.randn(5, 7), torch.randn(3, 7)
    job = overlap.beside(torch.mm, a, b.T, device=a.device)
    assert torch.equal(job.join(), a @ b.T)
    assert torch.equal(job.join(), a @ b.T)      # a second join returns the result again


@cuda
def test_side_stream_eagerly_and_in_a_graph():
    dev = torch.device("cuda")
    a = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(768, 512, device=dev, dtype=torch.bfloat16)

    def step():
        job = overlap.beside(torch.mm, a, w2.T, device=dev)
        main = torch.relu(a @ w1.T)
        return main, job.join()

    want = (torch.relu(a @ w1.T), a @ w2.T)
    got = step()
    assert overlap.side_stream(dev) != torch.cuda.current_stream(dev)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        step()                                        # the side stream's first use outside the capture
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    want = (torch.relu(a @ w1.T), a @ w2.T)
    assert all(torch.equal(x, y) for x, y in zip(captured, want))


def _rows(model, monkeypatch, streams: bool):
    """A prompt of two sessions in padded pieces (graphs), then graphed decode steps; the rows."""
    if not streams:     # the same split GEMMs and jobs, each run in place on the main stream
        monkeypatch.setattr(overlap, "beside", lambda fn, *args, device: overlap.Job(fn(*args), None))
    gen = torch.Generator().manual_seed(5)
    engine = BackboneEngine(model, max_sessions=4, max_context=200)
    slots = [engine.open() for _ in range(2)]
    prompts = [torch.randint(0, MID.vocab_size, (n,), generator=gen) for n in (40, 90)]
    rows = engine.step([(s, p, None) for s, p in zip(slots, prompts)])
    for _ in range(6):
        ids = torch.randint(0, MID.vocab_size, (2,), generator=gen)
        rows += engine.step([(s, ids[j:j + 1], None) for j, s in enumerate(slots)])
    monkeypatch.undo()
    return torch.cat(rows)


@cuda
def test_backbone_rows_are_the_same_bits_with_the_side_stream(monkeypatch):
    assert overlap.active(torch.device("cuda")), "DRAMA_OVERLAP=0 in the environment"
    ref = random_backbone(MID, device="cpu", seed=7)
    model = copy_to(ref, "cuda", kernels=True, decode_graphs=True)
    with_streams = _rows(model, monkeypatch, streams=True)
    model = copy_to(ref, "cuda", kernels=True, decode_graphs=True)
    in_place = _rows(model, monkeypatch, streams=False)
    assert torch.equal(with_streams, in_place)
