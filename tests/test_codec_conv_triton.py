"""The decoder's wide convs as one implicit-GEMM Triton kernel (conv_triton.implicit_conv1d, the
"triton" conv method) against F.conv1d, alone and in a stream, and the per-conv choice that
times it (Decoder.choose_conv_methods, Codec.prepare).

The kernel runs on a CUDA GPU, or in Triton's CPU interpreter:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_codec_conv_triton.py
Without either (CPU CI has no Triton) those tests skip; the method-switch and choice logic runs
everywhere. Decision, tested below: where Triton cannot run, set_method("triton") raises a
RuntimeError and leaves the conv's method as it was (and prepare with conv_methods="triton"
raises with every conv back on its previous method), so no conv holds a method that fails at
its first step.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from services.codec import conv_triton
from services.codec import decoder as decoder_module
from services.codec.conv import CONV_METHODS, CausalConv1d, causal_conv1d
from services.codec.decoder import CUDNN_GIVE_UP, choose_conv_method
from services.codec.model import load_codec
from services.codec.state import StreamState
from tests.test_codec_model import assert_close, rel_err

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_kernels = pytest.mark.skipif(
    not (importlib.util.find_spec("triton") is not None
         and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")),
    reason="needs Triton and a CUDA GPU (or TRITON_INTERPRET=1)")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and conv_triton.available()),
                          reason="needs a CUDA GPU with Triton")


def random_case(batch, c_in, c_out, kernel, dilation, length, start, bias=True, seed=0):
    """(window [B, C_in, start + (k-1)·d + L], weight [C_out, C_in, k], bias [C_out] | None)."""
    gen = torch.Generator().manual_seed(seed)
    window = torch.randn(batch, c_in, start + (kernel - 1) * dilation + length, generator=gen)
    weight = torch.randn(c_out, c_in, kernel, generator=gen) / (c_in * kernel) ** 0.5
    return window, weight, torch.randn(c_out, generator=gen) if bias else None


# --------------------------------------------------------------------------------------------
# the reference and the arguments (everywhere)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dilation,start", [(1, 0), (3, 3), (9, 5)])
def test_naive_reference_is_the_causal_conv(dilation, start):
    """Over [junk of `start` | zeros of the causal span | x], the reference (F.conv1d of
    window[..., start:] with the packed weight unpacked) is the causal conv of x: the packing
    and `start` mean what implicit_conv1d's docstring says."""
    _, weight, bias = random_case(1, 6, 5, 7, dilation, 1, 0, seed=dilation)
    gen = torch.Generator().manual_seed(dilation + 1)
    x = torch.randn(2, 6, 40, generator=gen)
    window = torch.cat([torch.randn(2, 6, start, generator=gen), torch.zeros(2, 6, 6 * dilation), x], -1)
    packed = conv_triton.pack_weight(weight)
    assert packed.shape == (7, 5, 6) and torch.equal(packed[2], weight[:, :, 2])
    got = conv_triton.naive_implicit_conv1d(window, packed, bias, 5, 7, dilation, start)
    assert got.dtype == torch.float64 and got.shape == (2, 5, 40)
    assert_close(got, causal_conv1d(x.double(), weight.double(), bias.double(), 1, dilation), 1e-12)


def test_implicit_conv1d_refuses_bad_arguments():
    window, weight, bias = random_case(1, 8, 16, 7, 1, 5, 0)
    packed = conv_triton.pack_weight(weight)
    with pytest.raises(ValueError, match="does not fit"):
        conv_triton.implicit_conv1d(window, packed, bias, 16, 7, dilation=3)    # too short
    with pytest.raises(ValueError, match="does not fit"):
        conv_triton.implicit_conv1d(window, packed, bias, 8, 7)                  # wrong C_out
    with pytest.raises(ValueError, match="window must be"):
        conv_triton.implicit_conv1d(window[0], packed, bias, 16, 7)
    with pytest.raises(ValueError, match="dtype|window's"):
        conv_triton.implicit_conv1d(window.half(), packed, bias, 16, 7)
    if not conv_triton.can_run("cpu"):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            conv_triton.implicit_conv1d(window, packed, bias, 16, 7)


# --------------------------------------------------------------------------------------------
# the method switch (everywhere)
# --------------------------------------------------------------------------------------------

