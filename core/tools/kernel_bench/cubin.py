"""Triton kernels compiled for a CUDA GPU on a machine without one, through their real
launchers: ``TRITON_INTERPRET=0 python -m infergraft.core.tools.kernel_bench.cubin``.

The launchers run on CPU tensors (shapes only: nothing is computed) while a stand-in
driver names the target (``--arch``, sm_90 by default) and each launch compiles instead of
running, with the ptxas Triton's wheel brings. A compile error, inline assembly ptxas
refuses, or registers spilled to local memory shows here, not in a GPU session's first
minutes. PDL launches as on sm_90. The sets (``--set``; their cases: cubin_cases.py):
- ``quant_mma`` (the default): the quantised decode GEMMs ``INFERGRAFT_QUANT_MMA`` selects
  (``int4_mma``, ``fp8_mma``'s e4m3 and int8 rows, the fused decode GEMMs' WORDS tiles) at
  the LLaMA-2-7B shapes (``--shapes small``: a few small ones) and ``--rows``;
- ``int4_fused``: the fused decode layer's int4 GEMMs (``kernels/int4_fused.py``) at
  ``--rows`` up to 8, beside the unfused GEMV;
- ``moe``: the fused layer's mixture of experts at few rows (``kernels/moe_decode.py``) at
  Qwen3-30B-A3B's shape;
- ``kv8``: decode and varlen attention over int8 / e4m3 K/V under each
  ``INFERGRAFT_KV8_WIDEN`` mode (``kernels/kv8.py``), bf16 and fp16 q, MHA and GQA at 132
  SMs' plans (batch 16 x 4,032 tokens).
Prints a line a kernel compiled (its name, the meta-parameters that tell it apart,
registers, spilled bytes, shared memory); exit 1 if any failed.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile


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
                                    int4_gemv, int4_mma, linear, moe_decode,
                                    paged_attention, varlen_attention)
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
                           varlen_attention, moe_decode)}
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100)")
    p.add_argument("--set", choices=("quant_mma", "kv8", "int4_fused", "moe"),
                   default="quant_mma")
    p.add_argument("--modes", default="cvt,f16,words,words16", help="--set kv8's modes")
    p.add_argument("--shapes", choices=("llama2-7b", "small"), default="llama2-7b")
    p.add_argument("--rows", default="1,16,32,64")
    p.add_argument("--only", default="", help="labels containing this text only")
    args = p.parse_args(argv)
    from .cubin_cases import int4_fused_cases, kv8_cases, moe_cases, quant_mma_cases
    from .gemms import LLAMA7B_GEMMS

    shapes = SMALL if args.shapes == "small" else \
        {s: LLAMA7B_GEMMS[s] for s in ("qkv", "o", "gate_up", "down")}
    rows = [int(r) for r in args.rows.split(",")]
    failed, seen = 0, set()
    with compiling_for(args.arch) as compiled:
        cases = kv8_cases(args.modes.split(",")) if args.set == "kv8" else \
            int4_fused_cases(shapes, rows) if args.set == "int4_fused" else \
            moe_cases(rows) if args.set == "moe" else \
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
