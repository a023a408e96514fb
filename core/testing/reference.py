"""The float64 attention the cache kits compare a backend's with (``cache_kit``,
``cache_machine``): each query over the keys it sees, a layer's scale, window and softcap
as ``spec.layer_attention(layer)`` gives them."""
from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, start, window=None, *, scale=None, softcap=None):
    """q: [n, Hq, D] at positions start.. over k, v: [start+n, Hkv, D] -> [n, Hq, D]
    (``scale``: None for 1 / sqrt(D); ``softcap``: scores capped to c * tanh(s / c);
    a layer's three: ``spec.layer_attention(layer)``)."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [Hq, n, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    seen = kpos <= qpos
    if window:
        seen &= kpos > qpos - window
    p = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v)