def wide_conv(c_in=12, c_out=10, dilation=3, seed=41) -> tuple[CausalConv1d, torch.Tensor, torch.Tensor]:
    _, weight, bias = random_case(1, c_in, c_out, 7, dilation, 1, 0, seed=seed)
    conv = CausalConv1d(c_in, c_out, 7, dilation=dilation)
    with torch.no_grad():
        conv.conv.weight.copy_(weight)
        conv.conv.bias.copy_(bias)
    conv.state_key = "conv"
    conv.requires_grad_(False)
    return conv, weight, bias


def test_triton_is_a_conv_method_of_the_default_layout_only():
    """channels_last refuses it with a ValueError (the kernel is channels-first) and keeps the
    method it had."""
    assert "triton" in CONV_METHODS
    conv, _, _ = wide_conv()
    conv.set_channels_last(True)
    conv.set_method("gemm")
    with pytest.raises(ValueError, match="default layout"):
        conv.set_method("triton")
    assert conv.method == "gemm"


@pytest.mark.skipif(conv_triton.can_run("cpu"), reason="Triton runs on the CPU here (interpreter)")
def test_set_method_triton_is_refused_where_triton_cannot_run(tiny_checkpoint):
    """On a CPU without Triton's interpreter: a RuntimeError that says what is needed, the
    method and the stream tail as they were; prepare(conv_methods="triton") raises the same
    with every wide conv back on its previous method; with shifted_gemm off it is a ValueError."""
    conv, _, _ = wide_conv()
    conv.set_method("gemm")
    tail = conv.tail_length
    with pytest.raises(RuntimeError, match="Triton"):
        conv.set_method("triton")
    assert conv.method == "gemm" and conv.tail_length == tail and conv.triton_weight is None
    codec = load_codec(tiny_checkpoint).prepare("cpu", torch.float32, fast=True, channels_last=False)
    before = dict(codec.conv_methods)
    assert set(before.values()) == {"gemm"}
    with pytest.raises(RuntimeError, match="Triton"):
        codec.prepare("cpu", torch.float32, fast=True, channels_last=False, conv_methods="triton")
    assert codec.decoder.conv_methods() == before
    with pytest.raises(ValueError, match="shifted_gemm off"):
        codec.prepare("cpu", torch.float32, fast=True, shifted_gemm=False, conv_methods="triton")


def test_choose_conv_method_among_three():
    """cuDNN unless the fastest other method beats it by the margin; the GEMM path on a tie."""
    assert choose_conv_method(1.0, 0.95, triton_ms=0.5) == "triton"
    assert choose_conv_method(1.0, 0.5, triton_ms=0.6) == "gemm"
    assert choose_conv_method(1.0, 0.5, triton_ms=0.5) == "gemm"
    assert choose_conv_method(1.0, 0.95, triton_ms=0.92) == "cudnn"     # both within the margin
    assert choose_conv_method(1.0, 1.2, triton_ms=0.85) == "triton"
    assert choose_conv_method(0.1, 0.2, triton_ms=0.3) == "cudnn"


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return load_codec(tiny_checkpoint)


def triton_timer(calls):
    """A fake ConvTimer: the GEMM path 0.2 ms everywhere; Triton 0.05 ms at dilation 1, 0.3 at
    3, 0.19 at 9; cuDNN 0.1 at 1, 0.21 at 3 (within the margin of the GEMM's 0.2), 150 at 9."""
    def fake(conv, method, length, give_up_ms):
        calls.append((conv, method, length, give_up_ms))
        return {"gemm": {1: 0.2, 3: 0.2, 9: 0.2}, "triton": {1: 0.05, 3: 0.3, 9: 0.19},
                "cudnn": {1: 0.1, 3: 0.21, 9: 150.0}}[method][conv.dilation]
    return fake


def test_choose_conv_methods_times_triton_too(reference):
    """With `triton` on, each wide conv shape is timed GEMM, Triton, then cuDNN (allowed to give
    up at 3x the faster of the two), and the fastest method past the margin is taken."""
    decoder = reference.decoder
    decoder.set_channels_last(False)
    calls = []
    choices = decoder.choose_conv_methods(triton_timer(calls), latent_length=8, triton=True)
    convs = decoder.wide_convs(8)
    assert {name: c["method"] for name, c in choices.items()} == {
        name: {1: "triton", 3: "cudnn", 9: "triton"}[conv.dilation] for name, (conv, _) in convs.items()}
    assert [method for _, method, _, _ in calls] == ["gemm", "triton", "cudnn"] * len(convs)
    give_up = {1: 0.05, 3: 0.2, 9: 0.19}
    assert [(conv, length, g) for conv, method, length, g in calls if method == "cudnn"] == [
        (conv, length, pytest.approx(CUDNN_GIVE_UP * give_up[conv.dilation]))
        for conv, length in convs.values()]
    assert choices["model.2.block.4.block.1"] == {"method": "triton", "cudnn_ms": 150.0, "gemm_ms": 0.2,
                                                  "triton_ms": 0.19, "length": 512}
    assert set(decoder.conv_methods().values()) == {"cudnn"}        # choosing sets nothing


