"""Readable float64 reference for the tower: one session's whole timeline, from scratch.

No caches, no slots, no batching: every layer runs over the full sequence with plain loops over
time and heads, straight from MODEL.md §4.4, §5.2 and §5.3. Tests compare the cached, batched,
step-by-step `model.forward_rows` against it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from services.tower.model import TowerModel


def naive_timeline(model: TowerModel, hidden: Tensor, frames: Tensor) -> dict[str, Tensor]:
    """Recompute every logit of one timeline.

    hidden [T, D] backbone rows; frames int64 [T, N]: row t's target frame (-1 = none; a drawn
    frame counts as the target of its row). Returns float64 `semantic_logits` [T, Q_s + 1] and
    `codebook_logits` [N - 1, T, Q_r] (entry j-1 predicts codebook j).
    """
    weights = {name: p.detach().to(torch.float64) for name, p in model.named_parameters()}
    x = hidden.to(torch.float64)
    semantic = x @ weights["semantic_head.weight"].T
    for s in range(len(model.shared_layers)):
        x = _layer(model, weights, f"shared_layers.{s}.", x)
    codebook_logits = []
    for j in range(len(model.residual_layers)):
        prefix = f"residual_layers.{j}."
        eps = model.rms_norm_eps
        embedding = torch.zeros_like(x)
        for t in range(x.shape[0]):
            code = int(frames[t, j])
            if code >= 0:
                embedding[t] = weights["codebook_embeddings.weight"][j * model.codebook_vocab_size + code]
        fused = torch.cat([_norm(embedding, weights[prefix + "pre_fc_norm_embedding.weight"], eps),
                           _norm(x, weights[prefix + "pre_fc_norm_hidden.weight"], eps)], dim=-1)
        x = _layer(model, weights, prefix, fused @ weights[prefix + "fc.weight"].T)
        codebook_logits.append(_norm(x, weights[prefix + "norm.weight"], eps) @ weights[prefix + "head.weight"].T)
    return {"semantic_logits": semantic, "codebook_logits": torch.stack(codebook_logits)}


def _norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * (1 + weight)


def _layer(model: TowerModel, w: dict[str, Tensor], prefix: str, x: Tensor) -> Tensor:
    eps = model.rms_norm_eps
    attn = model.get_submodule(prefix + "self_attn")
    h = x + _attention(attn, w, prefix + "self_attn.", _norm(x, w[prefix + "input_layernorm.weight"], eps))
    u = _norm(h, w[prefix + "post_attention_layernorm.weight"], eps)
    gate, up = u @ w[prefix + "mlp.gate_proj.weight"].T, u @ w[prefix + "mlp.up_proj.weight"].T
    return h + (gate * torch.sigmoid(gate) * up) @ w[prefix + "mlp.down_proj.weight"].T


def _attention(attn, w: dict[str, Tensor], prefix: str, u: Tensor) -> Tensor:
    n_q, n_kv, d, r = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary_dim
    eps = attn.q_norm.eps
    seq = u.shape[0]
    q_and_gate = (u @ w[prefix + "q_proj.weight"].T).view(seq, n_q, 2 * d)
    q, gate = q_and_gate[..., :d], q_and_gate[..., d:]
    k = (u @ w[prefix + "k_proj.weight"].T).view(seq, n_kv, d)
    v = (u @ w[prefix + "v_proj.weight"].T).view(seq, n_kv, d)
    q = _norm(q, w[prefix + "q_norm.weight"], eps)
    k = _norm(k, w[prefix + "k_norm.weight"], eps)
    q, k = _rope(q, r, attn.rope_theta), _rope(k, r, attn.rope_theta)

    out = torch.zeros(seq, n_q, d, dtype=torch.float64)
    for t in range(seq):
        for h in range(n_q):
            kv = h // (n_q // n_kv)
            scores = k[:t + 1, kv] @ q[t, h] / math.sqrt(d)                  # [t + 1]
            probs = torch.softmax(scores, dim=0)
            out[t, h] = probs @ v[:t + 1, kv]
    out = out * torch.sigmoid(gate)
    return out.reshape(seq, n_q * d) @ w[prefix + "o_proj.weight"].T


def _rope(x: Tensor, r: int, theta: float) -> Tensor:
    """NeoX pairs (i, i + r/2) of the first r dims rotated by position * theta^(-2i/r)."""
    out = x.clone()
    for t in range(x.shape[0]):
        for i in range(r // 2):
            angle = t * theta ** (-2 * i / r)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[t, :, i], x[t, :, i + r // 2]
            out[t, :, i], out[t, :, i + r // 2] = a * c - b * s, b * c + a * s
    return out
