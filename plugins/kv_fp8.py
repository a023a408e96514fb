"""K/V fp8 quantiser (name ``kv-fp8``): ``plugins=["kv-fp8"]`` (contiguous) or ``["paged", "kv-fp8"]``.

K and V are stored as e4m3 (``torch.float8_e4m3fn``) with one float32 scale per token and
head (``scale = amax / 448``, the value rounded to the nearest e4m3), quantised inside the
KV-write kernel (``kv_write_quant``) and widened inside attention, as ``kv-int8`` does with
int8: the same bytes (2 x layers x kv_heads x (head_dim + 4) per token, about half of
bf16), a floating grid instead of a uniform one (3 mantissa bits: a relative step, so small
values of a row keep their precision, the row's largest lose more). The cache backend does
the work; this object only names the format.
"""
from infergraft.core.hookspecs import hookimpl
from infergraft.core.quant import Quantizer


class KVFp8(Quantizer):
    name = "kv-fp8"
    applies_to = "kv"
    options = {}
    kv_dtype = "fp8"
    kv_element_bytes = 1
    kv_scale_bytes = 4  # one float32 per token and head, for K and for V


@hookimpl
def infergraft_register_quantizers(register):
    register(KVFp8())
