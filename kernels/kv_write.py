"""Scatter new K/V rows into a cache: cache[idx0[t], idx1[t]] = kv[t].

The cache is any 4-D view ``[N0, N1, Hkv, D]`` (strides free): contiguous caches pass
(row, position), paged caches pass (block, offset).
"""
import torch

from ._triton import HAVE_TRITON, next_pow2, tl, triton


def kv_write_torch(k, v, k_cache, v_cache, idx0, idx1) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N0, N1, Hkv, D]; idx0, idx1: [T] int
    k_cache[idx0, idx1] = k.to(k_cache.dtype)
    v_cache[idx0, idx1] = v.to(v_cache.dtype)