def test_choose_conv_methods_survives_a_failing_triton_kernel(reference, caplog):
    """A Triton kernel that raises (a compile or tuning failure) leaves that shape to cuDNN or
    the GEMM path, logged and kept as "triton_error"; it never stops prepare."""
    calls = []
    timer = triton_timer(calls)

    def failing(conv, method, length, give_up_ms):
        if method == "triton" and conv.dilation == 9:
            raise RuntimeError("no config fits")
        return timer(conv, method, length, give_up_ms)

    choices = reference.decoder.choose_conv_methods(failing, latent_length=8, triton=True)
    nine = choices["model.2.block.4.block.1"]
    assert nine["method"] == "gemm" and "triton_ms" not in nine
    assert nine["triton_error"] == "RuntimeError: no config fits"
    assert choices["model.0"]["method"] == "triton"
    assert "no config fits" in caplog.text


def test_choose_conv_methods_leaves_triton_out_where_it_cannot_run(reference):
    """channels_last convs are never timed on Triton; triton=None follows DRAMA_CODEC_TRITON_CONV=1
    and conv_triton.available() (Triton and CUDA), which on CPU CI is off: the timings are the
    two-method ones."""
    decoder = reference.decoder
    decoder.set_channels_last(True)
    try:
        calls = []
        choices = decoder.choose_conv_methods(triton_timer(calls), latent_length=8, triton=True)
        assert "triton" not in {method for _, method, _, _ in calls}
        assert all("triton_ms" not in c for c in choices.values())
    finally:
        decoder.set_channels_last(False)
    calls = []
    choices = decoder.choose_conv_methods(triton_timer(calls), latent_length=8)
    timed_triton = "triton" in {method for _, method, _, _ in calls}
    assert timed_triton == (conv_triton.available() and decoder_module.triton_in_choice())
    assert all(("triton_ms" in c) == timed_triton for c in choices.values())


def test_triton_is_timed_only_when_asked_for(reference, monkeypatch):
    """Even where Triton could run, prepare's default choice leaves it out (it never won on the
    H200 and its autotuning costs seconds of start); DRAMA_CODEC_TRITON_CONV=1 puts it in."""
    monkeypatch.setattr(conv_triton, "available", lambda: True)
    for env, expected in ((None, False), ("0", False), ("1", True)):
        if env is None:
            monkeypatch.delenv("DRAMA_CODEC_TRITON_CONV", raising=False)
        else:
            monkeypatch.setenv("DRAMA_CODEC_TRITON_CONV", env)
        calls = []
        reference.decoder.choose_conv_methods(triton_timer(calls), latent_length=8)
        assert ("triton" in {method for _, method, _, _ in calls}) == expected, env


def test_prepare_applies_measured_triton_and_tunes_it(tiny_checkpoint, monkeypatch, caplog):
    """prepare's CUDA branch on the CPU, with a fake timer, Triton made 'available' and the
    kernel never run: the measured methods reach the convs (Triton's packed weights included,
    default layout, tail = the causal span), the log line names the Triton timings, and the
    Triton convs are tuned once at the measured piece's step lengths."""
    import logging

    from services.codec import model as model_module

    monkeypatch.setattr(conv_triton, "available", lambda: True)
    monkeypatch.setattr(conv_triton, "can_run", lambda device: True)
    monkeypatch.setenv("DRAMA_CODEC_TRITON_CONV", "1")
    tuned = []
    monkeypatch.setattr(decoder_module.Decoder, "tune_triton", lambda self, latents: tuned.append(latents))
    codec = load_codec(tiny_checkpoint).prepare("cpu", torch.float32, fast=True, channels_last=False)
    monkeypatch.setattr(model_module, "cuda_conv_ms", triton_timer([]))
    with caplog.at_level(logging.INFO, logger="services.codec.model"):
        codec._set_conv_methods(True, None, measure=True)
    convs = codec.decoder.wide_convs()
    assert codec.conv_methods == {name: {1: "triton", 3: "cudnn", 9: "triton"}[conv.dilation]
                                  for name, (conv, _) in convs.items()}
    first = codec.decoder.model[0]
    assert first.method == "triton" and first.gemm_taps is None
    assert torch.equal(first.triton_weight, conv_triton.pack_weight(first.conv.weight))
    assert first.tail_length == first.causal_span
    assert tuned == [128 * 4]
    line, = [r.getMessage() for r in caplog.records if "wide decoder convs" in r.getMessage()]
    assert "default layout" in line
    assert "1.block.4.block.1 triton (cudnn 150.000, gemm 0.200, triton 0.190)" in line


