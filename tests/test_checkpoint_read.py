"""Parallel shard reading (SafetensorsCheckpoint.read_parallel, read_into_parallel) and DeviceCopier."""

from __future__ import annotations

import threading

import pytest
import torch

from services.common.checkpoint import DeviceCopier, WeightError, _data_offsets, _runs, open_safetensors

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def test_every_tensor_once_in_file_order_one_thread_per_shard(tiny_checkpoint):
    ckpt = open_safetensors(tiny_checkpoint)
    seen: list[tuple[str, str, torch.Tensor]] = []
    lock = threading.Lock()

    def fn(name, mapped, copier):
        copy = copier.new(mapped)
        with lock:
            seen.append((name, threading.current_thread().name, copy))

    ckpt.read_parallel(ckpt.names(), fn, threads=2)
    assert sorted(n for n, _, _ in seen) == sorted(ckpt.names())
    for name, _, copy in seen:
        stored = ckpt.get(name)
        assert copy.dtype == stored.dtype and torch.equal(_bits(copy), _bits(stored)), name
    for shard in {ckpt.file_of(n) for n in ckpt.names()}:
        names = [n for n, _, _ in seen if ckpt.file_of(n) == shard]
        assert len({t for n, t, _ in seen if ckpt.file_of(n) == shard}) == 1     # one thread per shard
        start, offsets = _data_offsets(tiny_checkpoint / shard)
        assert [offsets[n][0] for n in names] == sorted(offsets[n][0] for n in names)


def test_a_subset_and_the_first_error(tiny_checkpoint):
    ckpt = open_safetensors(tiny_checkpoint)
    some = [n for n in ckpt.names() if n.endswith("norm.weight")]
    got = {}
    ckpt.read_parallel(some, lambda name, mapped, copier: got.__setitem__(name, copier.new(mapped)))
    assert set(got) == set(some)

    def fail(name, mapped, copier):
        if name == some[0]:
            raise RuntimeError(f"bad {name}")

    with pytest.raises(RuntimeError, match=f"bad {some[0]}"):
        ckpt.read_parallel(ckpt.names(), fail, threads=2)


def test_cpu_copies_are_fresh_and_convert(tiny_checkpoint):
    ckpt = open_safetensors(tiny_checkpoint)
    name = "model.language_model.embed_tokens.weight"
    mapped = ckpt.get(name)
    copier = DeviceCopier("cpu")
    fresh = copier.new(mapped)
    assert fresh.dtype == torch.bfloat16 and torch.equal(fresh, mapped)
    assert fresh.untyped_storage().data_ptr() != mapped.untyped_storage().data_ptr()
    wide = copier.new(mapped, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, mapped.float())
    slot = torch.empty((3,) + tuple(mapped.shape), dtype=torch.float32)
    copier.copy_into(slot[1], mapped)
    assert torch.equal(slot[1], mapped.float())
    with pytest.raises(ValueError):
        copier.copy_into(slot[1][:2], mapped)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk_bytes", [1000, 4096, 64 * 2 ** 20])
