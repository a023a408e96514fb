"""Per-dtype tolerances for comparing a Triton kernel with its torch reference.

Kernels keep statistics in float32 but round to the storage dtype where the reference
does; what remains is float32 summation order / FMA contraction, which can flip the
last bit of a low-precision output, so tolerances are about one ulp of the dtype.
"""
import torch

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Same dtype, shape and device, and values within the dtype's tolerance (NaN fails)."""
    assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype],
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Bit-for-bit equal (for data movement ops such as kv_write)."""
    torch.testing.assert_close(actual, expected, atol=0, rtol=0,
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)