# --------------------------------------------------------------------------------------------
# the kernel (CUDA, or Triton's interpreter)
# --------------------------------------------------------------------------------------------

KERNEL_CASES = [  # (batch, C_in, C_out, kernel, dilation, L, start, bias)
    (1, 24, 40, 7, 1, 1, 0, True),
    (3, 24, 40, 7, 1, 5, 3, False),
    (3, 24, 40, 7, 3, 37, 0, True),
    (1, 24, 40, 7, 9, 37, 3, True),
    (3, 24, 40, 7, 9, 130, 3, True),
    (1, 24, 40, 1, 1, 37, 3, True),
    (3, 24, 40, 3, 3, 5, 0, True),
    (1, 96, 96, 7, 1, 130, 0, True),
    (3, 96, 96, 7, 3, 37, 3, False),
    (1, 96, 96, 7, 9, 130, 3, True),
]


@triton_kernels
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "B{}-{}x{}-k{}-d{}-L{}-s{}-{}".format(
    *c[:7], "bias" if c[7] else "nobias"))
def test_kernel_matches_f_conv1d(case):
    """implicit_conv1d against F.conv1d of window[..., start:] in float64, on the operands the
    kernel sees (F16-rounded for F16): float32 within 1e-5, F16 within 2e-3 (one rounding of
    the output). Shape, dtype and contiguity of the result."""
    batch, c_in, c_out, kernel, dilation, length, start, with_bias = case
    window, weight, bias = random_case(batch, c_in, c_out, kernel, dilation, length, start, with_bias,
                                       seed=length + dilation)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        on = [None if t is None else t.to(DEVICE, dtype) for t in (window, weight, bias)]
        got = conv_triton.implicit_conv1d(on[0], conv_triton.pack_weight(on[1]), on[2], c_out, kernel,
                                          dilation, start)
        cpu = [None if t is None else t.cpu() for t in on]
        expected = conv_triton.naive_implicit_conv1d(cpu[0], conv_triton.pack_weight(cpu[1]), cpu[2],
                                                     c_out, kernel, dilation, start)
        assert got.shape == (batch, c_out, length) and got.dtype == dtype and got.is_contiguous()
        err = rel_err(got.cpu(), expected)
        assert err < tol, (dtype, err)


@triton_kernels
@pytest.mark.parametrize("config", range(len(conv_triton.CONFIGS)))
def test_every_autotune_config_computes_the_conv(config):
    """Each of the autotuner's configs alone (the tuner may pick any): a 96-channel d 9 shape
    and a 24 -> 40 one, whose blocks all overhang C_in and C_out, a window with time stride 1
    inside a wider buffer."""
    for batch, c_in, c_out, dilation, length, start in ((1, 96, 96, 9, 130, 3), (2, 24, 40, 3, 37, 0)):
        window, weight, bias = random_case(batch, c_in, c_out, 7, dilation, length, start, seed=config)
        wide = torch.randn(batch, c_in + 2, window.shape[-1] + 5)
        wide[:, 1:c_in + 1, 5:] = window
        view = wide.to(DEVICE)[:, 1:c_in + 1, 5:]                        # strides of the wider buffer
        got = conv_triton.implicit_conv1d(view, conv_triton.pack_weight(weight.to(DEVICE)), bias.to(DEVICE),
                                          c_out, 7, dilation, start, config=conv_triton.CONFIGS[config])
        expected = conv_triton.naive_implicit_conv1d(window, conv_triton.pack_weight(weight), bias,
                                                     c_out, 7, dilation, start)
        assert rel_err(got.cpu(), expected) < 1e-5


