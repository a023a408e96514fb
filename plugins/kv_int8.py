"""K/V int8 quantiser (name ``kv-int8``): ``plugins=["kv-int8"]`` (contiguous) or ``["paged", "kv-int8"]``.

K and V are stored as int8 with one float32 scale per token and head (symmetric,
``scale = amax / 127``), quantised inside the KV-write kernel (``kv_write_quant``) and
dequantised inside attention. Per token: 2 x layers x kv_heads x (head_dim + 4) bytes,
about half of bf16. The cache backend does the work; this object only names the format.
"""
from infergraft.core.hookspecs import hookimpl
from infergraft.core.quant import Quantizer


class KVInt8(Quantizer):
    name = "kv-int8"
    applies_to = "kv"
    options = {}
    kv_dtype = "int8"
    kv_element_bytes = 1
    kv_scale_bytes = 4  # one float32 per token and head, for K and for V


@hookimpl
def infergraft_register_quantizers(register):
    register(KVInt8())
