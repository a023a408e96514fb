"""Optional Triton import: kernels are defined only where Triton is installed."""
import os

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # e.g. macOS / Windows wheels without Triton
    triton = tl = None
    HAVE_TRITON = False


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
