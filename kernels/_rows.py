"""What weight-only GEMM launchers share: the checks of 8-bit rows with a scale each, and
the rows they work on: x [..., K] as a row-major [M, K] view (a copy only where its last
dim is strided) and the output [M, N] it fills."""
import torch

#: the dtypes of 8-bit weight rows with a float32 scale each, W = q.float() * s[:, None]
#: (``Quantizer.scaled_rows``): int8 (``int8_linear``) and e4m3 (``fp8_linear``)
SCALED_ROW_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_row_dtype(qweight: torch.Tensor) -> None:
    """A weight given with a scale must be 8-bit rows of one of ``SCALED_ROW_DTYPES``."""
    assert qweight.dtype in SCALED_ROW_DTYPES, \
        f"a weight with a scale must be int8 or float8_e4m3fn rows, got {qweight.dtype}"


def gemm_rows(x: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(x2 [M, K] with unit column stride, y [M, N] empty in x's dtype, x's leading dims):
    the launcher returns ``y.reshape(*lead, n)``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device), lead


def check_scaled_rows(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias,
                      dtype: torch.dtype, dtype_name: str) -> tuple[int, int]:
    """What a launcher of 8-bit rows with a float32 scale each needs (int8, fp8): x [..., K]
    in a float dtype, qweight contiguous ``dtype`` [N, K], scale contiguous float32 [N],
    bias [N], all on x's device. Returns (N, K)."""
    assert qweight.dim() == 2 and qweight.dtype == dtype and qweight.is_contiguous(), \
        f"qweight must be contiguous {dtype_name} [N, K], got {tuple(qweight.shape)} " \
        f"{qweight.dtype}"
    n, k = qweight.shape
    assert x.shape[-1] == k, f"x has K={x.shape[-1]} but qweight is {tuple(qweight.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert scale.shape == (n,) and scale.dtype == torch.float32 and scale.is_contiguous(), \
        f"scale must be contiguous float32 [{n}], got {tuple(scale.shape)} {scale.dtype} " \
        f"stride {scale.stride()}"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}], got {tuple(bias.shape)}"
    for name, t in (("qweight", qweight), ("scale", scale), ("bias", bias)):
        assert t is None or t.device == x.device, f"{name} on {t.device} but x on {x.device}"
    return n, k


# shared memory a launch may ask for (the H200 has 227 KiB a block; some left for Triton)
SMEM_BUDGET = 200 * 1024


def fit_stages(cfg: dict, x_bytes: int) -> dict:
    """``cfg`` (8-bit rows' tiles, chosen for 16-bit x) with fewer pipeline stages where
    its x and W tiles would not fit in shared memory: float32 x (``x_bytes`` 4) doubles the
    x tile. 16-bit x's tiles are left as they are (they fit)."""
    cfg = dict(cfg)
    stage = cfg["BLOCK_K"] * (cfg["BLOCK_M"] * x_bytes + cfg["BLOCK_N"])
    while cfg["num_stages"] > 1 and cfg["num_stages"] * stage > SMEM_BUDGET:
        cfg["num_stages"] -= 1
    return cfg
