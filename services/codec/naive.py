"""Naive float64 references for the codec (the readable siblings of the fast paths).

Written for reading, not speed: explicit sums over kernel taps, plain loops over queries,
heads and codebooks, the whole sequence at once (no streaming state). Same tensor layouts as
the fast functions. The only float32 step kept on purpose is the RoPE table, which the spec
defines as F32 angles rounded to BF16 (§7.2).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from services.codec.conv import CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock, ResidualUnit, Snake


def _f64(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().to(torch.float64)


# --------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------

def naive_fold_weight_norm(g: Tensor, v: Tensor) -> Tensor:
    """W[i] = g[i] · V[i] / ‖V[i]‖ for every dim-0 slice i, float64."""
    v, g = _f64(v), _f64(g).reshape(-1)
    out = torch.empty_like(v)
    for i in range(v.shape[0]):
        out[i] = g[i] * v[i] / math.sqrt(float((v[i] * v[i]).sum()))
    return out


def naive_snake(x: Tensor, alpha: Tensor) -> Tensor:
    x, alpha = _f64(x), _f64(alpha)
    return x + torch.sin(alpha * x) ** 2 / (alpha + 1e-9)


def naive_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int = 1,
                        dilation: int = 1, groups: int = 1) -> Tensor:
    """y[b, o, n] = bias[o] + Σ_taps j Σ_in i w[o, i, j] · x[b, i, n·s + j·d - (k_e - s)], zeros
    outside [0, L). One explicit term per tap and group (vectorised over n only)."""
    x, weight, bias = _f64(x), _f64(weight), _f64(bias)
    batch, c_in, length = x.shape
    c_out, c_in_group, kernel = weight.shape
    k_e = (kernel - 1) * dilation + 1
    n_out = math.ceil(length / stride)
    # zeros before the start (causal) and after the end (to complete the last window)
    padded = torch.cat([torch.zeros(batch, c_in, k_e - stride, dtype=torch.float64), x,
                        torch.zeros(batch, c_in, n_out * stride - length, dtype=torch.float64)], dim=-1)
    y = torch.zeros(batch, c_out, n_out, dtype=torch.float64)
    out_per_group = c_out // groups
    grouped_weight = weight.reshape(groups, out_per_group, c_in_group, kernel)
    for j in range(kernel):
        taps = padded[:, :, j * dilation: j * dilation + (n_out - 1) * stride + 1: stride]   # [B, C_in, n_out]
        taps = taps.reshape(batch, groups, c_in_group, n_out)
        y += torch.einsum("goi,bgin->bgon", grouped_weight[..., j], taps).reshape(batch, c_out, n_out)
    if bias is not None:
        y += bias[None, :, None]
    return y


def naive_causal_conv_transpose1d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int) -> Tensor:
    """Each input step t adds w[:, :, j]ᵀ x_t at output t·s + j; keep the first L·s outputs."""
    x, weight, bias = _f64(x), _f64(weight), _f64(bias)
    batch, _, length = x.shape
    _, c_out, kernel = weight.shape
    y = torch.zeros(batch, c_out, (length - 1) * stride + kernel, dtype=torch.float64)
    t = torch.arange(length)
    for j in range(kernel):
        y[:, :, t * stride + j] += torch.einsum("io,bit->bot", weight[:, :, j], x)
    y = y[..., : length * stride]
    if bias is not None:
        y += bias[None, :, None]
    return y


def naive_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x = _f64(x)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * _f64(weight)


def naive_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    x = _f64(x)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * _f64(weight) + _f64(bias)


def naive_rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotate interleaved pairs of x [B, T, H, h] by position·ω_i (F32 angles, BF16 cos/sin)."""
    x = _f64(x)
    h = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(h // 2):
        omega = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(base), dtype=torch.float32) ** (
            torch.tensor(2 * i, dtype=torch.float32) / h)
        angle = positions.to(torch.float32) * omega
        cos = torch.cos(angle).to(torch.bfloat16).to(torch.float64)[None, :, None]
        sin = torch.sin(angle).to(torch.bfloat16).to(torch.float64)[None, :, None]
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * cos - b * sin
        out[..., 2 * i + 1] = b * cos + a * sin
    return out


