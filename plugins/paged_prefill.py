"""Prefill-step attention of the paged cache (the decode step is the Triton kernel):
per sequence, torch SDPA over its fresh K/V (a new prompt) or the K/V gathered from its
blocks (a chunk, a prompt after a preemption, int8); the decode tokens riding along
(one token on a cached prefix) go through the decode kernel, all in one call."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def is_rider(start: int, n: int) -> bool:
    """A decode token riding in a prefill step: one token on a cached prefix."""
    return n == 1 and start > 0


def first_rows(counts) -> list[int]:
    """Each sequence's first row in the step's token dimension (sequences in order)."""
    return [0, *itertools.accumulate(counts)][:len(counts)]


def riders_of(starts, counts, device):
    """(rows [R], sequence indices [R]) of a prefill step's riders on ``device``, or None
    when it has none; built once per step (``prepare``): built in every layer, their
    host-to-device copy would stall the host each time."""
    riders = [(row, j) for j, (row, start, n) in enumerate(zip(first_rows(counts), starts, counts))
              if is_rider(start, n)]
    if not riders:
        return None
    rows, seqs = zip(*riders)
    return tuple(torch.tensor([rows, seqs]).to(device))  # [R] rows, [R] sequence indices


class PagedPrefillAttention:
    """Mixed into ``PagedCache``: needs its k/v pools, tables and ``_first_live``."""

    def _prefill_attention(self, layer, q, k, v, meta):
        # q: [T, Hq, D], k, v: [T, Hkv, D] (already written) -> [T, Hq, D]
        out = torch.empty_like(q)
        # decode tokens riding along (one token on a cached prefix): one decode-kernel call
        # for all of them; gathering each one's K/V for its own SDPA copied every rider's
        # whole context per layer (batch 64: TTFT 3.8 s vs HF's 0.93)
        if meta.riders is not None:
            rows, seqs = meta.riders  # [R] each, built once per step (riders_of)
            scales = (self.k_scale[layer], self.v_scale[layer]) if self.quant else (None, None)
            out[rows] = self.ops.paged_attention(
                q[rows], self.k[layer], self.v[layer], meta.block_tables[seqs],
                meta.context_lens[seqs], self.scale, self.window, *scales, counters=self.counters)
        for j, (start, n, off) in enumerate(zip(meta.starts, meta.counts, first_rows(meta.counts))):
            if is_rider(start, n):
                continue  # done above
            if start == 0 and not self.quant:  # a fresh prompt: its K/V are this step's own
                kj, vj = k[off:off + n], v[off:off + n]  # [n, Hkv, D], what was just written
            else:  # keys from the first block still in the window: [L, Hkv, D]
                first = self._first_live(start)
                kj, vj = self._gather(layer, meta.tables[j][first:], start + n - first * self.block_size)
            qj = q[off:off + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            oj = self._sdpa(qj, kj.transpose(0, 1).unsqueeze(0), vj.transpose(0, 1).unsqueeze(0),
                            start, n)
            out[off:off + n] = oj[0].transpose(0, 1)
        return out

    def _gather(self, layer, table, length):
        """A sequence's K and V ([length, Hkv, D], self.dtype) from its storage blocks."""
        hkv, d = self.spec.num_kv_heads, self.spec.head_dim
        k = self.k[layer][table].reshape(-1, hkv, d)[:length]
        v = self.v[layer][table].reshape(-1, hkv, d)[:length]
        if self.quant:
            k = (k.float() * self.k_scale[layer][table].reshape(-1, hkv, 1)[:length]).to(self.dtype)
            v = (v.float() * self.v_scale[layer][table].reshape(-1, hkv, 1)[:length]).to(self.dtype)
        return k, v

    def _sdpa(self, q, k, v, start, n):
        # k, v: the last L keys of the start + n (older ones are out of every window)
        if start == 0 and not self.window:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                  enable_gqa=True)
        qpos = torch.arange(start, start + n, device=q.device)[:, None]
        kpos = torch.arange(start + n - k.shape[-2], start + n, device=q.device)[None, :]
        mask = kpos <= qpos  # [n, L]
        if self.window:
            mask &= kpos > qpos - self.window
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=True)
