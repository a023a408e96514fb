"""8-bit weight rows (e4m3 or int8, a float32 scale each) in a decode GEMM on the tensor
cores, the bytes widened to 16-bit floats by bit tricks (W8A16): ``fp8_mma``, ``int8_mma``.

The skinny kernels widen 8-bit tiles with Triton's converts (``.to(x.dtype)``), which on
sm_90 cost several instructions a byte; at decode the widening's instructions a byte bound
the loop. Here W is read as 32-bit words of four bytes and each pair of bytes becomes a
pair of 16-bit floats with integer ops and one packed multiply-add:

- e4m3: a byte s eeee mmm placed as bf16 bits s at 15 and eeee mmm at 10-4 reads as its
  value times 2^-120 (exponent bias 7 against 127; an e4m3 subnormal lands on a bf16
  subnormal of the same digits), and one packed multiply by 2^120 (exact) restores it; for
  fp16 x, eeee mmm at bits 13-7 reads as the value times 2^-8 (bias 15), times 2^8. Per
  word two ``lop3``, three shifts, two masks, two ``fma``.
- int8: a byte b made b + 128 (its top bit flipped) and placed under the bits of 1024.0
  in fp16 (0x6400: ten mantissa bits hold 0..1023) by one ``prmt`` a pair reads as 1152 +
  b, and one packed subtract leaves b. bf16's seven mantissa bits cannot hold 256 values:
  there each byte goes under 2^23 in a float32 (0x4B000000), 2^23 + 128 is subtracted and
  ``cvt.rn.bf16x2.f32`` packs each pair (exact: |b| <= 128).

Byte j of word c is column 4c + j, so a K tile's dot is 4 dots (byte j of every word
against x's columns 4c + j, split from x's tile in registers): ``dot_words``, shared with
the fused decode GEMMs (``linear.py``'s WORDS tiles). The row scale is applied once, in the
epilogue. The packed constants sit in registers: ptxas takes no immediate operand in a
packed 16-bit float instruction.

Split-K: ``split_k.py`` (partials [S, M, N] summed by the last split of a column tile).
"""
import torch

from ._triton import HAVE_TRITON, interpreting, next_pow2, pdl_launch, pdl_release, \
    pdl_wait, tl, triton
from .split_k import auto_split, finish, outputs, splits, store_tile

BLOCK_K = 128  # bytes of a row a K step reads: 32 words, four dots of K = 32
MAX_ROWS = 64
ROW_DTYPES = (torch.float8_e4m3fn, torch.int8)

# e4m3: bytes (0, 2) and (1, 3) of a word into 16-bit pairs (value * 2^-SHIFT), then times
# 2^SHIFT (+ -0 keeps the product): lop3 0xEA is (a & b) | c
_ASM_E4M3 = """{
.reg .b32 t, u, r02, r13, up, nz;
mov.b32 up, UP;
mov.b32 nz, 0x80008000;
and.b32 t, $4, 0x007f007f;
shl.b32 t, t, LOW;
shl.b32 u, $4, 8;
lop3.b32 r02, u, 0x80008000, t, 0xea;
shr.b32 u, $4, HIGH;
and.b32 u, u, MASK;
lop3.b32 r13, $4, 0x80008000, u, 0xea;
fma.rn.TYPE r02, r02, up, nz;
fma.rn.TYPE r13, r13, up, nz;
mov.b32 {$0, $2}, r02;
mov.b32 {$1, $3}, r13;
}"""
ASM_E4M3_BF16 = _ASM_E4M3.replace("UP", "0x7b807b80").replace("TYPE", "bf16x2") \
    .replace("LOW", "4").replace("HIGH", "4").replace("MASK", "0x07f007f0")
ASM_E4M3_FP16 = _ASM_E4M3.replace("UP", "0x5c005c00").replace("TYPE", "f16x2") \
    .replace("LOW", "7").replace("HIGH", "1").replace("MASK", "0x3f803f80")