def naive_windowed_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """q/k/v [B, H, T, h], positions 0…T-1: row i attends to j ∈ [i-window+1, i]."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    batch, heads, length, h = q.shape
    out = torch.zeros_like(q)
    for b in range(batch):
        for head in range(heads):
            for i in range(length):
                first = max(0, i - window + 1)
                scores = k[b, head, first:i + 1] @ q[b, head, i] / math.sqrt(h)     # [keys]
                weights = torch.exp(scores - scores.max())
                out[b, head, i] = (weights / weights.sum()) @ v[b, head, first:i + 1]
    return out


# --------------------------------------------------------------------------------------------
# composite modules, walked through the fast modules' parameters
# --------------------------------------------------------------------------------------------

def naive_conv(module: CausalConv1d, x: Tensor) -> Tensor:
    return naive_causal_conv1d(x, module.conv.weight, module.conv.bias, module.stride,
                               module.dilation, module.groups)


def naive_conv_transpose(module: CausalConvTranspose1d, x: Tensor) -> Tensor:
    return naive_causal_conv_transpose1d(x, module.conv.weight, module.conv.bias, module.stride)


def naive_residual_unit(unit: ResidualUnit, x: Tensor) -> Tensor:
    snake1, conv7, snake2, conv1 = unit.block
    y = naive_conv(conv1, naive_snake(naive_conv(conv7, naive_snake(x, snake1.alpha)), snake2.alpha))
    return _f64(x) + y


def naive_convnext(block: ConvNeXtBlock, x: Tensor) -> Tensor:
    y = naive_conv(block.dwconv, x).transpose(1, 2)
    y = naive_layer_norm(y, block.norm.weight, block.norm.bias, block.norm.eps)
    y = y @ _f64(block.pwconv1.weight).T + _f64(block.pwconv1.bias)
    y = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    y = y @ _f64(block.pwconv2.weight).T + _f64(block.pwconv2.bias)
    return _f64(x) + (_f64(block.gamma) * y).transpose(1, 2)


def naive_windowed_transformer(module, x: Tensor) -> Tensor:
    """Channels-first x [B, C, T] -> [B, C, T], whole sequence."""
    x = _f64(x).transpose(1, 2)
    batch, length, _ = x.shape
    positions = torch.arange(length)
    for layer in module.layers:
        att = layer.attention
        h = naive_rms_norm(x, layer.attention_norm.weight, layer.attention_norm.eps)
        qkv = (h @ _f64(att.wqkv.weight).T).view(batch, length, 3, att.n_head, att.head_dim)
        q = naive_rope(qkv[:, :, 0], positions, module.rope_base)
        k = naive_rope(qkv[:, :, 1], positions, module.rope_base)
        y = naive_windowed_attention(q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, 2].transpose(1, 2),
                                     module.window)
        y = y.transpose(1, 2).reshape(batch, length, -1) @ _f64(att.wo.weight).T
        x = x + _f64(layer.attention_layer_scale.gamma) * y
        h = naive_rms_norm(x, layer.ffn_norm.weight, layer.ffn_norm.eps)
        ff = layer.feed_forward
        a, b = h @ _f64(ff.w1.weight).T, h @ _f64(ff.w3.weight).T
        x = x + _f64(layer.ffn_layer_scale.gamma) * ((a * torch.sigmoid(a) * b) @ _f64(ff.w2.weight).T)
    return naive_rms_norm(x, module.norm.weight, module.norm.eps).transpose(1, 2)


def _naive_sequence(modules, x: Tensor) -> Tensor:
    for module in modules:
        if isinstance(module, Snake):
            x = naive_snake(x, module.alpha)
        elif isinstance(module, CausalConv1d):
            x = naive_conv(module, x)
        elif isinstance(module, CausalConvTranspose1d):
            x = naive_conv_transpose(module, x)
        elif isinstance(module, ResidualUnit):
            x = naive_residual_unit(module, x)
        elif isinstance(module, ConvNeXtBlock):
            x = naive_convnext(module, x)
        elif isinstance(module, torch.nn.Tanh):
            x = torch.tanh(x)
        elif isinstance(module, torch.nn.Identity):
            pass
        elif hasattr(module, "layers"):
            x = naive_windowed_transformer(module, x)
        else:
            x = _naive_sequence(module.block if hasattr(module, "block") else module, x)
    return x


def naive_dequantize(codec, codes: Tensor) -> Tensor:
    """codes [B, N, T] -> z [B, C, T]: semantic part plus the residual sum, loop over codebooks."""
    books = codec.quantizer.codebooks
    residual = 0
    for q in range(1, len(books)):
        residual = residual + _naive_lookup(books[q], codes[:, q])
    return (_naive_lookup(books[0], codes[:, 0]) + residual).transpose(1, 2)


def _naive_lookup(vq, codes: Tensor) -> Tensor:
    rows = _f64(vq.codebook.weight)[codes]                                  # [B, T, d]
    return rows @ _f64(vq.out_proj.weight[..., 0]).T + _f64(vq.out_proj.bias)


def naive_decode(codec, codes: Tensor) -> Tensor:
    """codes [B, N, T] -> float64 [B, T·frame_samples], the whole sequence without state."""
    z = naive_dequantize(codec, codes)
    z = naive_windowed_transformer(codec.quantizer.post_module, z)
    for stage in codec.quantizer.upsample:
        z = _naive_sequence(stage, z)
    return _naive_sequence(codec.decoder.model, z)[:, 0]


def naive_encode_latents(codec, audio: Tensor) -> Tensor:
    """audio [B, S] at the codec rate, S a multiple of frame_samples -> z [B, C, T] before VQ."""
    z = _naive_sequence(codec.encoder.block, _f64(audio)[:, None])
    for stage in codec.quantizer.downsample:
        z = _naive_sequence(stage, z)
    return naive_windowed_transformer(codec.quantizer.pre_module, z)


def naive_quantize(codec, z: Tensor) -> Tensor:
    """z [B, C, T] -> codes [B, N, T]: per codebook, the best cosine, then subtract its vector."""
    residual = _f64(z).transpose(1, 2)
    codes = []
    for vq in codec.quantizer.codebooks:
        latents = residual @ _f64(vq.in_proj.weight[..., 0]).T + _f64(vq.in_proj.bias)
        book = _f64(vq.codebook.weight)
        cos = (latents / latents.norm(dim=-1, keepdim=True)) @ (book / book.norm(dim=-1, keepdim=True)).T
        code = cos.argmax(-1)
        codes.append(code)
        residual = residual - _naive_lookup(vq, code)
    return torch.stack(codes, 1)


def naive_resample(x: Tensor, orig_freq: int, new_freq: int, width: int = 6, rolloff: float = 0.99) -> Tensor:
    """Output sample m at time m/new: Σ_n x[n] · h(m/new - n/orig), h the Hann-windowed sinc
    with cutoff rolloff·min(orig, new), truncated at ±width zero crossings (float64, one loop)."""
    x = _f64(x)
    cutoff = min(orig_freq, new_freq) * rolloff
    n = torch.arange(x.shape[-1], dtype=torch.float64)
    out = torch.zeros(*x.shape[:-1], math.ceil(new_freq * x.shape[-1] / orig_freq), dtype=torch.float64)
    for m in range(out.shape[-1]):
        t = (m / new_freq - n / orig_freq) * cutoff                        # in zero crossings
        t = t.clamp(-width, width)
        window = torch.cos(t * math.pi / width / 2) ** 2
        sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(math.pi * t) / (math.pi * t))
        out[..., m] = (x * sinc * window).sum(-1) * cutoff / orig_freq
    return out
