"""The quantised MMA kernels compile for sm_90 on this machine, GPU or not
(``core/tools/kernel_bench/cubin.py``: their launchers on CPU tensors, a stand-in driver,
Triton's own ptxas): each kernel family and widening (int4 nibbles; e4m3 and int8 bytes, in
bf16 and fp16; the fused GEMMs' WORDS tiles, qkv + RoPE too) assembles, spilling nothing.
Past ptxas, only a GPU tells whether they compute right (their tests' CUDA cases)."""
import os
import re
import subprocess
import sys

import pytest

from infergraft.kernels._triton import HAVE_TRITON


def _ptxas() -> bool:
    try:
        from triton import knobs

        return os.path.exists(knobs.nvidia.ptxas.path)
    except Exception:  # no NVIDIA backend in this Triton
        return False


def _assemble(tmp_path, *args, timeout=300) -> tuple[str, list[str]]:
    """``kernel_bench.cubin`` with ``args`` in a fresh Triton cache, none failing: (its
    output, the lines of its kernels' register counts)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "infergraft.core.tools.kernel_bench.cubin",
                          *args], env=env, capture_output=True, text=True, timeout=timeout)
    out = run.stdout
    assert run.returncode == 0 and "0 failed" in out, out[-3000:] + run.stderr[-3000:]
    return out, [line for line in out.splitlines() if "REG" in line]


@pytest.mark.skipif(not (HAVE_TRITON and _ptxas()), reason="needs Triton's NVIDIA backend")
def test_the_quant_mma_kernels_assemble_for_sm90_without_spills(tmp_path):
    out, lines = _assemble(tmp_path, "--shapes", "small", "--rows", "1")
    kernels = {re.search(r" (_\w+_kernel) ", line)[1] for line in lines}
    assert kernels == {"_int4_mma_kernel", "_rows_mma_kernel", "_skinny_gemm_kernel"}, out
    assert any("ROPE=1" in line and "WORDS=1" in line for line in lines), out
    assert len(lines) >= 18, out  # every family, both 16-bit types, both 8-bit formats
    spilled = [line for line in lines if not re.search(r"LOCAL 0 STACK 0", line)]
    assert not spilled, "\n".join(spilled)


@pytest.mark.skipif(not (HAVE_TRITON and _ptxas()), reason="needs Triton's NVIDIA backend")
def test_the_kv8_attention_modes_assemble_for_sm90_without_spills(tmp_path):
    # decode attention, MHA (LLaMA-2-7B), bf16 and fp16 q, both 8-bit formats under each
    # INFERGRAFT_KV8_WIDEN mode besides cvt (the word modes' four inline assemblies)
    out, lines = _assemble(tmp_path, "--set", "kv8", "--modes", "f16,words,words16",
                           "--only", "32/32 decode", timeout=600)
    assert {re.search(r"WIDEN=(\d)", line)[1] for line in lines} == {"1", "2", "3"}, out
    assert len(lines) == 12 and all("_paged_decode_kernel" in line for line in lines), out
    spilled = [line for line in lines if not re.search(r"LOCAL 0 ", line)]
    assert not spilled, "\n".join(spilled)


@pytest.mark.skipif(not (HAVE_TRITON and _ptxas()), reason="needs Triton's NVIDIA backend")
def test_the_moe_decode_kernels_assemble_for_sm90_without_spills(tmp_path):
    # the fused layer's mixture of experts at one and two rows (route, gate_up, down)
    out, lines = _assemble(tmp_path, "--set", "moe", "--rows", "1,2")
    kernels = {re.search(r" (_\w+_kernel) ", line)[1] for line in lines}
    assert kernels == {"_route_kernel", "_gate_up_kernel", "_down_kernel"}, out
    spilled = [line for line in lines if not re.search(r"LOCAL 0 STACK 0", line)]
    assert not spilled, "\n".join(spilled)
