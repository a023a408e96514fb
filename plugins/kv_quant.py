"""K/V quantisers: ``kv-int8`` and ``kv-fp8``, e.g. ``plugins=["paged", "kv-fp8"]`` (or
with the default contiguous cache, ``["kv-int8"]``).

K and V are stored as 8-bit values with one float32 scale per token and head,
quantised inside the KV-write kernel (``kv_write_quant``, or ``rotary_kv_write_quant``
with RoPE) and widened inside attention. Per token: 2 x layers x kv_heads x (head_dim + 4)
bytes, about half of bf16. The cache backend does the work; these objects only name the
format (``kernels.kv_write.KV_STORAGE_DTYPES`` maps it to the storage dtype).

- ``kv-int8``: symmetric int8, ``scale = amax / 127``, values rounded half to even: a
  uniform grid, fine near the row's largest values.
- ``kv-fp8``: e4m3 (``torch.float8_e4m3fn``), ``scale = amax / 448``, values rounded to
  the nearest e4m3: 3 mantissa bits, a relative step, so a row's small values keep their
  precision and its largest lose more. Triton reads e4m3 on compute capability 8.9+ (Ada,
  Hopper) and in the CPU interpreter; elsewhere a build with Triton kernels is refused
  with a PlanError naming kv-int8 and kernels="torch" (the reference ops, which run anywhere).
"""
import torch

from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.quant import Quantizer
from infergraft.kernels.fp8_linear import fp8_native


class _ScaledKV(Quantizer):
    applies_to = "kv"
    options = {}
    kv_element_bytes = 1
    kv_scale_bytes = 4  # one float32 per token and head, for K and for V


class KVInt8(_ScaledKV):
    name, kv_dtype = "kv-int8", "int8"


class KVFp8(_ScaledKV):
    name, kv_dtype = "kv-fp8", "fp8"


@hookimpl
def infergraft_register_quantizers(register):
    register(KVInt8())
    register(KVFp8())


@hookimpl
def infergraft_prepare_plan(plan, spec):
    # e4m3 K/V are read by Triton kernels that load e4m3: refused clearly where they cannot
    # (their reference ops, kernels="torch", run anywhere)
    if "kv-fp8" in plan.quantizers and plan.kernels == "triton" and not fp8_native(plan.device):
        dev = torch.device(plan.device)
        where = f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(dev)))}" \
            if dev.type == "cuda" else "the CPU without TRITON_INTERPRET=1"
        raise PlanError(f"kv-fp8 stores K/V as e4m3, which the Triton kernels read on compute "
                        f"capability 8.9 and above (Ada, Hopper), not on {plan.device} "
                        f"({where}): use kv-int8 (the same bytes) or kernels='torch' (the "
                        "reference ops)")
    return None
