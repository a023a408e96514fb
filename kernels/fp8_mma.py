"""e4m3 decode GEMM on the tensor cores, the bytes widened to bf16 by bit tricks (W8A16).

The skinny kernel widens e4m3 tiles with Triton's convert (``.to(x.dtype)``), which on
sm_90 has no single bf16 instruction; at decode the widening's instructions a byte bound
the loop. Here W is read as 32-bit words of four e4m3 bytes and each pair of bytes becomes
a pair of bf16 with integer ops only: an e4m3 byte s eeee mmm placed as bf16 bits s at 15
and eeee mmm at 10-4 reads as its value times 2^-120 (exponent bias 7 against 127; an
e4m3 subnormal lands on a bf16 subnormal of the same digits), and one packed multiply by
2^120 (exact) restores it: per word two `lop3`, three shifts, two masks, two `fma`.
Byte j of word w is column 4w + j, so a K tile's dot is 4 dots (byte j of every word
against x's columns 4w + j, split from x's tile in registers); the row scale is applied
once, in the epilogue. fp16 x takes the same path, the bf16 values widened to fp16 after.

Split-K: ``split_k.py`` (partials [S, M, N] summed by the last split of a column tile).
"""
import torch

from ._triton import HAVE_TRITON, interpreting, next_pow2, pdl_launch, pdl_release, \
    pdl_wait, tl, triton
from .split_k import auto_split, finish, outputs, splits, store_tile

BLOCK_K = 128  # bytes of a row a K step reads: 32 words, four dots of K = 32
MAX_ROWS = 64

# bytes (0, 2) and (1, 3) of a word into bf16 pairs (value * 2^-120), then * 2^120
# (0x7b80 is 2^120 in bf16; + -0 keeps the product): lop3 0xEA is (a & b) | c
ASM_E4M3_BF16 = """{
.reg .b32 t, u, r02, r13;
and.b32 t, $4, 0x007f007f;
shl.b32 t, t, 4;
shl.b32 u, $4, 8;
lop3.b32 r02, u, 0x80008000, t, 0xea;
shr.b32 u, $4, 4;
and.b32 u, u, 0x07f007f0;
lop3.b32 r13, $4, 0x80008000, u, 0xea;
fma.rn.bf16x2 r02, r02, 0x7b807b80, 0x80008000;
fma.rn.bf16x2 r13, r13, 0x7b807b80, 0x80008000;
mov.b32 {$0, $2}, r02;
mov.b32 {$1, $3}, r13;
}"""


if HAVE_TRITON:

    @triton.jit
    def _bytes4(w, DTYPE: tl.constexpr, ASM: tl.constexpr):
        """int32 words [BN, W] of four e4m3 bytes -> 4 tensors [BN, W] in DTYPE (exact)."""
        if ASM:
            b0, b1, b2, b3 = tl.inline_asm_elementwise(
                ASM_E4M3_BF16, "=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 4,
                is_pure=True, pack=1)
            return b0.to(DTYPE), b1.to(DTYPE), b2.to(DTYPE), b3.to(DTYPE)
        return (((w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)).to(DTYPE),
                (((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)).to(DTYPE),
                (((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)).to(DTYPE),
                (((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)).to(DTYPE))

    @triton.jit(do_not_specialize=["M", "N", "TILES", "TILES_PER_SPLIT", "stride_ys"])
    def _fp8_mma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, KW,
                        TILES, TILES_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_ys,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                        FIXUP: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
                        PDL: tl.constexpr):
        # program (n, s): rows rn of W (columns of y) over K tiles [s * TILES_PER_SPLIT, ...)
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rw = tl.arange(0, BLOCK_K // 4)
        nmask, mmask = rn < N, rm < M
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn                  # [BN, 1]
        x_rows = x_ptr + rm[:, None] * stride_xm                                # [BM, 1]
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)  # y^T
        t_lo = pid_s * TILES_PER_SPLIT
        pdl_wait(PDL)
        for t in range(t_lo, tl.minimum(t_lo + TILES_PER_SPLIT, TILES)):
            cw = t * (BLOCK_K // 4) + rw  # word columns                       # [W]
            w = tl.load(w_rows + cw[None, :], mask=nmask[:, None] & (cw < KW)[None, :],
                        other=0)                                                # [BN, W]
            rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :],
                        other=0.0)                                              # [BM, BK]
            # column 4 w + 2 a + b: split b, then a
            e, o = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 4, 2, 2)))
            x0, x2 = tl.split(e)
            x1, x3 = tl.split(o)                                                # [BM, W]
            q0, q1, q2, q3 = _bytes4(w, x_ptr.dtype.element_ty, ASM)
            acc = tl.dot(q0, tl.trans(x0), acc)                                 # [BN, BM]
            acc = tl.dot(q1, tl.trans(x1), acc)
            acc = tl.dot(q2, tl.trans(x2), acc)
            acc = tl.dot(q3, tl.trans(x3), acc)
        pdl_release(PDL)
        acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[:, None]
        ymask = nmask[:, None] & mmask[None, :]
        y_off = rm[None, :] * stride_ym + rn[:, None]                           # [BN, BM]
        store_tile(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, rn, nmask, y_off, ymask, stride_ys,
                   SPLIT, FIXUP, HAS_BIAS)