# int8, fp16: prmt puts bytes 0 and 2 (selector 0x4240), 1 and 3 (0x4341) of the flipped
# word under 0x64 (1024.0's high byte); minus 1152 (0x6480)
ASM_INT8_FP16 = """{
.reg .b32 u, r02, r13, c;
xor.b32 u, $4, 0x80808080;
prmt.b32 r02, u, 0x64646464, 0x4240;
prmt.b32 r13, u, 0x64646464, 0x4341;
mov.b32 c, 0x64806480;
sub.f16x2 r02, r02, c;
sub.f16x2 r13, r13, c;
mov.b32 {$0, $2}, r02;
mov.b32 {$1, $3}, r13;
}"""
# int8, bf16: byte j of the flipped word under 2^23's bits (selector 0x765j), minus
# 2^23 + 128 (0x4B000080) in float32, pairs packed (the first operand to the high half)
ASM_INT8_BF16 = """{
.reg .b32 u, f0, f1, f2, f3, c, r02, r13;
xor.b32 u, $4, 0x80808080;
prmt.b32 f0, u, 0x4b000000, 0x7650;
prmt.b32 f1, u, 0x4b000000, 0x7651;
prmt.b32 f2, u, 0x4b000000, 0x7652;
prmt.b32 f3, u, 0x4b000000, 0x7653;
mov.b32 c, 0x4b000080;
sub.f32 f0, f0, c;
sub.f32 f1, f1, c;
sub.f32 f2, f2, c;
sub.f32 f3, f3, c;
cvt.rn.bf16x2.f32 r02, f2, f0;
cvt.rn.bf16x2.f32 r13, f3, f1;
mov.b32 {$0, $2}, r02;
mov.b32 {$1, $3}, r13;
}"""

dot_words = None  # (defined below where Triton is installed: linear.py imports it)

if HAVE_TRITON:
    # the assembly as constexprs: a kernel reads no other global
    _E4M3_BF16, _E4M3_FP16 = tl.constexpr(ASM_E4M3_BF16), tl.constexpr(ASM_E4M3_FP16)
    _INT8_BF16, _INT8_FP16 = tl.constexpr(ASM_INT8_BF16), tl.constexpr(ASM_INT8_FP16)

    @triton.jit
    def _bytes4(w, DTYPE: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr):
        """int32 words [BN, W] of four 8-bit values (e4m3 with FP8, else int8) -> the four
        bytes of each, 4 tensors [BN, W] in DTYPE (fp16 or bf16; exact)."""
        # (if / else throughout: Triton types a branch's return with the code after it;
        # the dtypes spelled out: a constexpr DTYPE is no dtype there)
        if ASM:
            if FP8:
                if DTYPE == tl.bfloat16:
                    q = tl.inline_asm_elementwise(_E4M3_BF16, "=h,=h,=h,=h,r", [w],
                                                  dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
                else:
                    q = tl.inline_asm_elementwise(_E4M3_FP16, "=h,=h,=h,=h,r", [w],
                                                  dtype=(tl.float16,) * 4, is_pure=True, pack=1)
            else:
                if DTYPE == tl.bfloat16:
                    q = tl.inline_asm_elementwise(_INT8_BF16, "=h,=h,=h,=h,r", [w],
                                                  dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
                else:
                    q = tl.inline_asm_elementwise(_INT8_FP16, "=h,=h,=h,=h,r", [w],
                                                  dtype=(tl.float16,) * 4, is_pure=True, pack=1)
        else:
            if FP8:
                q = (((w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)).to(DTYPE),
                     (((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)).to(DTYPE),
                     (((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)).to(DTYPE),
                     (((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)).to(DTYPE))
            else:  # int8: each byte to the top, then an arithmetic shift back (its sign)
                q = (((w << 24) >> 24).to(DTYPE), ((w << 16) >> 24).to(DTYPE),
                     ((w << 8) >> 24).to(DTYPE), (w >> 24).to(DTYPE))
        return q

    @triton.jit
    def dot_words(x, w, acc, FP8: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr):
        """acc + x [BM, BK] (16-bit) times 8-bit rows w [BN, BK / 4] (int32 words, byte j
        of word c: column 4c + j; e4m3 with FP8, else int8) widened to x's dtype: acc
        [BN, BM] (y^T) with SWAP, else [BM, BN]."""
        # column 4 c + 2 a + b: split b, then a
        e, o = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 4, 2, 2)))
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)                                                    # [BM, BK/4]
        q0, q1, q2, q3 = _bytes4(w, x.dtype, FP8, ASM)                         # [BN, BK/4]
        if SWAP:
            acc = tl.dot(q0, tl.trans(x0), acc)
            acc = tl.dot(q1, tl.trans(x1), acc)
            acc = tl.dot(q2, tl.trans(x2), acc)
            acc = tl.dot(q3, tl.trans(x3), acc)
        else:
            acc = tl.dot(x0, tl.trans(q0), acc)
            acc = tl.dot(x1, tl.trans(q1), acc)
            acc = tl.dot(x2, tl.trans(q2), acc)
            acc = tl.dot(x3, tl.trans(q3), acc)
        return acc

    @triton.jit(do_not_specialize=["M", "N", "TILES", "TILES_PER_SPLIT", "stride_ys"])
    def _rows_mma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, KW,
                         TILES, TILES_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_ys,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                         FIXUP: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
                         ASM: tl.constexpr, PDL: tl.constexpr, BLOCK_K: tl.constexpr):
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
            acc = dot_words(x, w, acc, FP8, True, ASM)                         # [BN, BM]
        pdl_release(PDL)
        acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[:, None]
        ymask = nmask[:, None] & mmask[None, :]
        y_off = rm[None, :] * stride_ym + rn[:, None]                           # [BN, BM]
        store_tile(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, rn, nmask, y_off, ymask, stride_ys,
                   SPLIT, FIXUP, HAS_BIAS)


