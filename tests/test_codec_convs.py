"""The decoder's wide convs as one GEMM and a shifted sum (conv.shifted_gemm_conv1d, the
`shifted_gemm` decode option, issue #3) against the F.conv1d path and the naive float64 conv, in
both window layouts, alone, in a stream and in the whole tiny decoder.

CPU float32 only: the GPU numbers come from `bench/codec.py --conv-table`.
"""

from __future__ import annotations

import pytest
import torch

from services.codec import naive
from services.codec.conv import CausalConv1d, causal_conv1d, shifted_gemm_conv1d, stacked_taps
from services.codec.decoder import Decoder, choose_conv_method
from services.codec.model import load_codec
from services.codec.state import StreamState
from tests.test_codec_model import AWKWARD_LENGTHS, assert_close, random_codes

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LAYOUTS = ["contiguous", "channels_last"]


def as_layout(window: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, C, W] as the decoder hands it over: as is, or 4-D channels_last ([B, W, C] in memory)."""
    if layout == "channels_last":
        return window.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    return window


def from_layout(y: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        assert y.dim() == 4 and y.is_contiguous(memory_format=torch.channels_last)
        return y.squeeze(2)
    assert y.is_contiguous()
    return y


def random_conv(c_in: int, c_out: int, kernel: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(c_out, c_in, kernel, generator=gen) / c_in ** 0.5,
            torch.randn(c_out, generator=gen))


# --------------------------------------------------------------------------------------------
# the function
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", AWKWARD_LENGTHS)
@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shifted_gemm_matches_the_causal_conv(length, dilation, layout):
    """Over a window [junk | zeros of the causal span | x], started past the junk, the shifted
    GEMM equals F.conv1d's causal conv (and the naive one) of x; 5 output channels make 35 taps
    rows, padded to 40, and two batch rows check that rows of one never reach the other."""
    gen = torch.Generator().manual_seed(length * 10 + dilation)
    weight, bias = random_conv(6, 5, 7, seed=dilation)
    x = torch.randn(2, 6, length, generator=gen)
    span, start = 6 * dilation, 3
    window = torch.cat([torch.full((2, 6, start), 1e4), torch.zeros(2, 6, span), x], dim=-1)
    taps = stacked_taps(weight)
    assert taps.shape == (40, 6)
    y = from_layout(shifted_gemm_conv1d(as_layout(window, layout), taps, bias, 5, 7, dilation,
                                        start=start), layout)
    assert y.shape == (2, 5, length) and y.dtype == torch.float32
    assert_close(y, causal_conv1d(x, weight, bias, 1, dilation), 1e-5, "vs F.conv1d")
    assert_close(y, naive.naive_causal_conv1d(x, weight, bias, 1, dilation), 1e-5, "vs naive")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shifted_gemm_window_edges(layout):
    """The last output's last tap reads the window's last input (and nothing after it), the
    first output's first tap the input at `start`; a window one input short is refused; a
    window of exactly the span gives an empty output."""
    weight, _ = random_conv(8, 8, 7, seed=4)
    taps, dilation, start = stacked_taps(weight), 3, 2
    window = torch.randn(1, 8, start + 18 + 5, generator=torch.Generator().manual_seed(5))

    def run(w):
        return from_layout(shifted_gemm_conv1d(as_layout(w, layout), taps, None, 8, 7, dilation,
                                               start=start), layout)

    base = run(window)
    assert base.shape == (1, 8, 5)
    last = window.clone()
    last[..., -1] += 1.0
    moved = run(last) - base
    assert moved[..., :-1].abs().max() == 0 and moved[..., -1].abs().max() > 0
    first = window.clone()
    first[..., start] += 1.0
    moved = run(first) - base
    assert moved[..., 0].abs().max() > 0 and moved[..., 1:].abs().max() == 0
    before = window.clone()
    before[..., :start] = float("nan")                       # skipped inputs are never read
    assert torch.equal(run(before), base)
    assert run(window[..., :start + 18]).shape == (1, 8, 0)
    with pytest.raises(ValueError, match="do not fit"):
        run(window[..., :start + 17])


def test_shifted_gemm_on_a_strided_window():
    """A window that is a slice of a longer buffer (time stride 1, rows longer than the window)
    gives the same numbers as its contiguous copy."""
    weight, bias = random_conv(8, 16, 7, seed=6)
    buffer = torch.randn(2, 8, 50, generator=torch.Generator().manual_seed(7))
    view = buffer[..., 5:45]
    taps = stacked_taps(weight)
    assert_close(shifted_gemm_conv1d(view, taps, bias, 16, 7, 1),
                 shifted_gemm_conv1d(view.contiguous(), taps, bias, 16, 7, 1), 1e-7, "strided window")


# --------------------------------------------------------------------------------------------
# the module, streamed
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("channels_last", [False, True])
def test_shifted_gemm_conv_streams_like_offline(dilation, channels_last):
    """A CausalConv1d with set_shifted_gemm, streamed in awkward chunks (1, 5, 3, 32, 89), equals
    its offline forward (the same path) and the naive conv; the default layout keeps a tail
    rounded up to 8 inputs (the last 8·⌈6d/8⌉ inputs, zeros at first), channels_last exactly 6d."""
    torch.manual_seed(dilation)
    conv = CausalConv1d(16, 16, kernel_size=7, dilation=dilation)
    conv.state_key = "conv"
    conv.set_channels_last(channels_last)
    conv.set_shifted_gemm(True)
    assert conv.wide and conv.gemm_taps is not None
    tail = 6 * dilation if channels_last else -(-6 * dilation // 8) * 8
    assert conv.tail_length == tail
    x = torch.randn(2, 16, 130)
    with torch.no_grad():
        offline = conv(x)
        state = StreamState(torch.zeros(2, dtype=torch.int64),
                            {"conv": conv.initial_state(2, "cpu", torch.float32)})
        parts, start = [], 0
        for size in (1, 5, 3, 32, 89):
            piece = as_layout(x[:, :, start:start + size], "channels_last" if channels_last else "")
            parts.append(from_layout(conv.step(piece, state), "channels_last" if channels_last else ""))
            start += size
    streamed = torch.cat(parts, -1)
    assert_close(streamed, offline, 1e-6, "streamed vs offline")
    assert_close(offline, naive.naive_conv(conv, x), 1e-5, "offline vs naive")
    kept = state.tensors["conv"].squeeze(2) if channels_last else state.tensors["conv"]
    assert torch.equal(kept, x[..., -tail:])


def test_shifted_gemm_is_for_wide_convs_only():
    """Narrow convs (the last conv: narrow_conv's), strided, grouped and 1x1 convs keep their
    paths and their tails."""
    for conv in (CausalConv1d(16, 1, 7), CausalConv1d(16, 16, 4, stride=2),
                 CausalConv1d(16, 16, 7, groups=16), CausalConv1d(16, 16, 1)):
        span = conv.tail_length
        conv.set_shifted_gemm(True)
        assert not conv.wide and conv.gemm_taps is None and conv.tail_length == span
    conv = CausalConv1d(16, 16, 7)
    conv.set_shifted_gemm(True)
    conv.set_shifted_gemm(False)
    assert conv.gemm_taps is None and conv.tail_length == 6


# --------------------------------------------------------------------------------------------
# the decoder
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return load_codec(tiny_checkpoint)


@pytest.fixture(scope="module")
def shifted(tiny_checkpoint):
    """The CPU reference path with only shifted_gemm on (frame-serial, float32)."""
    codec = load_codec(tiny_checkpoint).prepare("cpu", torch.float32, shifted_gemm=True)
    assert codec.decode_options["shifted_gemm"] and codec.frame_serial
    return codec


def test_option_reaches_the_wide_convs_only(reference, shifted):
    """On: model.0 and every residual unit's k 7 conv wide enough (the tiny decoder's last block
    has 2 channels: 14 taps, narrow) get taps; the last conv does not. Off (the default on CPU):
    none, and the tails are the causal spans, as before."""
    decoder = shifted.decoder
    assert decoder.model[0].gemm_taps is not None
    for block in decoder.model[1:5]:
        for unit in block.block[2:]:
            conv7 = unit.block[1]
            assert (conv7.gemm_taps is not None) == (conv7.conv.out_channels * 7 > 16)
    assert decoder.model[1].block[2].block[1].gemm_taps is not None
    assert decoder.model[-2].gemm_taps is None
    assert not reference.decode_options["shifted_gemm"]
    assert all(getattr(m, "gemm_taps", None) is None for m in reference.decoder.modules())
    assert reference.new_state().tensors["decoder.model.1.block.4.block.1"].shape[-1] == 54
    assert shifted.new_state().tensors["decoder.model.1.block.4.block.1"].shape[-1] == 56


def test_decoder_with_shifted_gemm_matches_without(reference, shifted):
    codes = random_codes(reference, 9, batch=2, seed=31)
    expected = reference.decode(codes)
    assert_close(shifted.decode(codes), expected, 5e-4, "shifted_gemm on vs off")


@pytest.mark.parametrize("group", [1, 4, 9])
def test_streamed_equals_offline_bit_for_bit_with_shifted_gemm(shifted, group):
    codes = random_codes(shifted, 9, batch=2, seed=32)
    offline = shifted.decode(codes)
    stream = shifted.stream(batch=2)
    streamed = torch.cat([stream.push(codes[:, :, i:i + group]) for i in range(0, 9, group)], -1)
    assert torch.equal(streamed, offline)


@pytest.mark.parametrize("channels_last", [False, True])
def test_gpu_configuration_with_shifted_gemm_on_cpu(reference, tiny_checkpoint, channels_last):
    """Every GPU decoder path (Snakes through the torch fallback), batched chunks as the GPU
    runs them, in both layouts: the reference decode within rounding; and the same with
    shifted_gemm off, so the option is the only difference."""
    codes = random_codes(reference, 11, batch=2, seed=33)
    expected = reference.decode(codes)
    for on in (True, False):
        fast = load_codec(tiny_checkpoint).prepare("cpu", torch.float32, fast=True,
                                                   channels_last=channels_last, shifted_gemm=on)
        assert fast.decode_options["shifted_gemm"] is on
        fast.frame_serial = False
        stream = fast.stream(batch=2)
        streamed = torch.cat([stream.push(codes[:, :, a:b]) for a, b in ((0, 1), (1, 8), (8, 11))], -1)
        assert_close(streamed, expected, 5e-4, f"GPU paths, shifted_gemm={on}")


# --------------------------------------------------------------------------------------------
# the per-conv choice (cuDNN or the GEMM path, measured at Codec.prepare on CUDA)
# --------------------------------------------------------------------------------------------

def test_choose_conv_method_takes_cudnn_unless_the_gemm_is_clearly_faster():
    assert choose_conv_method(1.0, 0.85) == "gemm"
    assert choose_conv_method(1.0, 0.95) == "cudnn"       # within the 10% margin
    assert choose_conv_method(1.0, 1.5) == "cudnn"
    assert choose_conv_method(118.0, 0.12) == "gemm"      # the H200's channels_last d 9 case
    assert choose_conv_method(1.0, 0.95, margin=0.0) == "gemm"


def test_choose_conv_methods_with_a_fake_timer(reference):
    """A fake ConvTimer: cuDNN catastrophic on dilation 9, 5% slower than the GEMM on dilation 3
    (inside the margin), faster on dilation 1 and on model.0. Each wide conv is timed GEMM first,
    then cuDNN allowed to give up at 3x the GEMM's time, at its block's step length."""
    decoder = reference.decoder
    calls = []

    def fake(conv, method, length, give_up_ms):
        calls.append((conv, method, length, give_up_ms))
        if method == "gemm":
            return 0.2
        return {1: 0.1, 3: 0.21, 9: 150.0}[conv.dilation]

    choices = decoder.choose_conv_methods(fake, latent_length=8)
    convs = decoder.wide_convs(8)
    assert list(choices) == list(convs)
    assert {name: c["method"] for name, c in choices.items()} == {
        name: "gemm" if conv.dilation == 9 else "cudnn" for name, (conv, _) in convs.items()}
    assert choices["model.0"]["length"] == 8 and choices["model.1.block.4.block.1"]["length"] == 64
    assert calls[::2] == [(conv, "gemm", length, None) for conv, length in convs.values()]
    assert calls[1::2] == [(conv, "cudnn", length, pytest.approx(0.6)) for conv, length in convs.values()]
    assert choices["model.2.block.4.block.1"] == {"method": "gemm", "cudnn_ms": 150.0, "gemm_ms": 0.2,
                                                  "length": 512}
    # choosing sets nothing: the reference decoder is still all cuDNN
    assert set(decoder.conv_methods().values()) == {"cudnn"}


def test_choose_conv_methods_times_each_shape_once():
    """Two wide convs of one shape (two decoders' worth of blocks of one width) share a timing."""
    decoder = Decoder(16, 16, [1])
    decoder.model[1].block[3] = decoder.model[1].block[2].__class__(8, 1)    # a second d 1 unit
    timed = []
    choices = decoder.choose_conv_methods(lambda conv, method, length, give_up: timed.append(
        (conv.conv.in_channels, conv.dilation, method)) or 1.0, latent_length=5)
    assert len(choices) == 4 and len(timed) == 2 * 3
    assert sorted(timed) == sorted({t for t in timed})


@pytest.mark.parametrize("method", ["cudnn", "gemm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forced_method_streams_like_f_conv1d(method, layout):
    """A wide conv forced to either method (set_method), streamed in awkward pieces in either
    layout, gives F.conv1d's causal conv within float32 rounding."""
    weight, bias = random_conv(12, 10, 7, seed=41)
    conv = CausalConv1d(12, 10, 7, dilation=3)
    with torch.no_grad():
        conv.conv.weight.copy_(weight)
        conv.conv.bias.copy_(bias)
    conv.state_key = "conv"
    conv.requires_grad_(False)
    conv.set_channels_last(layout == "channels_last")
    conv.set_method(method)
    assert conv.method == method
    x = torch.randn(2, 12, 70, generator=torch.Generator().manual_seed(42))
    state = StreamState(torch.zeros(2, dtype=torch.int64),
                        {"conv": conv.initial_state(2, "cpu", torch.float32)})
    parts, start = [], 0
    for size in (1, 8, 5, 56):
        parts.append(from_layout(conv.step(as_layout(x[:, :, start:start + size], layout), state), layout))
        start += size
    assert_close(torch.cat(parts, -1), causal_conv1d(x, weight, bias, 1, 3), 1e-5, f"{method} {layout}")


def test_set_method_refuses_what_has_no_choice():
    with pytest.raises(ValueError, match="expected one of"):
        CausalConv1d(16, 16, 7).set_method("im2col")
    with pytest.raises(ValueError, match="only a wide conv"):
        CausalConv1d(16, 1, 7).set_method("gemm")


MIXED = {"model.0": "gemm", "model.1.block.2.block.1": "cudnn", "model.1.block.3.block.1": "gemm",
         "model.1.block.4.block.1": "cudnn", "model.2.block.3.block.1": "gemm",
         "model.2.block.4.block.1": "gemm", "model.3.block.2.block.1": "gemm"}


def test_prepare_conv_methods(tiny_checkpoint):
    """On CPU shifted_gemm means the GEMM path for every wide conv (no measurement); conv_methods
    forces either method for all or per conv (unnamed: cuDNN); shifted_gemm=0 is never the GEMM."""
    codec = load_codec(tiny_checkpoint)
    names = list(codec.decoder.wide_convs())
    assert codec.prepare("cpu", torch.float32, fast=True).conv_methods == dict.fromkeys(names, "gemm")
    assert codec.conv_timings == {}
    assert codec.prepare("cpu", torch.float32, fast=True, conv_methods="cudnn").conv_methods == \
        dict.fromkeys(names, "cudnn")
    mixed = codec.prepare("cpu", torch.float32, fast=True, conv_methods=MIXED).conv_methods
    assert mixed == {name: MIXED.get(name, "cudnn") for name in names}
    assert all(getattr(m, "gemm_taps", None) is None for m in
               codec.prepare("cpu", torch.float32, fast=True, shifted_gemm=False).decoder.modules())
    assert codec.prepare("cpu", torch.float32, fast=True, shifted_gemm=False,
                         conv_methods="cudnn").conv_methods == dict.fromkeys(names, "cudnn")
    with pytest.raises(ValueError, match="shifted_gemm off"):
        codec.prepare("cpu", torch.float32, fast=True, shifted_gemm=False, conv_methods="gemm")
    with pytest.raises(ValueError, match="not wide decoder convs"):
        codec.prepare("cpu", torch.float32, fast=True, conv_methods={"model.5": "gemm"})
    with pytest.raises(ValueError, match="expected one of"):
        codec.prepare("cpu", torch.float32, fast=True, conv_methods="fastest")


def test_prepare_applies_and_logs_what_it_measures(tiny_checkpoint, monkeypatch, caplog):
    """prepare's CUDA branch with a fake timer in place of cuda_conv_ms (CPU): the measured
    methods reach the convs, the timings are kept, one log line names every choice; the timing
    runs in the decode layout, at a 128-frame piece's step lengths."""
    import logging

    from services.codec import model as model_module

    seen = []

    def fake(conv, method, length, give_up_ms):
        seen.append((conv.weight_4d is not None, length))
        return {"gemm": 0.2, "cudnn": 150.0 if conv.dilation == 3 else 0.1}[method]

    codec = load_codec(tiny_checkpoint).prepare("cpu", torch.float32, fast=True)
    monkeypatch.setattr(model_module, "cuda_conv_ms", fake)
    with caplog.at_level(logging.INFO, logger="services.codec.model"):
        codec._set_conv_methods(True, None, measure=True)
    assert codec.conv_methods == {name: "gemm" if conv.dilation == 3 else "cudnn"
                                  for name, (conv, _) in codec.decoder.wide_convs().items()}
    assert codec.decoder.model[1].block[3].block[1].gemm_taps is not None
    assert codec.decoder.model[1].block[2].block[1].gemm_taps is None
    assert set(codec.conv_timings) == set(codec.conv_methods)
    assert all(cl for cl, _ in seen) and seen[0][1] == 128 * 4
    line, = [r.getMessage() for r in caplog.records if "wide decoder convs" in r.getMessage()]
    assert "channels_last" in line and "1.block.3.block.1 gemm (cudnn 150.000, gemm 0.200)" in line


def test_f16_layout_is_the_default_one_unless_asked(tiny_checkpoint):
    """F16 decodes in torch's default layout (cuDNN's F16 NHWC kernels are catastrophic for some
    dilated shapes at lengths the per-conv choice does not measure), with or without the GEMM
    path, and in channels_last when asked; float32 keeps channels_last in a fast prepare."""
    codec = load_codec(tiny_checkpoint)
    assert not codec.prepare("cpu", torch.float16, fast=True).decode_options["channels_last"]
    assert codec.decode_options["shifted_gemm"] and not codec.decoder.channels_last
    assert not codec.prepare("cpu", torch.float16, fast=True,
                             shifted_gemm=False).decode_options["channels_last"]
    assert codec.prepare("cpu", torch.float32, fast=True).decoder.channels_last
    assert codec.prepare("cpu", torch.float16, fast=True, channels_last=True).decoder.channels_last
    assert codec.decoder.model[0].weight_4d is not None
    assert not codec.prepare("cpu", torch.float16, fast=True, channels_last=False).decoder.channels_last
    assert codec.prepare("cpu", torch.float16, fast=True, shifted_gemm=False,
                         channels_last=True).decoder.channels_last


@pytest.mark.parametrize("channels_last", [True, False])
def test_mixed_methods_stream_like_offline(reference, tiny_checkpoint, channels_last):
    """Every GPU decoder path with the wide convs' methods mixed (MIXED): frame-serial, streamed
    equals offline bit for bit; batched chunks as the GPU runs them, the reference decode within
    rounding."""
    codes = random_codes(reference, 11, batch=2, seed=34)
    expected = reference.decode(codes)
    fast = load_codec(tiny_checkpoint).prepare("cpu", torch.float32, fast=True,
                                               channels_last=channels_last, conv_methods=MIXED)
    assert fast.decoder.channels_last is channels_last and fast.frame_serial
    offline = fast.decode(codes)
    stream = fast.stream(batch=2)
    streamed = torch.cat([stream.push(codes[:, :, a:b]) for a, b in ((0, 1), (1, 5), (5, 11))], -1)
    assert torch.equal(streamed, offline)
    assert_close(offline, expected, 5e-4, "mixed methods, frame-serial")
    fast.frame_serial = False
    stream = fast.stream(batch=2)
    streamed = torch.cat([stream.push(codes[:, :, a:b]) for a, b in ((0, 1), (1, 8), (8, 11))], -1)
    assert_close(streamed, expected, 5e-4, "mixed methods, batched chunks")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cudnn_autotuning_is_scoped_to_the_decode_calls(tiny_checkpoint, dtype):
    """cudnn_benchmark turns cuDNN's algorithm timing on (limit Codec.cudnn_benchmark_limit) only
    inside Codec.cudnn_autotuned, with TF32 off for a float32 decode, and puts every flag back
    after, also when the decode raises; off (always so on the CPU), nothing changes."""
    cudnn = torch.backends.cudnn
    codec = load_codec(tiny_checkpoint).prepare("cpu", dtype, fast=True)
    assert codec.decode_options["cudnn_benchmark"] is False          # the CPU never times
    before = cudnn.benchmark, cudnn.benchmark_limit, cudnn.allow_tf32
    with codec.cudnn_autotuned():
        assert (cudnn.benchmark, cudnn.benchmark_limit, cudnn.allow_tf32) == before
    codec.decode_options = {**codec.decode_options, "cudnn_benchmark": True}   # as on CUDA
    with pytest.raises(RuntimeError, match="inside"):
        with codec.cudnn_autotuned():
            assert cudnn.benchmark and cudnn.benchmark_limit == codec.cudnn_benchmark_limit
            assert cudnn.allow_tf32 == (before[2] and dtype != torch.float32)
            raise RuntimeError("inside")
    assert (cudnn.benchmark, cudnn.benchmark_limit, cudnn.allow_tf32) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prepare_measures_the_methods_on_cuda(tiny_checkpoint, dtype):
    """On CUDA a fast prepare times every wide conv (both methods, and the Triton kernel in the
    default layout where Triton is installed; positive ms), takes the rule's method for each and
    decodes in channels_last in both dtypes (with cudnn_benchmark, on by default on CUDA: cuDNN's
    heuristic F16 NHWC kernels are what kept F16 in the default layout before; model.py), and in
    F16 without cudnn_benchmark in the default layout. (The numbers: the F16 shifted-GEMM test
    below and test_codec_model's CUDA stream-vs-offline test, which runs this configuration; the
    tiny decoder as it is is too chaotic to compare against the reference ops here.)"""
    codec = load_codec(tiny_checkpoint, device="cuda", dtype=dtype)
    assert set(codec.conv_timings) == set(codec.decoder.wide_convs())
    for name, timing in codec.conv_timings.items():
        assert timing["cudnn_ms"] > 0 and timing["gemm_ms"] > 0
        assert codec.conv_methods[name] == choose_conv_method(timing["cudnn_ms"], timing["gemm_ms"],
                                                              triton_ms=timing.get("triton_ms"))
    assert codec.decoder.channels_last and codec.decode_options["cudnn_benchmark"]
    audio = codec.decode(random_codes(codec, 6, seed=35))
    assert audio.shape == (1, 6 * codec.frame_samples) and bool(audio.isfinite().all())
    assert not torch.backends.cudnn.benchmark          # scoped to the decode calls
    heuristic = load_codec(tiny_checkpoint, device="cuda", dtype=dtype).prepare(
        "cuda", dtype, cudnn_benchmark=False)
    assert heuristic.decoder.channels_last == (dtype == torch.float32)


# --------------------------------------------------------------------------------------------
# F16 on the GPU
# --------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shifted_gemm_f16_on_cuda(dilation, layout):
    """The last block's conv shape (96 channels) in F16 on CUDA: as close to the float64 conv as
    cuDNN's F16 conv is (both within 2e-3), and a CUDA-graph replay gives the eager bits."""
    weight, _ = random_conv(96, 96, 7, seed=dilation)
    x = torch.randn(2, 96, 4099, generator=torch.Generator().manual_seed(8)).half().float()
    span = 6 * dilation
    start = 0 if layout == "channels_last" else -(-span // 8) * 8 - span
    window = as_layout(torch.cat([torch.zeros(2, 96, start + span), x], -1), layout).cuda().half()
    taps = stacked_taps(weight.cuda().half())
    expected = naive.naive_causal_conv1d(x, weight.half().float(), None, 1, dilation)
    eager = shifted_gemm_conv1d(window, taps, None, 96, 7, dilation, start=start)
    assert_close(from_layout(eager, layout).cpu(), expected, 2e-3, "shifted gemm F16")
    cudnn = causal_conv1d(x.cuda().half(), weight.cuda().half(), None, 1, dilation)
    assert_close(cudnn.cpu(), expected, 2e-3, "cuDNN F16")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        shifted_gemm_conv1d(window, taps, None, 96, 7, dilation, start=start)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        replayed = shifted_gemm_conv1d(window, taps, None, 96, 7, dilation, start=start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