def test_cuda_staged_copies_land_bit_exact(chunk_bytes):
    """Chunks through the two pinned buffers (1000 bytes: many chunks, odd sizes), into fresh
    tensors and into slices of a preallocated stack, with and without a dtype change."""
    gen = torch.Generator().manual_seed(0)
    copier = DeviceCopier("cuda", chunk_bytes=chunk_bytes)
    bf16 = torch.randn(300, 77, generator=gen).to(torch.bfloat16)
    fp8 = (torch.randn(64, 200, generator=gen) * 50).to(FP8)
    f32 = torch.randn(513, generator=gen)
    out_bf16, out_fp8 = copier.new(bf16), copier.new(fp8)
    out_f32_as_bf16 = copier.new(f32, torch.bfloat16)
    stack = torch.empty((4, 64, 200), dtype=FP8, device="cuda")
    for e in range(4):
        copier.copy_into(stack[e], fp8 if e % 2 else (fp8.float() * 0.5).to(FP8))
    widened = torch.empty((2, 300, 77), dtype=torch.float32, device="cuda")
    copier.copy_into(widened[1], bf16)
    copier.finish()
    torch.cuda.synchronize()
    assert out_bf16.is_cuda and torch.equal(out_bf16.cpu(), bf16)
    assert torch.equal(out_fp8.cpu().view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(out_f32_as_bf16.cpu(), f32.to(torch.bfloat16))
    for e in range(4):
        want = fp8 if e % 2 else (fp8.float() * 0.5).to(FP8)
        assert torch.equal(stack[e].cpu().view(torch.uint8), want.view(torch.uint8)), e
    assert torch.equal(widened[1].cpu(), bf16.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_read_parallel_matches_the_stored_tensors(tiny_checkpoint):
    ckpt = open_safetensors(tiny_checkpoint)
    got = {}
    ckpt.read_parallel(ckpt.names(), lambda n, m, c: got.__setitem__(n, c.new(m)), device="cuda", threads=2)
    for name in ckpt.names():
        assert got[name].is_cuda and torch.equal(_bits(got[name].cpu()), _bits(ckpt.get(name))), name


def _into_targets(ckpt, names, device):
    """Fresh targets for `names` as slices of one stack per (shape, dtype), as the backbone's
    experts are (each target a contiguous slice, not a tensor of its own)."""
    groups: dict = {}
    for name in names:
        groups.setdefault((ckpt.shape_of(name), ckpt.dtype_of(name)), []).append(name)
    targets = {}
    for (shape, dtype), members in groups.items():
        stack = torch.zeros((len(members) + 1,) + tuple(shape), dtype=torch.float32, device=device).to(dtype)
        for i, name in enumerate(members):
            targets[name] = stack[i + 1]
    return targets


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("chunk_bytes", [1000, 2 ** 16, None])
def test_read_into_parallel_lands_every_tensor_bit_exact(tiny_checkpoint, monkeypatch, device, chunk_bytes):
    """Runs of neighbouring tensors (chunk 1000 bytes: most tensors a run of their own, the big
    ones through the staged copy; 64 KiB: runs of many; the default) land where they belong."""
    if chunk_bytes:
        monkeypatch.setattr(DeviceCopier, "CHUNK_BYTES", chunk_bytes)
    ckpt = open_safetensors(tiny_checkpoint)
    names = [n for n in ckpt.names() if "mlp.experts." in n] + ["model.language_model.embed_tokens.weight"]
    targets = _into_targets(ckpt, names, device)
    ckpt.read_into_parallel(targets, device=device, threads=2)
    for name in names:
        got = targets[name].cpu()
        assert torch.equal(_bits(got), _bits(ckpt.get(name))), name


def test_read_into_parallel_names_a_target_that_does_not_fit(tiny_checkpoint):
    ckpt = open_safetensors(tiny_checkpoint)
    name = next(n for n in ckpt.names() if n.endswith("experts.0.down_proj.weight"))
    wrong = torch.empty(ckpt.shape_of(name), dtype=torch.bfloat16)
    with pytest.raises(WeightError, match=f"{name} .*stored float8_e4m3fn .*target bfloat16"):
        ckpt.read_into_parallel({name: wrong})


def test_runs_join_neighbours_up_to_the_chunk():
    spans = [(0, 10, "a"), (10, 30, "b"), (30, 35, "c"), (2 ** 21, 2 ** 21 + 5, "far"), (2 ** 21 + 5, 2 ** 21 + 200, "big")]
    runs = [(b, e, [n for _, _, n in run]) for b, e, run in _runs(spans, most=40)]
    assert runs == [(0, 35, ["a", "b", "c"]), (2 ** 21, 2 ** 21 + 5, ["far"]), (2 ** 21 + 5, 2 ** 21 + 200, ["big"])]
    assert [[n for _, _, n in run] for _, _, run in _runs(spans[:3], most=25)] == [["a"], ["b", "c"]]
