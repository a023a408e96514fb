"""Triton kernels compiled for a CUDA GPU on a machine without one, through their real
launchers: ``TRITON_INTERPRET=0 python -m infergraft.core.tools.kernel_bench.cubin``.

The launchers run on CPU tensors (shapes only: nothing is computed) while a stand-in
driver names the target (``--arch``, sm_90 by default) and each launch compiles instead of
running, with the ptxas Triton's wheel brings. A compile error, inline assembly ptxas
refuses, or registers spilled to local memory shows here, not in a GPU session's first
minutes. PDL launches as on sm_90. ``--set quant_mma`` (the default): the quantised decode
GEMMs ``INFERGRAFT_QUANT_MMA`` selects (``int4_mma``, ``fp8_mma``'s e4m3 and int8 rows, the
fused decode GEMMs' WORDS tiles) at the LLaMA-2-7B shapes (``--shapes small``: a few
small ones) and ``--rows``. ``--set int4_fused``: the fused decode layer's int4 GEMMs
(``kernels/int4_fused.py``) at ``--rows`` up to 8, beside the unfused GEMV. ``--set kv8``: decode and varlen attention over int8 / e4m3 K/V
under each ``INFERGRAFT_KV8_WIDEN`` mode (``kernels/kv8.py``), bf16 and fp16 q, MHA and
GQA at 132 SMs' plans (batch 16 x 4,032 tokens). Prints a line a kernel compiled (its name, the meta-parameters
that tell it apart, registers, spilled bytes, shared memory); exit 1 if any failed.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile

import torch

SMALL = {"qkv": (384, 256), "o": (128, 256), "gate_up": (704, 256), "down": (128, 352)}
SHOWN = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT", "FIXUP", "SWAP", "WORDS", "FP8", "W_FP8",
         "ASM", "SWIGLU", "ROPE", "NORM", "RESIDUAL", "PDL", "WIDEN", "ROWS", "GAMMA", "PERM")


class _Driver:
    """What Triton asks of its driver to compile: the target; no device is ever touched."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def compiling_for(arch: int = 90):
    """Inside it a Triton launch compiles for sm_``arch`` and returns without running;
    yields the list that collects (kernel name, its constexprs, the CompiledKernel)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from infergraft.kernels import (_triton, fp8_linear, fp8_mma, fused_linear, int4_fused,
                                    int4_gemv, int4_mma, linear, paged_attention,
                                    varlen_attention)
    if _triton.interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: kernels would be interpreted, not "
                           "compiled; run with TRITON_INTERPRET=0")
    compiled, real_run, saved = [], JITFunction.run, driver._active

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, {k: v for k, v in kwargs.items() if k in SHOWN},
                         kernel))
        return kernel

    # what the launchers ask of the device, answered as sm_90 would: PDL launches, e4m3 loads
    pdl = {"PDL": True, "launch_pdl": True}
    stand_ins = {(m, "pdl_launch"): lambda device: pdl
                 for m in (fp8_mma, int4_mma, linear, int4_gemv, int4_fused, paged_attention,
                           varlen_attention)}
    stand_ins.update({(m, "_sm_count"): lambda device: 132  # an H100's plans
                      for m in (paged_attention, varlen_attention)})
    stand_ins.update({(m, "fp8_native"): lambda device: arch >= 89
                      for m in (fp8_linear, fused_linear)})
    saved_fns = {key: getattr(*key) for key in stand_ins}
    driver.set_active(_Driver(arch))
    JITFunction.run = run
    for (m, name), fn in stand_ins.items():
        setattr(m, name, fn)
    try:
        yield compiled
    finally:
        JITFunction.run = real_run
        driver._active = saved
        for (m, name), fn in saved_fns.items():
            setattr(m, name, fn)


def resources(cubin: bytes) -> dict:
    """{REG, STACK, SHARED, LOCAL} of a cubin's one kernel (``cuobjdump``, beside ptxas)."""
    from triton import knobs

    tool = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100)")
    p.add_argument("--set", choices=("quant_mma", "kv8", "int4_fused"), default="quant_mma")
    p.add_argument("--modes", default="cvt,f16,words,words16", help="--set kv8's modes")
    p.add_argument("--shapes", choices=("llama2-7b", "small"), default="llama2-7b")
    p.add_argument("--rows", default="1,16,32,64")
    p.add_argument("--only", default="", help="labels containing this text only")
    args = p.parse_args(argv)
    from .gemms import LLAMA7B_GEMMS

    shapes = SMALL if args.shapes == "small" else \
        {s: LLAMA7B_GEMMS[s] for s in ("qkv", "o", "gate_up", "down")}
    rows = [int(r) for r in args.rows.split(",")]
    failed, seen = 0, set()
    with compiling_for(args.arch) as compiled:
        cases = kv8_cases(args.modes.split(",")) if args.set == "kv8" else \
            int4_fused_cases(shapes, rows) if args.set == "int4_fused" else \
            quant_mma_cases(shapes, rows)
        for label, call in cases:
            if args.only not in label:
                continue
            start = len(compiled)
            try:
                call()
            except Exception as err:  # a compile error: say which, go on
                failed += 1
                while err.__cause__ is not None:  # Triton's errors chain to the inner one
                    err = err.__cause__
                print(f"FAILED {label}: {type(err).__name__}: {str(err)[-1200:]}", flush=True)
                continue
            for name, meta, kernel in compiled[start:]:
                if kernel.hash in seen:
                    continue
                seen.add(kernel.hash)
                r = resources(kernel.asm["cubin"])
                cfg = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                               for k, v in sorted(meta.items()))
                print(f"{label:32s} {name} {cfg} warps={kernel.metadata.num_warps}: "
                      f"REG {r.get('REG')} LOCAL {r.get('LOCAL')} STACK {r.get('STACK')} "
                      f"SHARED {kernel.metadata.shared}", flush=True)
    print(f"{len(seen)} kernels compiled for sm_{args.arch}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
