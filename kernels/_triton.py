"""Optional Triton import: kernels are defined only where Triton is installed."""
import functools
import os

import torch

from . import switches

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # e.g. macOS / Windows wheels without Triton
    triton = tl = None
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def load_row_add_residual(x_ptr, r_ptr, h_ptr, row, stride_x, stride_r, stride_h, cols,
                              mask, HAS_RESIDUAL: tl.constexpr, NSPLIT: tl.constexpr = 1,
                              stride_s=0):
        """Row ``row`` of x, plus the residual when given (then also stored to h), in the
        residual's dtype: the prologue every pre-norm kernel (RMSNorm, LayerNorm) shares.
        NSPLIT > 1: x is float32 partial sums ``x_ptr + s * stride_s`` of a split-K GEMM,
        added in order and rounded (what the unsplit GEMM would have stored)."""
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        for s in tl.static_range(1, NSPLIT):
            x += tl.load(x_ptr + s * stride_s + row * stride_x + cols, mask=mask, other=0.0)
        x = x.to(r_ptr.dtype.element_ty)  # partials: rounded once summed; else a no-op
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
            # h is rounded to the input dtype first, like `x + residual` in torch
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
        return x

    @triton.jit
    def last_to_arrive(counter_ptr, total):
        """Count this program in at ``counter_ptr`` (int32, zero before the first of
        ``total`` arrives): True for the last, which then sees every other's stores
        (acquire); it sets the counter back to 0 itself once done. A scalar atomic runs on
        one thread: the barrier orders every thread's stores before its release (not
        every Triton inserts one)."""
        tl.debug_barrier()
        return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == total - 1

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """Programmatic dependent launch (Hopper): wait until the previous kernel has
        finished and flushed, then let the next one launch, so its launch and CTA setup
        overlap this kernel instead of following it (a decode step runs hundreds of
        kernels, each short)."""
        pdl_wait(PDL)
        pdl_release(PDL)

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """The first half of ``pdl_enter``: wait for the previous kernel only. A GEMM
        calls ``pdl_release`` after its loop: dependents launched at its start would hold
        SM resources (the next GEMM's shared memory) while its own later CTAs still wait."""
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def soft_cap(s, cap):
        """cap * tanh(s / cap) (Gemma 2's attention logit softcap), s float32. tl has no
        tanh: tanh(x) = 2 sigmoid(2x) - 1, 2x clamped where sigmoid has long saturated so
        that exp() stays finite."""
        x = tl.minimum(tl.maximum(2.0 * s / cap, -80.0), 80.0)
        return cap * (2.0 * tl.sigmoid(x) - 1.0)
else:
    load_row_add_residual = last_to_arrive = pdl_enter = pdl_wait = pdl_release = None
    soft_cap = None


_PDL_ON, _PDL_OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch options for a kernel that calls ``pdl_enter(PDL)``: PDL on CUDA sm90+
    (``INFERGRAFT_PDL=0`` turns it off), plain launches elsewhere. Called on every launch,
    so it stays cheap (prefill is bound by the host's launch cost)."""
    if device.type != "cuda" or not switches.value("INFERGRAFT_PDL") or interpreting() \
            or not _pdl_capable(device):
        return _PDL_OFF
    return _PDL_ON


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def norm_buffers(x, residual, weight, x_dtype=None):
    """Outputs of a row-norm launcher (one program per row): returns (out, h, r, block).

    ``out`` has the dtype of ``weight * x`` like the references; ``h`` receives
    x + residual (``out`` itself when there is no residual, never written); ``r`` is what
    the kernel reads as the residual. ``x_dtype``: x's dtype once its split-K partials
    are summed (x itself is then one float32 partial).
    """
    n, h = x.shape
    x_dtype = x_dtype or x.dtype
    block = next_pow2(h)
    assert block <= 65536, f"hidden size {h} too large for a one-block row"
    out = torch.empty((n, h), dtype=torch.promote_types(x_dtype, weight.dtype), device=x.device)
    if residual is None:
        return out, out, x, block
    assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
    assert residual.dtype == x_dtype, f"residual dtype {residual.dtype} != x dtype {x_dtype}"
    assert residual.device == x.device, f"residual on {residual.device} but x on {x.device}"
    assert h <= 1 or residual.stride(1) == 1, \
        f"residual must be contiguous in its last dim, strides {residual.stride()}"
    return out, torch.empty((n, h), dtype=x_dtype, device=x.device), residual, block


def row_chunk_launch(rows: int, width: int) -> tuple[tuple[int, int], dict]:
    """Grid and meta-parameters for elementwise row kernels (SiLU*mul, GELU): a program
    per (row, 1024-wide chunk), so wide MLP rows (I ~ 14k) split over several programs."""
    block = min(next_pow2(width), 1024)
    return (rows, -(-width // block)), dict(BLOCK=block, num_warps=4 if block <= 512 else 8)