def takes_rows_mma(x2: torch.Tensor, in_features: int) -> bool:
    """Whether ``fp8_mma`` / ``int8_mma`` take this GEMM: 1..MAX_ROWS rows of 16-bit x, K a
    multiple of 4 (whole words)."""
    return HAVE_TRITON and x2.dtype in (torch.bfloat16, torch.float16) and \
        in_features % 4 == 0 and 0 < x2.shape[0] <= MAX_ROWS


takes_fp8_mma = takes_rows_mma  # (its first name)


def rows_mma_chosen(mma) -> bool:
    """Whether ``mma`` (``INFERGRAFT_QUANT_MMA``'s value: False, True or "auto") sends e4m3
    and int8 rows to their MMA kernels (``rows_mma`` where it takes the GEMM, the fused
    layer's WORDS tiles): only when forced (True). Under "auto" they keep their shipped
    paths, which beat them in the engine at 1 and 32 rows (docs/bench/quant-mma.md: the
    fused layer's earlier WORDS tiles left SMs idle; not yet re-measured on its shipped
    tiles' grid)."""
    if mma == "auto":
        return False
    assert isinstance(mma, bool), f"mma is False, True or 'auto', got {mma!r}"
    return mma


def fp8_mma_config(m: int, n: int, k: int) -> dict:
    """Tiles and split-K: 64 rows of W a program, x padded to 16 rows or more, K split
    until about two programs an SM (untuned; e4m3 and int8 rows alike)."""
    split = auto_split(-(-n // 64), -(-k // BLOCK_K))
    return dict(BLOCK_N=64, BLOCK_M=max(16, next_pow2(m)), SPLIT=split, num_warps=4,
                num_stages=3)


def rows_mma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias=None, y=None,
             config=None, counters=None, asm=None) -> torch.Tensor:
    """x2 [M, K] (unit column stride, ``takes_rows_mma``), weight float8_e4m3fn or int8
    [N, K] (contiguous), scale float32 [N] -> y [M, N] = x (weight * scale)^T + bias in x's
    dtype (into ``y`` if given, contiguous). ``asm``: the inline-assembly widening
    (default: unless interpreting)."""
    m, k = x2.shape
    n = weight.shape[0]
    assert takes_rows_mma(x2, k) and weight.dtype in ROW_DTYPES and weight.shape == (n, k) \
        and weight.is_contiguous(), \
        f"the 8-bit rows' MMA takes 1..{MAX_ROWS} rows of 16-bit x, K % 4 == 0 and contiguous " \
        f"[N, K] e4m3 or int8; got x {tuple(x2.shape)} {x2.dtype}, weight " \
        f"{tuple(weight.shape)} {weight.dtype}"
    words = weight.view(torch.int32)  # [N, K / 4]
    cfg = dict(config or fp8_mma_config(m, n, k))
    tiles = -(-k // BLOCK_K)
    per, split = splits(tiles, cfg.pop("SPLIT"))
    y, parts, cnt = outputs(m, n, split, cfg["BLOCK_N"], x2, y, counters)
    if asm is None:
        asm = not interpreting()
    _rows_mma_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x2, words, scale, weight if bias is None else bias, y, parts,
        parts if cnt is None else cnt, m, n, k, words.shape[1], tiles, per, x2.stride(0),
        words.stride(0), y.stride(0), m * n, SPLIT=split, FIXUP=cnt is not None,
        HAS_BIAS=bias is not None, FP8=weight.dtype == torch.float8_e4m3fn, ASM=asm,
        BLOCK_K=BLOCK_K, **cfg,
        **pdl_launch(x2.device))
    return finish(y, parts, cnt, bias)


def fp8_mma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias=None, y=None,
            config=None, counters=None, asm=None) -> torch.Tensor:
    """``rows_mma`` on e4m3 rows (weight float8_e4m3fn [N, K])."""
    assert weight.dtype == torch.float8_e4m3fn, f"fp8_mma takes e4m3 rows, got {weight.dtype}"
    return rows_mma(x2, weight, scale, bias, y, config, counters, asm)


def int8_mma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias=None, y=None,
             config=None, counters=None, asm=None) -> torch.Tensor:
    """``rows_mma`` on int8 rows (weight int8 [N, K], symmetric: ``quantize_int8``)."""
    assert weight.dtype == torch.int8, f"int8_mma takes int8 rows, got {weight.dtype}"
    return rows_mma(x2, weight, scale, bias, y, config, counters, asm)