@triton_kernels
def test_forced_triton_streams_like_f_conv1d():
    """A wide conv on the Triton method, streamed in awkward pieces and run offline (`forward`),
    gives F.conv1d's causal conv within float32 rounding; its tail is the causal span (no
    alignment rounding), and switching to channels_last drops it back to cuDNN."""
    conv, weight, bias = wide_conv()
    conv.to(DEVICE)
    conv.set_method("triton")
    assert conv.method == "triton" and conv.tail_length == conv.causal_span == 18
    x = torch.randn(2, 12, 70, generator=torch.Generator().manual_seed(42))
    expected = causal_conv1d(x, weight, bias, 1, 3)
    state = StreamState(torch.zeros(2, dtype=torch.int64),
                        {"conv": conv.initial_state(2, DEVICE, torch.float32)})
    parts, start = [], 0
    for size in (1, 8, 5, 56):
        parts.append(conv.step(x[:, :, start:start + size].to(DEVICE), state).cpu())
        start += size
    assert_close(torch.cat(parts, -1), expected, 1e-5, "triton streamed")
    assert_close(conv(x.to(DEVICE)).cpu(), expected, 1e-5, "triton forward")
    conv.set_method("gemm")
    assert conv.method == "gemm" and conv.triton_weight is None
    conv.set_method("triton")
    conv.set_channels_last(True)
    assert conv.method == "cudnn"


@triton_kernels
def test_decoder_with_every_wide_conv_on_triton_matches_the_reference(tiny_checkpoint):
    """The tiny decoder in float32, default layout, every GPU decoder path on and every wide conv
    forced to Triton, streamed in batched chunks as the GPU runs them: the reference decode within
    rounding."""
    from tests.test_codec_model import random_codes

    reference = load_codec(tiny_checkpoint)
    codes = random_codes(reference, 3, seed=3)
    fast = load_codec(tiny_checkpoint).prepare(DEVICE, torch.float32, fast=True, channels_last=False,
                                               conv_methods="triton")
    assert set(fast.conv_methods.values()) == {"triton"}
    fast.frame_serial = False
    stream = fast.stream()
    streamed = torch.cat([stream.push(codes[:, :, a:b]) for a, b in ((0, 1), (1, 3))], -1)
    assert_close(streamed, reference.decode(codes), 5e-4, "every wide conv on Triton")


# --------------------------------------------------------------------------------------------
# CUDA only
# --------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_triton_f16_on_cuda_replays_in_a_graph(dilation):
    """The last block's shape (96 channels, 4099 outputs) in F16, autotuned: as close to the
    float64 conv as cuDNN's F16 conv, and a CUDA-graph replay gives the eager bits (the tuned
    config is kept: no retune at another length inside the capture)."""
    window, weight, _ = random_case(2, 96, 96, 7, dilation, 4099, 0, bias=False, seed=dilation)
    window, weight = window.half().float(), weight.half().float()
    expected = conv_triton.naive_implicit_conv1d(window, conv_triton.pack_weight(weight), None, 96, 7,
                                                 dilation)
    w16, packed = window.cuda().half(), conv_triton.pack_weight(weight.cuda().half())
    eager = conv_triton.implicit_conv1d(w16, packed, None, 96, 7, dilation)
    assert_close(eager.cpu(), expected, 2e-3, "triton F16")
    cudnn = torch.nn.functional.conv1d(w16, weight.cuda().half(), dilation=dilation)
    assert_close(cudnn.cpu(), expected, 2e-3, "cuDNN F16")
    short = w16[..., :1000]
    conv_triton.implicit_conv1d(short, packed, None, 96, 7, dilation)       # another length: cached
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = conv_triton.implicit_conv1d(w16, packed, None, 96, 7, dilation)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)


@cuda
def test_prepare_on_cuda_times_triton_and_triton_streams_like_offline(tiny_checkpoint):
    """On CUDA in F16 (default layout) prepare times Triton for every wide conv and takes the
    rule's method; every wide conv forced to Triton streams like offline within 2e-3."""
    from tests.test_codec_model import _half_stream_vs_offline

    codec = load_codec(tiny_checkpoint, device="cuda", dtype=torch.float16)
    for name, timing in codec.conv_timings.items():
        assert timing["triton_ms"] > 0
        assert codec.conv_methods[name] == choose_conv_method(timing["cudnn_ms"], timing["gemm_ms"],
                                                              triton_ms=timing["triton_ms"])
    forced = load_codec(tiny_checkpoint, device="cuda", dtype=torch.float16)
    forced.prepare("cuda", torch.float16, conv_methods="triton")
    assert set(forced.conv_methods.values()) == {"triton"}
    assert _half_stream_vs_offline(tiny_checkpoint, "cuda", conditioned=True, conv_methods="triton") <= 2e-3
