"""Contiguous KV cache (the default backend): one preallocated row per sequence.

Per layer K and V are ``[max_batch_size, Hkv, max_seq_len, D]``; a sequence owns one
row for its whole life, and token ``p`` lives at column ``p``. With ``kv-int8`` /
``kv-fp8`` they are int8 / e4m3 plus float32 scales ``[max_batch_size, Hkv, max_seq_len]``
(``contiguous_store``).

Sliding-window models (every layer's window ``W < max_seq_len``) get a rolling buffer
instead: rows are ``W`` columns wide and token ``p`` lives at column ``p % W``, so memory
stops growing at the window. The query at ``p`` sees keys ``p-W+1 .. p`` (HF's
convention), which is exactly what the ring holds once ``p`` is written. Where only some
layers have a window (Gemma's local layers between global ones) rows stay full width and
those layers mask what is behind it. Each layer's scale, window and softcap:
``spec.layer_attention(layer)``.
"""
from __future__ import annotations

import numbers

import torch

from infergraft.core.cache import CacheBackend, CacheFullError, KVCache
from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.spec import ATTENTION_FEATURES
from infergraft.kernels.attention_ref import sdpa
from infergraft.kernels.kv_write import KV_STORAGE_DTYPES

from .contiguous_graph import ContiguousGraphInputs, ContiguousMeta, DeviceDecodeMeta
from .contiguous_store import RowStore


