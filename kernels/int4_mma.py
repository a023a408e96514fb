"""int4 decode GEMM on the tensor cores, the nibbles widened by bit tricks (W4A16, group 128).

At decode the GEMM must stream the packed weight at the copy rate; what limits a kernel
there is the instructions it spends a weight byte (docs/kernels.md: the CUDA-core GEMV
needs ~9 a byte, near the SM's issue rate). Here the multiply-adds go to the tensor cores
(x padded to 16 rows is the MMA's narrow side: y^T = W x^T) and a nibble becomes a 16-bit
float with no convert instruction, Marlin's trick: a 32-bit word holds 8 nibbles, nibble
j at bits 4j (column 8w + j of the word w); masked to bits 0-3 and 16-19 and OR-ed into
the bits of two 128.0s (bf16 0x4300; fp16 1024.0, 0x6400) it reads as (128 + q_j, 128 +
q_{j+4}), and one packed fused multiply-add takes the 128 off: one `lop3` and one `fma`
for two nibbles, plus a shift per pair of columns.

Rather than interleave the 8 nibbles of a word back into column order, the K tile's dot
is 8 dots of 16 words each: W_j [BN, 16] (nibble j of every word) against x's columns
8w + j, which x's tile gives by a reshape and three splits in registers. One K tile is one
group of 128 columns, so its dot is scaled by the group's scale and the zero-point leaves
the products: sum (q - z) x = sum q x - z sum x.

Split-K (SPLIT > 1, for the narrow outputs whose column tiles alone leave SMs idle):
``split_k.py`` (partials [S, M, N] summed by the last split of a column tile).
"""
import torch

from ._triton import HAVE_TRITON, interpreting, next_pow2, pdl_launch, pdl_release, \
    pdl_wait, tl, triton
from .split_k import auto_split, finish, outputs, splits, store_tile

GROUP = 128  # the group size this kernel takes: a K tile is one group
MAX_ROWS = 64

# nibbles j and j + 4 of a word (after shifting it right by 4 j) into two 16-bit floats:
# lop3 0xEA is (a & b) | c; then (128 + q) * 1 - 128 (bf16) or (1024 + q) * 1 - 1024 (fp16),
# the packed constants in registers (ptxas takes no immediate in a packed float instruction)
_ASM = """{
.reg .b32 t0, t1, t2, t3, s, one, neg;
mov.b32 one, ONE;
mov.b32 neg, NEG;
lop3.b32 t0, $8, 0x000f000f, MAGIC, 0xea;
shr.u32 s, $8, 4;
lop3.b32 t1, s, 0x000f000f, MAGIC, 0xea;
shr.u32 s, $8, 8;
lop3.b32 t2, s, 0x000f000f, MAGIC, 0xea;
shr.u32 s, $8, 12;
lop3.b32 t3, s, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE t0, t0, one, neg;
fma.rn.TYPE t1, t1, one, neg;
fma.rn.TYPE t2, t2, one, neg;
fma.rn.TYPE t3, t3, one, neg;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}"""
ASM_BF16 = _ASM.replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2") \
    .replace("ONE", "0x3f803f80").replace("NEG", "0xc300c300")
ASM_FP16 = _ASM.replace("MAGIC", "0x64006400").replace("TYPE", "f16x2") \
    .replace("ONE", "0x3c003c00").replace("NEG", "0xe400e400")