def takes_fp8_mma(x2: torch.Tensor, in_features: int) -> bool:
    """Whether ``fp8_mma`` takes this GEMM: 1..MAX_ROWS rows of 16-bit x, K a multiple of 4
    (whole words)."""
    return HAVE_TRITON and x2.dtype in (torch.bfloat16, torch.float16) and \
        in_features % 4 == 0 and 0 < x2.shape[0] <= MAX_ROWS


def fp8_mma_config(m: int, n: int, k: int) -> dict:
    """Tiles and split-K: 64 rows of W a program, x padded to 16 rows or more, K split
    until about two programs an SM (untuned)."""
    split = auto_split(-(-n // 64), -(-k // BLOCK_K))
    return dict(BLOCK_N=64, BLOCK_M=max(16, next_pow2(m)), SPLIT=split, num_warps=4,
                num_stages=3)


def fp8_mma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias=None, y=None,
            config=None, counters=None, asm=None) -> torch.Tensor:
    """x2 [M, K] (unit column stride, ``takes_fp8_mma``), weight float8_e4m3fn [N, K]
    (contiguous), scale float32 [N] -> y [M, N] = x (weight * scale)^T + bias in x's dtype.
    ``asm``: the inline-assembly widening (default: unless interpreting)."""
    m, k = x2.shape
    n = weight.shape[0]
    assert takes_fp8_mma(x2, k) and weight.shape == (n, k) and weight.is_contiguous(), \
        f"fp8_mma takes 1..{MAX_ROWS} rows of 16-bit x, K % 4 == 0 and contiguous [N, K] " \
        f"e4m3; got x {tuple(x2.shape)} {x2.dtype}, weight {tuple(weight.shape)}"
    words = weight.view(torch.int32)  # [N, K / 4]
    cfg = dict(config or fp8_mma_config(m, n, k))
    tiles = -(-k // BLOCK_K)
    per, split = splits(tiles, cfg.pop("SPLIT"))
    y, parts, cnt = outputs(m, n, split, cfg["BLOCK_N"], x2, y, counters)
    if asm is None:
        asm = not interpreting()
    _fp8_mma_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x2, words, scale, weight if bias is None else bias, y, parts,
        parts if cnt is None else cnt, m, n, k, words.shape[1], tiles, per, x2.stride(0),
        words.stride(0), y.stride(0), m * n, SPLIT=split, FIXUP=cnt is not None,
        HAS_BIAS=bias is not None, ASM=asm, **cfg, **pdl_launch(x2.device))
    return finish(y, parts, cnt, bias)
