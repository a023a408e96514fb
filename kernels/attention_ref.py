"""The torch attention the references share (``paged_attention_torch``,
``varlen_attention_torch``, the contiguous cache): ``F.scaled_dot_product_attention``,
or, with a logit softcap (Gemma 2: ``scores = cap * tanh(scores / cap)`` before the mask
and the softmax), the same product spelled out, since SDPA has no softcap."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(q, k, v, *, scale: float, attn_mask=None, is_causal: bool = False,
         softcap: float | None = None):
    """q [..., Hq, L, D], k and v [..., Hkv, S, D] (GQA: query head h reads kv head
    h // (Hq / Hkv)); ``attn_mask`` boolean, broadcast to [..., Hq, L, S], True where a
    query sees a key; ``is_causal``: SDPA's top-left causal mask. -> [..., Hq, L, D]."""
    if softcap is None:
        if q.dim() == 3:
            # torch's CPU flash kernel takes only 4-D inputs; 3-D ones fall to the math path
            # (scores materialised, several times slower on a long prompt)
            return sdpa(q[None], k[None], v[None], scale=scale, is_causal=is_causal,
                        attn_mask=attn_mask)[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    # scores in float32, capped, masked; softmax in float32 (as HF's eager attention)
    s = softcap * torch.tanh(q.float() @ k.float().transpose(-1, -2) * scale / softcap)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(),
                          float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return (s.softmax(-1).to(v.dtype) @ v).to(q.dtype)