if HAVE_TRITON:
    # the assembly as constexprs: a kernel reads no other global
    _NIBBLES_BF16, _NIBBLES_FP16 = tl.constexpr(ASM_BF16), tl.constexpr(ASM_FP16)

    @triton.jit
    def _nibbles8(w, DTYPE: tl.constexpr, ASM: tl.constexpr):
        """int32 words [BN, W] -> the 8 nibbles of each, 8 tensors [BN, W] of DTYPE (exact
        small integers 0..15); the inline assembly on the GPU, shifts and masks elsewhere."""
        # (if / else throughout: Triton types a branch's return with the code after it)
        if ASM:
            if DTYPE == tl.bfloat16:
                q = tl.inline_asm_elementwise(
                    _NIBBLES_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 8,
                    is_pure=True, pack=1)
            else:
                q = tl.inline_asm_elementwise(
                    _NIBBLES_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 8,
                    is_pure=True, pack=1)
        else:
            q = ((w & 0xF).to(DTYPE), ((w >> 4) & 0xF).to(DTYPE), ((w >> 8) & 0xF).to(DTYPE),
                 ((w >> 12) & 0xF).to(DTYPE), ((w >> 16) & 0xF).to(DTYPE),
                 ((w >> 20) & 0xF).to(DTYPE), ((w >> 24) & 0xF).to(DTYPE),
                 ((w >> 28) & 0xF).to(DTYPE))
        return q

    @triton.jit(do_not_specialize=["M", "N", "G", "TILES", "TILES_PER_SPLIT", "stride_ys"])
    def _int4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K,
                         KW, G, TILES, TILES_PER_SPLIT, stride_xm, stride_wn, stride_ym,
                         stride_ys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLIT: tl.constexpr, FIXUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         ASM: tl.constexpr, PDL: tl.constexpr, GROUP: tl.constexpr):
        # program (n, s): rows rn of W (columns of y) over K tiles [s * TILES_PER_SPLIT, ...)
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rw = tl.arange(0, 16)
        nmask, mmask = rn < N, rm < M
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn                  # [BN, 1]
        sz_rows = rn.to(tl.int64) * G                                           # [BN]
        x_rows = x_ptr + rm[:, None] * stride_xm                                # [BM, 1]
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)  # y^T
        t_lo = pid_s * TILES_PER_SPLIT
        pdl_wait(PDL)
        for t in range(t_lo, tl.minimum(t_lo + TILES_PER_SPLIT, TILES)):
            cw = t * 16 + rw  # word columns                                   # [16]
            w = tl.load(w_rows + cw[None, :], mask=nmask[:, None] & (cw < KW)[None, :],
                        other=0)                                                # [BN, 16]
            rk = t * GROUP + tl.arange(0, GROUP)
            x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :],
                        other=0.0)                                              # [BM, 128]
            sx = tl.sum(x.to(tl.float32), axis=1)                               # [BM]
            # column 8 w + 4 a + 2 b + c: split c, then b, then a
            c0, c1 = tl.split(tl.reshape(x, (BLOCK_M, 16, 2, 2, 2)))
            b00, b01 = tl.split(c0)
            b10, b11 = tl.split(c1)
            x0, x4 = tl.split(b00)
            x2, x6 = tl.split(b01)
            x1, x5 = tl.split(b10)
            x3, x7 = tl.split(b11)                                              # [BM, 16]
            q0, q1, q2, q3, q4, q5, q6, q7 = _nibbles8(w, x_ptr.dtype.element_ty, ASM)
            part = tl.dot(q0, tl.trans(x0))                                     # [BN, BM]
            part = tl.dot(q1, tl.trans(x1), part)
            part = tl.dot(q2, tl.trans(x2), part)
            part = tl.dot(q3, tl.trans(x3), part)
            part = tl.dot(q4, tl.trans(x4), part)
            part = tl.dot(q5, tl.trans(x5), part)
            part = tl.dot(q6, tl.trans(x6), part)
            part = tl.dot(q7, tl.trans(x7), part)
            s = tl.load(s_ptr + sz_rows + t, mask=nmask, other=0.0)             # [BN]
            z = tl.load(z_ptr + sz_rows + t, mask=nmask, other=0).to(tl.float32)
            acc += (part - z[:, None] * sx[None, :]) * s[:, None]
        pdl_release(PDL)
        ymask = nmask[:, None] & mmask[None, :]
        y_off = rm[None, :] * stride_ym + rn[:, None]                           # [BN, BM]
        store_tile(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, rn, nmask, y_off, ymask, stride_ys,
                   SPLIT, FIXUP, HAS_BIAS)

def takes_mma(x2: torch.Tensor, group_size: int, in_features: int) -> bool:
    """Whether ``int4_mma`` takes this GEMM: 1..MAX_ROWS rows of 16-bit x, groups of 128,
    K a multiple of 8 (whole words)."""
    return HAVE_TRITON and x2.dtype in (torch.bfloat16, torch.float16) and \
        group_size == GROUP and in_features % 8 == 0 and 0 < x2.shape[0] <= MAX_ROWS


def mma_config(m: int, n: int, k: int) -> dict:
    """Tiles and split-K of an M x N x K GEMM: 64 rows of W a program (the MMA's M side),
    x padded to 16 rows or more, split K until about two programs an SM (untuned); 8 warps
    at 64 rows, where 4 spill (Triton 3.6, sm_90: ``kernel_bench.cubin``)."""
    split = auto_split(-(-n // 64), -(-k // GROUP))
    bm = max(16, next_pow2(m))
    return dict(BLOCK_N=64, BLOCK_M=bm, SPLIT=split, num_warps=8 if bm >= 64 else 4,
                num_stages=3)


def int4_mma(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor, group_size: int, in_features: int, bias=None, y=None,
             config=None, counters=None, asm=None) -> torch.Tensor:
    """x2 [M, K] (unit column stride, ``takes_mma``), qweight / scales / zeros as
    ``int4_linear`` takes them (group 128) -> y [M, N] in x's dtype (into ``y`` if given,
    contiguous). ``asm``: the inline-assembly nibbles (default: unless interpreting)."""
    m, k = x2.shape
    n = qweight.shape[0]
    assert k == in_features and takes_mma(x2, group_size, k), \
        f"int4_mma takes 1..{MAX_ROWS} rows of 16-bit x, group {GROUP}, K % 8 == 0; got " \
        f"{tuple(x2.shape)} {x2.dtype}, group {group_size}, K {in_features}"
    words = qweight.view(torch.int32)  # [N, K / 8]: contiguous rows of K / 2 bytes
    cfg = dict(config or mma_config(m, n, k))
    tiles = -(-k // GROUP)
    per, split = splits(tiles, cfg.pop("SPLIT"))
    y, parts, cnt = outputs(m, n, split, cfg["BLOCK_N"], x2, y, counters)
    if asm is None:
        asm = not interpreting()
    _int4_mma_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x2, words, scales, zeros, qweight if bias is None else bias, y, parts,
        parts if cnt is None else cnt, m, n, k, words.shape[1], scales.shape[1], tiles, per,
        x2.stride(0), words.stride(0), y.stride(0), m * n, SPLIT=split,
        FIXUP=cnt is not None, HAS_BIAS=bias is not None, ASM=asm, GROUP=GROUP, **cfg,
        **pdl_launch(x2.device))
    return finish(y, parts, cnt, bias)
