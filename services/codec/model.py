"""The codec stage: Fish's modded DAC (MODEL.md §7), codes <-> 44.1 kHz mono audio.

    codec = load_codec(checkpoint_dir, device="cpu")
    pcm = codec.decode(codes)                   # int64 [B, N, T] -> float32 [B, T·2048]
    codes = codec.encode(pcm, sample_rate)      # float [B, S] -> int64 [B, N, T]
    stream = codec.stream(); stream.push(codes_chunk) ...; stream.finish()

Decode is streaming by construction: `decode` is the stream over all frames, so a stream fed the
same frames in any grouping gives the same samples. On CPU float32 they are also the same bits:
there every decode call runs frame by frame and stream by stream (`frame_serial`), so each frame
meets exactly the same ops on exactly the same shapes whatever the grouping or the batch. (GEMM
and vectorised elementwise kernels may pick different blocking or tail loops for a different
row count, so a chunked call is only equal up to rounding.) On GPU `frame_serial` is off: chunks
of all sessions with the same length run as one batch, equal to the serial path within F16
tolerance.

Note for the inventory (services/common/inventory.py), where §2.4 leaves room. Our module tree
and `codec_inventory(cfg, style="folded")` agree name for name and shape for shape (tested for
the tiny and the full config); the choices both make:
- `quantizer.upsample.{u}.0.conv.weight` is a ConvTranspose1d weight [C_in, C_out, 2] = [C, C, 2];
  upsample stage u undoes downsample stage len-1-u (the reference builds them reversed).
- ConvNeXt `dwconv` is a plain (not weight-normed) depthwise conv: `...1.dwconv.conv.weight` [C, 1, 7].
- Every weight-normed conv has a `.bias` of its output channels (dim 1 of V for the transposed
  decoder convs); g is [dim0(V), 1, 1] (the loader refuses other g shapes, e.g. a flat [dim0]).
- The encoder-block transformer has `n_head = dim // 64` (the literal 64 of the reference) heads of
  `transformer_general_config.head_dim` and a 3·dim feed-forward: tiny block 4 (dim 64) has wqkv
  [192, 64], wo [64, 64], w1/w3 [192, 64], w2 [64, 192].
- The decoder has no transformer tensors even where `decoder_transformer_layers` is non-zero, and
  tanh / the Identity of an encoder block without transformer hold none either.
Other choices: the fold is W = V·(g/‖V‖) (torch's association); the RVQ tables stay float32 and
the dequantised latents are cast to the decode dtype; encode always runs in float32; codes out of
range are refused (the reference clamps).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.codec.conv import CONV_METHODS, ResidualUnit, Snake, Streaming, step_sequence
from services.codec.decoder import Decoder, cuda_conv_ms
from services.codec.encoder import Encoder
from services.codec.quantizer import DownsampleResidualVectorQuantize, check_codes
from services.codec.resample import resample
from services.codec.state import StreamState
from services.codec.transformer import Attention, RMSNorm, WindowedTransformer
from services.codec.weights import LoadReport, resolve_state_dict
from services.common.config import CodecConfig, load_config

try:
    from services.common.safe_pickle import load_torch_state_dict
except ImportError:  # pragma: no cover - until the allow-list loader lands
    def load_torch_state_dict(path):
        return torch.load(path, map_location="cpu", weights_only=True)

log = logging.getLogger(__name__)

# prepare times the wide convs at the step lengths of a piece this long: graphs.py's longest
# graph (LONG_LENGTHS), where the convs' cost is; a per-conv choice that is right there is right
# where it matters (the 10 s decode runs 128 + 64 + 32).
MEASURE_FRAMES = 128


class Codec(nn.Module):
    """encoder + quantizer + decoder, named as in codec.pth."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = DownsampleResidualVectorQuantize(cfg)
        self.decoder = Decoder(cfg.latent_dim, cfg.decoder_dim, cfg.decoder_rates)
        for name, module in self.named_modules():
            if isinstance(module, (Streaming, WindowedTransformer)):
                module.state_key = name
        # CPU float32 is the bit-exact reference path; see the module docstring.
        self.frame_serial = True
        self.decode_options: dict[str, bool] = {}
        self.conv_methods: dict[str, str] = {}       # wide decoder conv -> CONV_METHODS (prepare)
        self.conv_timings: dict[str, dict] = {}      # what prepare measured for them (CUDA)
        self.load_report: LoadReport | None = None

    # -- facts ----------------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.cfg.sample_rate

    @property
    def frame_samples(self) -> int:
        return self.cfg.frame_samples

    @property
    def num_codebooks(self) -> int:
        return self.cfg.num_codebooks

    @property
    def semantic_codebook_size(self) -> int:
        return self.cfg.quantizer.semantic_codebook_size

    @property
    def codebook_size(self) -> int:
        return self.cfg.quantizer.codebook_size

    @property
    def device(self) -> torch.device:
        return self.decoder.model[0].conv.weight.device

    @property
    def decode_dtype(self) -> torch.dtype:
        return self.decoder.model[0].conv.weight.dtype

    def _decode_modules(self) -> list[nn.Module]:
        return [self.quantizer.post_module, self.quantizer.upsample, self.decoder]

    # cuDNN algorithms timed per conv shape under cudnn_benchmark (torch's default is 10). On the
    # H200 (bench/codec.py --cudnn-benchmark-limit, session 4) 3 found kernels as fast in every
    # case (10 s graphed 12.28 against 12.32 ms; 8 x 4-frame tick 3.33 against 3.35) in half
    # the warm-up (28 graphs captured in 23.3 against 41.1 s).
    cudnn_benchmark_limit = 3
    FAST_OPTIONS = ("channels_last", "fused_snake", "fused_attention", "dequant_table", "narrow_conv",
                    "pointwise_gemm", "fused_windows", "shifted_gemm", "cudnn_benchmark")

    def prepare(self, device, dtype: torch.dtype, fast: bool | None = None, *,
                conv_methods: str | dict[str, str] | None = None, **options: bool) -> "Codec":
        """Move to `device`; decode path in `dtype`, encode path (and RVQ tables) in float32.

        fast (default: on CUDA) turns on the GPU decode-step paths, each equal to the reference
        within F16 rounding, not bit for bit, so never on the CPU reference path by default:
        channels_last decoder convs (conv.py; not in F16/BF16 unless asked for, see below),
        fused_snake (Triton, snake_triton.py; only where it can run), fused_attention (SDPA, fused
        RoPE and F.rms_norm in the post module), dequant_table (quantizer.py), narrow_conv
        (the decoder's last conv, 1 output channel, as one GEMM: conv.taps_conv1d) and
        pointwise_gemm (each residual unit's 1x1 conv and skip add as one in-place GEMM:
        conv.pointwise_residual_) and fused_windows (each Snake before a causal conv writes the
        conv's [tail | input] window and adds the previous conv's bias: one kernel with
        fused_snake, the same numbers through torch.cat without; Decoder.set_fused_windows) and
        shifted_gemm (the decoder's first conv and residual k 7 convs may run off cuDNN: as one
        GEMM and a shifted sum each, conv.shifted_gemm_conv1d, or in the default layout as one
        Triton kernel each, conv_triton.implicit_conv1d; see conv_methods) and cudnn_benchmark
        (CUDA only: cuDNN times its algorithms per decode conv shape, `cudnn_autotuned`).
        `options` overrides single ones, e.g. fused_snake=False. In a fast prepare so does
        DRAMA_CODEC_OPTIONS (`decode_options_from_env`) for the options not passed here: that is
        how a server or a benchmark is switched without code changes (fast=False, the reference
        ops, ignores it). Streams made before a prepare do not fit after it.

        The wide convs' methods (`self.conv_methods`, name -> "cudnn" | "gemm" | "triton"):
        shifted_gemm off means cuDNN for all of them. On, conv_methods says: None (default) the
        GEMM path or the Triton kernel where one measures faster: on CUDA each distinct shape is
        timed once (Decoder.choose_conv_methods at the step lengths of a MEASURE_FRAMES-frame
        piece; the Triton kernel only with Triton installed and in the default layout, and its
        first timing autotunes it: seconds per shape; logged, and kept in `self.conv_timings`),
        elsewhere (CPU: no measurement, deterministic CI) the GEMM path for all; "gemm", "cudnn"
        or "triton" all one way; a dict per conv name (those not named: cuDNN). "triton" is
        refused where it cannot run (CausalConv1d.set_method: channels_last, or no Triton/CUDA).

        Layout: channels_last is on in a fast prepare, except in F16/BF16 without cudnn_benchmark
        unless asked for: cuDNN's heuristic picks F16 NHWC kernels for some dilated convs that are
        catastrophic (H200: 118-232 ms per call at 10 s), at lengths and batches the per-conv
        choice does not cover (see below); timed per shape, channels_last is the faster layout.
        """
        from services.codec import snake_triton

        self.to(device).float()
        for module in self._decode_modules():
            module.to(dtype)          # round to nearest even
        self.requires_grad_(False).eval()
        on_cpu = torch.device(device).type == "cpu"
        self.frame_serial = on_cpu
        if fast is None:
            fast = not on_cpu
        if fast:
            options = {**decode_options_from_env(), **options}
        unknown = set(options) - set(self.FAST_OPTIONS)
        if unknown:
            raise ValueError(f"unknown decode options {sorted(unknown)}")
        chosen = {name: options.get(name, fast) for name in self.FAST_OPTIONS}
        chosen["cudnn_benchmark"] = chosen["cudnn_benchmark"] and not on_cpu
        if (dtype in (torch.float16, torch.bfloat16) and "channels_last" not in options
                and not chosen["cudnn_benchmark"]):
            # Measured on the H200 (torch 2.11): with cuDNN's heuristic algorithm choice, the F16
            # channels_last decoder ran 10 s in 488 ms, against ~38 ms in torch's default layout.
            # bench/codec.py --conv-table found why: the heuristic runs three dilated k 7 shapes
            # (w_1 d 3 and 9, w_2 d 9) on its generic conv2d_grouped_direct_kernel in F16 NHWC,
            # 118-232 ms per call, and at other lengths and batches further shapes. With
            # cudnn_benchmark (the default on CUDA) cuDNN times its algorithms per shape instead,
            # and channels_last is the faster layout (no NCHW <-> NHWC transposes around every
            # conv): 10 s graphed in 12.2 ms against 17.3 in the default layout (session 4).
            chosen["channels_last"] = False
        chosen["fused_snake"] = chosen["fused_snake"] and not on_cpu and snake_triton.available()
        self.decoder.set_channels_last(chosen["channels_last"])
        self.decoder.set_narrow(chosen["narrow_conv"])
        self.decode_options = chosen         # read by cudnn_autotuned, which the timings use
        with self.cudnn_autotuned():
            self._set_conv_methods(chosen["shifted_gemm"], conv_methods,
                                   measure=torch.device(device).type == "cuda")
        self.decoder.set_fused_windows(chosen["fused_windows"])
        for module in self.decoder.modules():
            if isinstance(module, Snake):
                module.fused = chosen["fused_snake"]
            elif isinstance(module, ResidualUnit):
                module.pointwise_gemm = chosen["pointwise_gemm"]
        post = self.quantizer.post_module
        post.fused_attention = chosen["fused_attention"]
        for module in post.modules():
            if isinstance(module, Attention):
                module.fused_rope = chosen["fused_attention"]
            elif isinstance(module, RMSNorm):
                module.fused = chosen["fused_attention"]
        self.quantizer.set_dequant_table(chosen["dequant_table"])
        return self

    def _set_conv_methods(self, shifted_gemm: bool, conv_methods, measure: bool) -> None:
        """The wide convs' methods for prepare (its docstring); after the layout is set, since
        the timings are the layout's."""
        decoder = self.decoder
        names = decoder.wide_convs()
        measure_latents = MEASURE_FRAMES * self.frame_samples // math.prod(self.cfg.decoder_rates)
        self.conv_timings = {}
        if isinstance(conv_methods, str):
            if conv_methods not in CONV_METHODS:
                raise ValueError(f"conv_methods {conv_methods!r}: expected one of {CONV_METHODS}, "
                                 f"a dict per conv, or None (measure)")
            conv_methods = dict.fromkeys(names, conv_methods)
        if not shifted_gemm:
            off_cudnn = set() if conv_methods is None else set(conv_methods.values()) - {"cudnn"}
            if off_cudnn:
                raise ValueError(f"conv_methods asks for {sorted(off_cudnn)} with shifted_gemm off "
                                 f"(which keeps every wide conv on cuDNN)")
            conv_methods = {}
        elif conv_methods is None and not measure:
            conv_methods = dict.fromkeys(names, "gemm")
        elif conv_methods is None:
            with torch.no_grad():
                self.conv_timings = decoder.choose_conv_methods(cuda_conv_ms, measure_latents)
            torch.cuda.empty_cache()          # the timing graphs' blocks (P: ~0.35 GB at 128 frames)
            conv_methods = {name: t["method"] for name, t in self.conv_timings.items()}
            log.info("codec: wide decoder convs (%s, %s), ms per call at %d frames: %s",
                     str(self.decode_dtype).removeprefix("torch."),
                     "channels_last" if decoder.channels_last else "default layout", MEASURE_FRAMES,
                     "; ".join(f"{name.removeprefix('model.')} {t['method']} (cudnn {t['cudnn_ms']:.3f}, "
                               f"gemm {t['gemm_ms']:.3f}"
                               + (f", triton {t['triton_ms']:.3f}" if "triton_ms" in t else "") + ")"
                               for name, t in self.conv_timings.items()))
        decoder.set_conv_methods(conv_methods)
        self.conv_methods = decoder.conv_methods()
        if measure and "triton" in self.conv_methods.values():
            with torch.no_grad():
                decoder.tune_triton(measure_latents)   # autotune at a long piece, not a warm-up's

    # -- decode ---------------------------------------------------------------------------------

    def check_codes(self, codes: Tensor) -> None:
        """ValueError unless codes [B, N, T]: row 0 in [0, Q_s), rows 1… in [0, Q_r)."""
        check_codes(codes, self.semantic_codebook_size, self.codebook_size, self.num_codebooks)

    def new_state(self, batch: int = 1) -> StreamState:
        """A fresh stream: position 0, zero conv tails, empty attention caches."""
        device, dtype = self.device, self.decode_dtype
        tensors: dict[str, Tensor] = {}
        for root in self._decode_modules():
            for module in root.modules():
                if isinstance(module, WindowedTransformer):
                    tensors.update(module.initial_state(batch, device, dtype))
                elif isinstance(module, Streaming):
                    initial = module.initial_state(batch, device, dtype)
                    if initial.shape[-1] > 0:
                        tensors[module.state_key] = initial
        return StreamState(torch.zeros(batch, dtype=torch.int64, device=device), tensors)

    @contextlib.contextmanager
    def cudnn_autotuned(self):
        """With the cudnn_benchmark decode option (CUDA): cuDNN times its algorithms for each conv
        shape the first time it sees it and keeps the fastest, instead of its heuristic choice,
        which runs some F16 shapes on generic kernels 10-1000x slower (prepare's docstring).
        Scoped to the decode path: every graph's warm-up tick runs it outside capture, so the
        captured kernels are the timed ones; the encode path (float32, a new length per
        reference clip) keeps the heuristic rather than paying the timing per clip length.
        A float32 decode also keeps cuDNN off TF32 here: timed, cuDNN takes TF32 kernels where they
        are faster (torch allows them by default), and float32 is the accuracy setting (on the H200
        a TF32 pick moved the tiny chaotic decoder by 2e-2 relative)."""
        if not self.decode_options.get("cudnn_benchmark"):
            yield
            return
        cudnn = torch.backends.cudnn
        saved = cudnn.benchmark, cudnn.benchmark_limit, cudnn.allow_tf32
        cudnn.benchmark, cudnn.benchmark_limit = True, self.cudnn_benchmark_limit
        cudnn.allow_tf32 = saved[2] and self.decode_dtype != torch.float32
        try:
            yield
        finally:
            cudnn.benchmark, cudnn.benchmark_limit, cudnn.allow_tf32 = saved

    def _step(self, codes: Tensor, state: StreamState) -> Tensor:
        """The next t frames of B streams: codes [B, N, t] -> float32 [B, t·frame_samples]."""
        z = self.quantizer.dequantize(codes).to(self.decode_dtype)       # [B, C, t]
        with self.cudnn_autotuned():
            z = self.quantizer.post_module.step(z, state)
            for stage in self.quantizer.upsample:                        # [B, C, 4t]
                z = step_sequence(stage, z, state)
            audio = self.decoder.step(z, state)                          # [B, 1, t·2048]
        state.position = state.position + codes.shape[-1]
        return audio[:, 0].float()

    @torch.inference_mode()
    def decode_streams(self, states: list[StreamState], chunks: list[Tensor]) -> list[Tensor]:
        """Decode one chunk for each of several single streams (the server's batched call).

        states: one single-stream state per chunk (updated in place); chunks: int64 [N, t_i].
        Returns float32 [t_i·frame_samples] per chunk. Validates every chunk before touching
        any state, so a bad chunk leaves all streams as they were.
        """
        for chunk in chunks:                 # on the host: no device syncs per codebook
            self.check_codes(torch.as_tensor(chunk)[None])
        device = self.device
        chunks = [torch.as_tensor(c).to(device=device, dtype=torch.int64) for c in chunks]
        outputs: list[Tensor | None] = [None] * len(chunks)
        if self.frame_serial:
            for index, (state, chunk) in enumerate(zip(states, chunks)):
                pieces = [self._step(chunk[None, :, i:i + 1], state) for i in range(chunk.shape[-1])]
                outputs[index] = (torch.cat(pieces, dim=-1)[0] if pieces
                                  else torch.zeros(0, device=device))
            return outputs
        by_length: dict[int, list[int]] = {}
        for index, chunk in enumerate(chunks):
            by_length.setdefault(chunk.shape[-1], []).append(index)
        for length, members in by_length.items():
            if length == 0:
                for index in members:
                    outputs[index] = torch.zeros(0, device=device)
                continue
            batch_state = StreamState.cat([states[i] for i in members])
            audio = self._step(torch.stack([chunks[i] for i in members]), batch_state)
            for row, (index, single) in enumerate(zip(members, batch_state.split())):
                states[index].position, states[index].tensors = single.position, single.tensors
                outputs[index] = audio[row]
        return outputs

    def decode(self, codes: Tensor) -> Tensor:
        """codes int [B, N, T] -> float32 PCM [B, T·frame_samples] in [-1, 1] (§7.4)."""
        codes = torch.as_tensor(codes)
        self.check_codes(codes)
        stream = self.stream(codes.shape[0])
        return torch.cat([stream.push(codes), stream.finish()], dim=-1)

    def stream(self, batch: int = 1) -> "StreamingDecoder":
        return StreamingDecoder(self, batch)

    # -- encode ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, pcm: Tensor, sample_rate: int) -> Tensor:
        """PCM float [B, S] (or [S]) at `sample_rate` -> codes int64 [B, N, ceil(S'/2048)].

        Resampled to the codec rate (S' samples), right-padded with zeros to whole frames, and
        run in float32 (§7.6).
        """
        pcm = torch.as_tensor(pcm)
        if pcm.dim() == 1:
            pcm = pcm[None]
        if pcm.dim() != 2:
            raise ValueError(f"pcm must be [B, S], got {list(pcm.shape)}")
        audio = resample(pcm.float(), int(sample_rate), self.sample_rate).to(self.device)
        frames = -(-audio.shape[-1] // self.frame_samples)
        if frames == 0:
            return torch.zeros(audio.shape[0], self.num_codebooks, 0, dtype=torch.int64)
        audio = F.pad(audio, (0, frames * self.frame_samples - audio.shape[-1]))
        z = self.encoder(audio[:, None])                                  # [B, C, 4T]
        z = self.quantizer.downsample(z)                                  # [B, C, T]
        z = self.quantizer.pre_module(z)
        return self.quantizer.quantize(z).cpu()


def decode_options_from_env(environ=None) -> dict[str, bool]:
    """DRAMA_CODEC_OPTIONS, e.g. "narrow_conv=0,channels_last=1": decode fast-path overrides for
    every `Codec.prepare` of the process (before/after comparisons on the GPU). Unset or empty:
    none. An unknown name or a value other than 0/1/true/false/on/off is a ValueError."""
    import os

    text = (os.environ if environ is None else environ).get("DRAMA_CODEC_OPTIONS", "")
    options: dict[str, bool] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip().lower()
        if name not in Codec.FAST_OPTIONS or value not in _SWITCH:
            raise ValueError(f"DRAMA_CODEC_OPTIONS: {part!r} is not name=0|1 with a name among "
                             f"{', '.join(Codec.FAST_OPTIONS)}")
        options[name] = _SWITCH[value]
    return options


_SWITCH = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


class StreamingDecoder:
    """B decode streams: push frames in order, get their samples at once (no lookahead)."""

    def __init__(self, codec: Codec, batch: int = 1):
        self.codec = codec
        self.states = [codec.new_state(1) for _ in range(batch)]
        self.frames = 0
        self.finished = False

    def push(self, codes: Tensor) -> Tensor:
        """codes int [B, N, t] -> float32 [B, t·frame_samples]."""
        if self.finished:
            raise RuntimeError("stream already finished")
        codes = torch.as_tensor(codes)
        self.codec.check_codes(codes)
        if codes.shape[0] != len(self.states):
            raise ValueError(f"stream has {len(self.states)} rows, got codes for {codes.shape[0]}")
        pieces = self.codec.decode_streams(self.states, list(codes.unbind(0)))
        self.frames += codes.shape[-1]
        return torch.stack(pieces).cpu()

    def finish(self) -> Tensor:
        """Ends the stream. The decoder holds nothing back, so this returns [B, 0]."""
        self.finished = True
        return torch.zeros(len(self.states), 0)


def load_codec(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> Codec:
    """Build the codec from `config.json`'s codec_config and `codec.pth` (§2.4, §2.5, §7.3).

    Weight norm is folded in float32, then the decode path is cast to `dtype` (default: float16
    on CUDA, float32 on CPU); encode always runs in float32.
    """
    checkpoint_dir = Path(checkpoint_dir)
    cfg = load_config(checkpoint_dir, check_tokenizer=False).codec   # the codec needs no tokenizer
    checkpoint = load_torch_state_dict(checkpoint_dir / "codec.pth")
    with torch.device("meta"):
        codec = Codec(cfg)
    weights, report = resolve_state_dict(codec, checkpoint)
    codec.load_state_dict(weights, strict=True, assign=True)
    codec.load_report = report
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    return codec.prepare(device, dtype)
