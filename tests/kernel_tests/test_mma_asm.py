"""The inline assembly of the quantised MMA kernels (``int4_mma``: nibbles, ``fp8_mma``:
e4m3 and int8 bytes, into bf16 / fp16 pairs), run on the CPU by a small emulator of the
PTX instructions they use, against every value each byte or nibble can hold in each
position of its word. The GPU runs the same strings (tests/kernel_tests/test_*_mma.py's
CUDA cases, asm on); here a wrong shift, mask or ``prmt`` selector shows without one."""
import re

import numpy as np
import pytest
import torch

from infergraft.kernels import fp8_mma, int4_mma

M32 = 0xFFFFFFFF
HALF = {"bf16": torch.bfloat16, "f16": torch.float16}


def _halves_to_float(v, kind):
    # uint32 words [W] -> (low, high) 16-bit floats of ``kind`` as float64 arrays
    lo = torch.from_numpy((v & 0xFFFF).astype(np.int16)).view(HALF[kind]).double().numpy()
    hi = torch.from_numpy((v >> 16).astype(np.int16)).view(HALF[kind]).double().numpy()
    return lo, hi


def _float_to_half_bits(f, kind):
    # float64 array -> its 16-bit float bits (rounded to nearest even) as uint32
    return torch.from_numpy(f).to(HALF[kind]).view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


def _pack(lo, hi, kind):
    return _float_to_half_bits(lo, kind) | (_float_to_half_bits(hi, kind) << 16)


def _prmt(a, b, sel):
    # PTX prmt.b32 (default mode): byte i of d is byte sel_i & 7 of {b, a}, or its sign
    # replicated where sel_i & 8
    both = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = both[s & 7]
        if s & 8:
            byte = np.where(byte & 0x80, 0xFF, 0).astype(np.uint32)
        out |= byte << (8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1).astype(np.uint32) << bit
    return out


def run_asm(asm: str, word: np.ndarray, outputs: int) -> list[np.ndarray]:
    """Execute ``asm`` (inline assembly of one ``r`` input, $``outputs``, and ``outputs``
    16-bit ``h`` outputs) on uint32 words -> each output's 16 bits (uint32 arrays)."""
    regs = {f"${outputs}": word.astype(np.uint32)}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0x"):
            return np.full_like(word, int(tok, 16), dtype=np.uint32)
        if re.fullmatch(r"\d+", tok):
            return np.full_like(word, int(tok), dtype=np.uint32)
        return regs[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg") or not line:
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # unpack a pair
            dst, src = re.match(r"\{(.*)\},\s*(\S+)", rest).groups()
            lo, hi = (d.strip() for d in dst.split(","))
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        d, *args = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in args]
        if op == "mov.b32":
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & M32
        elif op in ("shr.b32", "shr.u32"):
            r = a[0] >> a[1]
        elif op == "lop3.b32":
            r = _lop3(a[0], a[1], a[2], int(args[3], 16))
        elif op == "prmt.b32":
            r = _prmt(a[0], a[1], int(args[2], 16))
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2", "sub.f16x2"):
            kind = op.split(".")[-1][:-2]
            (x0, x1), (y0, y1) = _halves_to_float(a[0], kind), _halves_to_float(a[1], kind)
            if op.startswith("sub"):
                r = _pack(x0 - y0, x1 - y1, kind)
            else:
                z0, z1 = _halves_to_float(a[2], kind)
                r = _pack(x0 * y0 + z0, x1 * y1 + z1, kind)
        elif op == "sub.f32":
            f = a[0].view(np.float32).astype(np.float64) - a[1].view(np.float32)
            r = f.astype(np.float32).view(np.uint32)
        elif op == "cvt.rn.bf16x2.f32":  # the first operand to the high half
            hi, lo = (x.view(np.float32).astype(np.float64) for x in a)
            r = _pack(lo, hi, "bf16")
        else:
            raise AssertionError(f"the emulator lacks {op!r}: {line}")
        regs[d] = r.astype(np.uint32)
    return [regs[f"${i}"] for i in range(outputs)]


def _words(gen, per: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Words whose field j (``bits`` wide, ``per`` a word) takes every value in turn, the
    others random: (words [W], fields [W, per])."""
    n = 1 << bits
    fields = torch.randint(0, n, (n * per, per), generator=gen).numpy().astype(np.uint32)
    for j in range(per):
        fields[j * n:(j + 1) * n, j] = np.arange(n)
    words = np.zeros(len(fields), dtype=np.uint32)
    for j in range(per):
        words |= fields[:, j] << (bits * j)
    return words, fields


def _as(bits, kind):
    return torch.from_numpy(bits.astype(np.int16)).view(HALF[kind]).double().numpy()


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_int4_nibbles_become_their_values(kind):
    words, nibbles = _words(torch.Generator().manual_seed(0), 8, 4)
    asm = int4_mma.ASM_BF16 if kind == "bf16" else int4_mma.ASM_FP16
    out = run_asm(asm, words, 8)
    for j in range(8):  # output j: nibble j (column 8w + j)
        np.testing.assert_array_equal(_as(out[j], kind), nibbles[:, j], err_msg=f"nibble {j}")


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_e4m3_bytes_become_their_values(kind):
    words, codes = _words(torch.Generator().manual_seed(1), 4, 8)
    asm = fp8_mma.ASM_E4M3_BF16 if kind == "bf16" else fp8_mma.ASM_E4M3_FP16
    out = run_asm(asm, words, 4)
    want = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
    finite = ~np.isnan(want)  # 0x7F, 0xFF: e4m3fn's NaNs (never a quantiser's code)
    for j in range(4):  # output j: byte j (column 4w + j), subnormals and -0 included
        got = _as(out[j], kind)
        np.testing.assert_array_equal(got[finite[:, j]], want[finite[:, j], j], err_msg=f"byte {j}")
        zero = finite[:, j] & (want[:, j] == 0)
        np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(want[zero, j]))


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_int8_bytes_become_their_values(kind):
    words, codes = _words(torch.Generator().manual_seed(2), 4, 8)
    asm = fp8_mma.ASM_INT8_BF16 if kind == "bf16" else fp8_mma.ASM_INT8_FP16
    out = run_asm(asm, words, 4)
    want = codes.astype(np.uint8).view(np.int8)
    for j in range(4):
        np.testing.assert_array_equal(_as(out[j], kind), want[:, j], err_msg=f"byte {j}")


def test_the_emulator_knows_prmt_and_lop3():
    a, b = np.array([0x44332211], np.uint32), np.array([0x88776655], np.uint32)
    assert _prmt(a, b, 0x4240)[0] == 0x55335511  # bytes a0, b0, a2, b0
    assert _prmt(a, b, 0x0008)[0] == 0x11111100  # a0's sign (0) replicated, then a0 thrice
    assert _lop3(np.array([0xF0], np.uint32), np.array([0xCC], np.uint32),
                 np.array([0xAA], np.uint32), 0xEA)[0] == 0xEA  # (a & b) | c