class ContiguousCache(ContiguousGraphInputs, KVCache):
    def __init__(self, spec, max_batch_size, max_seq_len, device, dtype, ops, kv_quantizer=None):
        self.spec, self.ops, self.device = spec, ops, torch.device(device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.layer_attn = [spec.layer_attention(i) for i in range(spec.num_layers)]
        windows = {a.window for a in self.layer_attn}
        w = windows.pop() if len(windows) == 1 else None  # a ring: one window for all
        # a window at least max_seq_len long never hides anything: plain full attention
        self.window = w if w is not None and w < max_seq_len else None
        self.width = self.window or max_seq_len  # columns per row
        # decode through tensor-only metadata and the paged-attention op (CUDA graphs)
        self.device_decode = self.device.type == "cuda"
        shape = (max_batch_size, spec.num_kv_heads, self.width, spec.head_dim)
        self.kv = RowStore(spec.num_layers, shape, dtype=dtype, device=self.device, ops=ops,
                           kv_dtype=kv_quantizer and KV_STORAGE_DTYPES[kv_quantizer.kv_dtype])
        self._free_rows = list(range(max_batch_size))
        self._row: dict = {}
        self._len: dict = {}

    # -- allocation ------------------------------------------------------------
    def can_allocate(self, num_tokens):
        return bool(self._free_rows) and num_tokens <= self.max_seq_len

    def allocate(self, seq_id, num_tokens):
        if seq_id in self._row:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if num_tokens > self.max_seq_len:
            raise CacheFullError(f"{num_tokens} tokens exceed max_seq_len={self.max_seq_len}")
        if not self._free_rows:
            raise CacheFullError(f"all {self.max_batch_size} rows are in use (max_batch_size)")
        self._row[seq_id] = self._free_rows.pop(0)
        self._len[seq_id] = 0

    def free(self, seq_id):
        self._free_rows.append(self._row.pop(seq_id))
        self._free_rows.sort()
        del self._len[seq_id]

    def length(self, seq_id):
        return self._len[seq_id]

    @property
    def supports_truncate(self) -> bool:
        """Full rows: a token past the length is never read. A rolling window's ring has
        overwritten keys a rolled-back query would still see."""
        return self.window is None

    def truncate(self, seq_id, length):
        if self.window is not None:
            raise NotImplementedError(f"the contiguous cache's rolling window ({self.window} "
                                      "columns) cannot roll back overwritten keys")
        if not 0 <= length <= self._len[seq_id]:
            raise ValueError(f"sequence {seq_id!r} holds {self._len[seq_id]} tokens; it "
                             f"cannot be truncated to {length}")
        self._len[seq_id] = length

    def fork(self, parent, child):
        """The child gets its own row, a copy of the parent's (no sharing in this layout)."""
        src = self._row[parent]  # KeyError for an unknown parent, before anything changes
        self.allocate(child, 1)  # raises CacheFullError when no row is free
        self.kv.copy_row(src, self._row[child])  # K, V and scales
        self._len[child] = self._len[parent]

    # -- one forward step ------------------------------------------------------
    def _check_step(self, seq_ids, counts):
        """Raise for a step that cannot run, before anything changes (a refused step
        leaves the cache as it was)."""
        if len(seq_ids) != len(counts) or not seq_ids:
            raise ValueError(f"a step needs one count per sequence and at least one "
                             f"sequence, got {len(seq_ids)} ids and {len(counts)} counts")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequences in a step: {list(seq_ids)}")
        for s, n in zip(seq_ids, counts):
            if s not in self._len:
                raise KeyError(f"sequence {s!r} is not allocated")
            if not isinstance(n, numbers.Integral) or n < 1:
                raise ValueError(f"sequence {s!r}: a step adds an integer >= 1 tokens, got {n!r}")
            if self._len[s] + n > self.max_seq_len:
                raise CacheFullError(f"sequence {s!r} would hold {self._len[s] + n} tokens, "
                                     f"over max_seq_len={self.max_seq_len}")

    def prepare(self, seq_ids, counts):
        self._check_step(seq_ids, counts)
        if self.device_decode and all(n == 1 for n in counts):
            meta = self.static_decode_meta(len(seq_ids))
            self.prepare_decode_into(meta, seq_ids)
            return meta
        rows, starts = [self._row[s] for s in seq_ids], [self._len[s] for s in seq_ids]
        for s, start, n in zip(seq_ids, starts, counts):
            self._len[s] = start + n
        positions = torch.cat([torch.arange(st, st + n) for st, n in zip(starts, counts)])
        row_index = torch.repeat_interleave(torch.tensor(rows), torch.tensor(counts))
        span = None
        if rows == list(range(rows[0], rows[0] + len(rows))):
            span = slice(rows[0], rows[0] + len(rows))
        dev = self.device
        decode = all(n == 1 for n in counts)
        ring = {}
        if self.window is not None:
            w, keep = self.window, None
            if max(counts) > w:
                # more new tokens than columns would write several to one column: keep
                # each sequence's last W (the others are outside every later window)
                keep, off = [], 0
                for n in counts:
                    keep.extend(range(off + max(0, n - w), off + n))
                    off += n
                keep = torch.tensor(keep, device=dev)
            ring = dict(slots=(positions % w).to(dev), keep=keep,
                        row_ids=torch.tensor(rows, device=dev))
        return ContiguousMeta(positions.to(dev), rows, starts, list(counts), row_index.to(dev),
                              decode, span, **ring)

    def attention(self, layer, q, k, v, meta):
        if isinstance(meta, DeviceDecodeMeta):
            return self._device_decode(layer, q, k, v, meta)
        if self.window is not None:
            return self._ring_attention(layer, q, k, v, meta)
        self.kv.write(layer, k, v, meta.row_index, meta.positions)  # (row, position)
        if meta.decode and meta.row_span is not None:
            return self._decode_batched(layer, q, meta, window=self.layer_attn[layer].window)
        out = torch.empty_like(q)
        off = 0
        for j, (start, n) in enumerate(zip(meta.starts, meta.counts)):
            qj = q[off:off + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if start == 0 and not self.kv.quant:  # a fresh prompt: its K/V are this step's own
                kj = k[off:off + n].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
                vj = v[off:off + n].transpose(0, 1).unsqueeze(0)
            else:  # [1, Hkv, start+n, D] each, in the model dtype
                row = meta.rows[j]
                kj, vj = self.kv.load(layer, slice(row, row + 1), slice(0, start + n))
            out[off:off + n] = self._attend(layer, qj, kj, vj, 0, start, n)[0].transpose(0, 1)
            off += n
        return out

    def _decode_batched(self, layer, q, meta, rows=None, lens=None, window=None):
        """One query a row over the first ``lens[b]`` columns of rows ``rows``; ``window``
        (full-width rows): only keys at positions > length - 1 - window."""
        rows = meta.row_span if rows is None else rows  # a slice, or [B] row ids (a gather)
        lens = [s + 1 for s in meta.starts] if lens is None else lens
        longest = max(lens)
        kb, vb = self.kv.load(layer, rows, slice(0, longest))  # [B, Hkv, L, D]
        mask = None
        if min(lens) != longest or (window is not None and window < longest):
            pos, ends = torch.arange(longest, device=q.device), torch.tensor(lens, device=q.device)
            mask = pos < ends[:, None]  # ragged: hide each row's unused tail
            if window is not None:
                mask &= pos > ends[:, None] - 1 - window
            mask = mask[:, None, None, :]  # [B, 1, 1, L]
        a = self.layer_attn[layer]
        out = sdpa(q.unsqueeze(2), kb, vb, attn_mask=mask, scale=a.scale, softcap=a.softcap)
        return out.squeeze(2)  # [B, Hq, D]

    def _attend(self, layer, q, k, v, first, start, n):
        """Queries at start .. start+n-1 over keys at first .. start+n-1: causal, and
        banded where the layer has a window."""
        a = self.layer_attn[layer]
        w = a.window
        if first == 0 and start == 0 and (w is None or n <= w):  # plain causal
            return sdpa(q, k, v, is_causal=True, scale=a.scale, softcap=a.softcap)
        qpos = torch.arange(start, start + n, device=q.device)[:, None]
        kpos = torch.arange(first, start + n, device=q.device)[None, :]
        mask = kpos <= qpos  # [n, start-first+n]
        if w is not None:
            mask &= kpos > qpos - w
        return sdpa(q, k, v, attn_mask=mask, scale=a.scale, softcap=a.softcap)

    # -- rolling buffer (sliding window) ----------------------------------------
    def _ring_attention(self, layer, q, k, v, meta):
        w = self.window
        if meta.decode:  # write first: the ring then holds exactly positions p-W+1 .. p
            self.kv.write(layer, k, v, meta.row_index, meta.slots)
            rows = meta.row_span if meta.row_span is not None else meta.row_ids
            return self._decode_batched(layer, q, meta, rows, [min(s + 1, w) for s in meta.starts])
        # prefill: attend on (ring contents still in the window) + fresh k/v, then write,
        # since the fresh tokens may overwrite columns that earlier queries still need;
        # fresh k/v as they will be stored (int8 / e4m3: quantised), like the other paths see them
        fresh_k, fresh_v = self.kv.as_stored(k), self.kv.as_stored(v)  # [T, Hkv, D]
        out = torch.empty_like(q)
        off = 0
        for row, start, n in zip(meta.rows, meta.starts, meta.counts):
            qj = q[off:off + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kj = fresh_k[off:off + n].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
            vj = fresh_v[off:off + n].transpose(0, 1).unsqueeze(0)
            first = max(0, start - w + 1)  # oldest position the first query sees
            if start > 0:
                cols = torch.arange(first, start, device=q.device) % w  # oldest first
                kr, vr = self.kv.load(layer, slice(row, row + 1), cols)  # [1, Hkv, start-first, D]
                kj, vj = torch.cat([kr, kj], dim=2), torch.cat([vr, vj], dim=2)
            out[off:off + n] = self._attend(layer, qj, kj, vj, first, start, n)[0].transpose(0, 1)
            off += n
        i = slice(None) if meta.keep is None else meta.keep
        self.kv.write(layer, k[i], v[i], meta.row_index[i], meta.slots[i])
        return out

    # -- inspection ------------------------------------------------------------
    def _held(self, seq_id) -> int:
        """Columns a sequence occupies: its length, capped at the ring width."""
        return min(self._len[seq_id], self.width)

    def read(self, seq_id, layer):
        """K, V of the positions still held, oldest first, in the model dtype (int8 / e4m3
        dequantised): ([L, Hkv, D], [L, Hkv, D])."""
        row, n = self._row[seq_id], self._len[seq_id]
        cols = slice(0, n) if self.window is None else \
            torch.arange(n - self._held(seq_id), n, device=self.device) % self.width
        k, v = self.kv.load(layer, slice(row, row + 1), cols)  # [1, Hkv, L, D]
        return k[0].transpose(0, 1), v[0].transpose(0, 1)

    def stats(self):
        held = [self._held(s) for s in self._row]
        return {"bytes": self.kv.nbytes, "sequences": len(self._row),
                "tokens": sum(self._len.values()), "free_rows": len(self._free_rows),
                # storage accounting: K/V columns held (<= slots_per_row per sequence)
                "slots": sum(held), "max_slots_per_sequence": max(held, default=0),
                "slots_per_row": self.width}


class ContiguousBackend(CacheBackend):
    name = "contiguous"
    options = {}
    attention_features = tuple(ATTENTION_FEATURES)  # layer_attention's scale, window, softcap
    quantized_kv = tuple(KV_STORAGE_DTYPES)  # bytes_per_token (base class) counts them + scales

    def create(self, spec, plan, *, device, dtype, ops, kv_quantizer=None):
        if kv_quantizer is not None and kv_quantizer.kv_dtype not in self.quantized_kv:
            raise PlanError(f"{self.name}: cannot store K/V as {kv_quantizer.kv_dtype!r} "
                            f"(quantizer {kv_quantizer.name!r}); supported: "
                            f"{', '.join(self.quantized_kv)}")
        return ContiguousCache(spec, plan.max_batch_size, plan.max_seq_len, device, dtype, ops,
                               kv_quantizer=kv_quantizer)

    def device_bytes(self, plan, **_):
        """A sliding-window model's rows are a ring of W columns, not max_seq_len."""
        w = plan.sliding_window
        width = min(w, plan.max_seq_len) if w else plan.max_seq_len
        return plan.kv_bytes_per_token * width * plan.max_batch_size


@hookimpl
def infergraft_register_cache_backends(register):
    register(ContiguousBackend())
