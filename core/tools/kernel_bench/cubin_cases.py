"""The kernels ``cubin.py`` compiles, a set each: (label, a call that launches) pairs whose
launchers run on CPU tensors (shapes only) under ``cubin.compiling_for``."""
from __future__ import annotations

import os

import torch

def quant_mma_cases(shapes: dict, rows: list[int]):
    """(label, a call that launches) for each GEMM ``INFERGRAFT_QUANT_MMA`` selects."""
    from infergraft.kernels import fused_linear as FL
    from infergraft.kernels.fp8_mma import rows_mma
    from infergraft.kernels.int4_mma import int4_mma

    e = torch.empty
    bf16, fp16 = torch.bfloat16, torch.float16
    for name, (n, k) in shapes.items():
        g = -(-k // 128)
        q4 = (e(n, k // 2, dtype=torch.uint8), e(n, g), e(n, g, dtype=torch.uint8))
        for m in rows:
            x = e(m, k, dtype=bf16)
            yield f"int4 {name} M={m}", lambda x=x, q4=q4, k=k: int4_mma(x, *q4, 128, k)
            for dt in (torch.float8_e4m3fn, torch.int8):
                w = e(n, k, dtype=dt)
                yield f"{dt} {name} M={m}", lambda x=x, w=w: rows_mma(x, w, e(w.shape[0]))
    n, k = next(iter(shapes.values()))
    x16 = e(1, k, dtype=fp16)
    yield "int4 fp16", lambda: int4_mma(x16, e(n, k // 2, dtype=torch.uint8),
                                        e(n, -(-k // 128)), e(n, -(-k // 128),
                                                              dtype=torch.uint8), 128, k)
    yield "int4 shifts", lambda: int4_mma(e(1, k, dtype=bf16), e(n, k // 2, dtype=torch.uint8),
                                          e(n, -(-k // 128)), e(n, -(-k // 128),
                                                                dtype=torch.uint8), 128, k,
                                          asm=False)
    for dt in (torch.float8_e4m3fn, torch.int8):
        yield f"{dt} fp16", lambda dt=dt: rows_mma(x16, e(n, k, dtype=dt), e(n))
    yield from fused_cases(FL, shapes, [m for m in rows if m <= FL.FUSE_MAX_ROWS])


def fused_cases(FL, shapes: dict, rows: list[int]):
    """The fused decode GEMMs on 8-bit rows through their WORDS tiles (``mma=True``)."""
    e = torch.empty
    (nq, k), (no, ko), (ni2, _), (nd, kd) = (shapes[s] for s in ("qkv", "o", "gate_up", "down"))
    d = 128
    hq = hkv = nq // d // 3  # LLaMA-2-7B's heads: q, k and v alike
    for dt in (torch.float8_e4m3fn, torch.int8):
        for m in rows:
            x, ss = e(m, k, dtype=torch.bfloat16), torch.ones(1, m)
            yield f"fused qkv {dt} M={m}", lambda x=x, ss=ss, dt=dt: FL.normed_linear_triton(
                x, e(nq, k, dtype=dt), None, ss, 1e-5, e(nq), mma=True)
            yield f"fused gate_up {dt} M={m}", lambda x=x, ss=ss, dt=dt: \
                FL.normed_swiglu_triton(x, e(ni2, k, dtype=dt), None, ss, 1e-5, e(ni2), mma=True)
            for label, (n, kk) in (("o", (no, ko)), ("down", (nd, kd))):
                xr, r = e(m, kk, dtype=torch.bfloat16), e(m, n, dtype=torch.bfloat16)
                yield f"fused {label} {dt} M={m}", lambda xr=xr, r=r, n=n, kk=kk, dt=dt: \
                    FL.linear_residual_triton(xr, e(n, kk, dtype=dt), None, r, sum_sq=True,
                                              scale=e(n), mma=True)
            if hq > 0:
                cache = e(4, 16, hkv, d, dtype=torch.bfloat16)
                cos = e(64, d // 2)
                pos = torch.zeros(m, dtype=torch.long)
                yield f"fused qkv+rope {dt} M={m}", lambda x=x, ss=ss, dt=dt, c=cache, \
                    cos=cos, pos=pos: FL.normed_qkv_rope_triton(
                        x, e(nq, k, dtype=dt), None, ss, 1e-5, cos, cos, pos, hq, c, c.clone(),
                        pos, pos, scale=e(nq), mma=True)


def int4_fused_cases(shapes: dict, rows: list[int]):
    """The fused decode layer's int4 GEMMs (group 128, the norm weight in the prologue;
    ``kernels/int4_fused.py``) at 1..8 rows, beside the unfused GEMV they replace
    (``int4_gemv``, its split-K reduce a second kernel), and with an act order's perm."""
    from infergraft.kernels import fused_linear as FL
    from infergraft.kernels.int4_format import Int4Weight
    from infergraft.kernels.int4_gemv import int4_gemv_triton

    e, bf16 = torch.empty, torch.bfloat16

    def int4(n, k, perm=False):
        g = -(-k // 128)
        return Int4Weight(e(n, k // 2, dtype=torch.uint8), e(n, g), e(n, g, dtype=torch.uint8),
                          128, k, bf16, torch.zeros(k, dtype=torch.long) if perm else None)

    (nq, k), (no, ko), (ni2, _), (nd, kd) = (shapes[s] for s in ("qkv", "o", "gate_up", "down"))
    d = 128
    hq = hkv = nq // d // 3
    for m in [r for r in rows if r <= 8]:
        x, ss, g = e(m, k, dtype=bf16), torch.ones(1, m), e(k, dtype=bf16)
        for name, (n, kk) in shapes.items():
            w = int4(n, kk)
            yield f"int4 gemv {name} M={m}", lambda w=w, kk=kk: int4_gemv_triton(
                e(m, kk, dtype=bf16), w.qweight, w.scales, w.zeros, 128, kk)
        yield f"int4 fused qkv M={m}", lambda x=x, ss=ss, g=g: FL.normed_linear_triton(
            x, int4(nq, k), None, ss, 1e-5, norm=g)
        yield f"int4 fused qkv perm M={m}", lambda x=x, ss=ss, g=g: FL.normed_linear_triton(
            x, int4(nq, k, perm=True), None, ss, 1e-5, norm=g)
        yield f"int4 fused gate_up M={m}", lambda x=x, ss=ss, g=g: FL.normed_swiglu_triton(
            x, int4(ni2, k), None, ss, 1e-5, norm=g)
        for label, (n, kk) in (("o", (no, ko)), ("down", (nd, kd))):
            xr, r = e(m, kk, dtype=bf16), e(m, n, dtype=bf16)
            yield f"int4 fused {label} M={m}", lambda xr=xr, r=r, n=n, kk=kk: \
                FL.linear_residual_triton(xr, int4(n, kk), None, r, sum_sq=True)
        if hq > 0:
            cache, cos = e(4, 16, hkv, d, dtype=bf16), e(64, d // 2)
            pos = torch.zeros(m, dtype=torch.long)
            yield f"int4 fused qkv+rope M={m}", lambda x=x, ss=ss, g=g, c=cache, cos=cos, \
                pos=pos: FL.normed_qkv_rope_triton(x, int4(nq, k), None, ss, 1e-5, cos, cos,
                                                   pos, hq, c, c.clone(), pos, pos, norm=g)


def moe_cases(rows: list[int]):
    """The fused layer's mixture of experts at few rows (``kernels/moe_decode.py``: route,
    gate_up + SiLU, down + residual) at the Qwen3-30B-A3B shape (128 experts, top 8)."""
    from infergraft.kernels.moe_decode import moe_decode_triton

    e, bf16 = torch.empty, torch.bfloat16
    h, experts, inter, top_k = 2048, 128, 768, 8
    weights = (e(experts, h, dtype=bf16), e(experts, 2 * inter, h, dtype=bf16),
               e(experts, h, inter, dtype=bf16))
    for m in rows:
        yield f"moe_decode M={m}", lambda m=m: moe_decode_triton(
            e(m, h, dtype=bf16), torch.ones(1, m), e(h, dtype=bf16), 1e-6, *weights, top_k, True)


def _under(mode: str, call):
    """``call`` run with ``INFERGRAFT_KV8_WIDEN=mode`` (read at launch), then as it was."""
    def run():
        saved = os.environ.get("INFERGRAFT_KV8_WIDEN")
        os.environ["INFERGRAFT_KV8_WIDEN"] = mode
        try:
            call()
        finally:
            if saved is None:
                del os.environ["INFERGRAFT_KV8_WIDEN"]
            else:
                os.environ["INFERGRAFT_KV8_WIDEN"] = saved
    return run


def kv8_cases(modes: list[str]):
    """(label, a call that launches) for decode and varlen attention over 8-bit K/V under
    each ``INFERGRAFT_KV8_WIDEN`` mode: batch 16 x 4,032 tokens, head_dim 128."""
    from infergraft.kernels.paged_attention import paged_attention_triton
    from infergraft.kernels.varlen_attention import varlen_attention_triton

    e = torch.empty
    b, d, bs, blocks = 16, 128, 16, 252
    tables = torch.zeros(b, blocks, dtype=torch.int32)
    lens = torch.full((b,), blocks * bs, dtype=torch.int32)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    for mode in modes:
        for qdt in (torch.bfloat16, torch.float16):
            for kdt in (torch.int8, torch.float8_e4m3fn):
                for hq, hkv in ((32, 32), (32, 8)):
                    kv = (*(e(b * blocks, bs, hkv, d, dtype=kdt) for _ in "kv"),
                          *(e(b * blocks, bs, hkv) for _ in "kv"))  # K, V, their scales
                    q, qv = e(b, hq, d, dtype=qdt), e(200, hq, d, dtype=qdt)

                    def decode(q=q, kv=kv):
                        paged_attention_triton(q, kv[0], kv[1], tables, lens, 0.1, None, *kv[2:])

                    def varlen(qv=qv, kv=kv):
                        varlen_attention_triton(qv, kv[0], kv[1], tables, cu, lens, 0.1, None,
                                                *kv[2:])

                    tag = f"kv8 {mode} {str(qdt)[6:]} {str(kdt)[6:]} {hq}/{hkv}"
                    yield f"{tag} decode", _under(mode, decode)
                    yield f"{tag} varlen", _under(mode, varlen)
