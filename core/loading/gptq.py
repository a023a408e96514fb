"""Pre-quantised GPTQ and AWQ checkpoints (the Hugging Face safetensors layout) loaded into
the ``int4`` quantiser's format (``kernels.int4_linear.Int4Weight``).

config.json's ``quantization_config`` selects the format (``quant_method`` "gptq" or
"awq", ``bits`` 4). Each quantised projection ``P`` is a group of int32 tensors, 8 4-bit
codes an int32, the lowest nibble first; w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g],
g = k // group_size:

* GPTQ (AutoGPTQ / GPTQModel / optimum): ``P.qweight`` [K/8, N] packed along K,
  ``P.qzeros`` [G, N/8] packed along N, ``P.scales`` float16 [G, N], ``P.g_idx`` int32 [K]
  (the group of each input column). ``checkpoint_format`` "gptq" (v1, the default) stores
  zero - 1 (dequantisation adds the 1 back); "gptq_v2" stores the zero itself.
* AWQ (AutoAWQ, ``version`` "gemm"): ``P.qweight`` [K, N/8] and ``P.qzeros`` [G, N/8] both
  packed along N, the 8 columns of an int32 in the order [0, 2, 4, 6, 1, 3, 5, 7] (nibble
  i holds column ORDER[i]); ``P.scales`` float16 [G, N]; zeros stored as they are.

``prequantized_tensors`` wraps a checkpoint's (key, tensor) stream: each complete group
comes out as one ``Prequantized`` under the key ``P.weight``, so the policy's weight map
places it like a dense weight (fused parts concatenated along N: rows are independent,
groups run along K); ``core.loading.packing.SlotPacker`` makes it a ``QuantizedLinear``.
Act-order (a ``g_idx`` other than ``arange(K) // group_size``) is loaded with the codes
reordered by group and the input gathered the same way (``prequantized.act_order``).
``quant_method`` "fp8" is read by ``fp8_checkpoint``
(``prequant_format`` hands it over; the functions below serve both formats).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import attrs
import torch

from ..errors import QuantizedCheckpointError, WeightLoadError
from .prequantized import Prequantized, act_order

__all__ = ["Prequantized", "PrequantFormat", "prequant_format", "prequantized_tensors",
           "with_prequantized", "convert"]

QUANT_METHODS = ("gptq", "awq")
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> the offset added to qzeros
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]
SHIFTS = tuple(range(0, 32, 4))


@attrs.frozen
class PrequantFormat:
    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group per row (GPTQ's per-channel)
    zero_offset: int = 0  # GPTQ v1 stores zero - 1
    quantizer = "int4"  # the weight quantiser whose format the projections load in

    @property
    def label(self) -> str:
        return f"{self.method}, 4-bit"

    def stream(self, tensors):
        return prequantized_tensors(tensors, self)

    @property
    def parts(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx") if self.method == "gptq" else \
            ("qweight", "qzeros", "scales")


def _refuse(key: str, value, accepted: str):
    raise QuantizedCheckpointError(f"quantization_config {key}={value!r} is not supported: "
                                   f"infergraft loads {accepted}")


def prequant_format(config) -> Optional[PrequantFormat]:
    """The format config.json's ``quantization_config`` names, or None where it has none;
    a ``QuantizedCheckpointError`` naming the key, its value and what is accepted for any
    setting the int4 format cannot hold."""
    from infergraft.kernels.int4_linear import GROUP_SIZES

    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if callable(getattr(qc, "to_dict", None)) else vars(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        from .fp8_checkpoint import fp8_format

        return fp8_format(qc)
    if method not in QUANT_METHODS:
        _refuse("quant_method", qc.get("quant_method"),
                "pre-quantised 'gptq' and 'awq' (4-bit) and 'fp8' (e4m3) checkpoints only")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        _refuse("bits", bits, f"4-bit {method} checkpoints only (bits: 4)")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if group_size not in GROUP_SIZES:
        _refuse("group_size", group_size, f"group_size {', '.join(map(str, GROUP_SIZES))} "
                "(the int4 kernel's; -1, per-channel, is not among them)")
    if method == "gptq":
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt not in GPTQ_FORMATS:
            _refuse("checkpoint_format", fmt, "GPTQ checkpoint_format 'gptq' (v1: zero - 1 "
                    "stored) or 'gptq_v2'")
        if qc.get("pack_dtype", "int32") != "int32":
            _refuse("pack_dtype", qc.get("pack_dtype"), "GPTQ tensors packed in int32")
        if qc.get("dynamic"):
            _refuse("dynamic", qc.get("dynamic"), "one bits / group_size for every layer "
                    "(no per-module 'dynamic' overrides)")
        if qc.get("lm_head"):
            _refuse("lm_head", True, "GPTQ checkpoints with a dense lm_head (lm_head: false)")
        # desc_act either way (an act order is read from each layer's g_idx); sym either
        # way: the zero-points are stored
        return PrequantFormat("gptq", group_size, GPTQ_FORMATS[fmt])
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse("version", qc.get("version"), "AWQ version 'gemm' (AutoAWQ's GEMM packing)")
    if qc.get("zero_point", True) is not True:
        _refuse("zero_point", qc.get("zero_point"), "AWQ with zero points (zero_point: true)")
    if str(qc.get("backend", "autoawq")).lower() != "autoawq":
        _refuse("backend", qc.get("backend"), "AWQ checkpoints packed by AutoAWQ "
                "(backend 'autoawq')")
    if qc.get("modules_to_not_convert"):
        _refuse("modules_to_not_convert", qc.get("modules_to_not_convert"),
                "AWQ checkpoints whose every decoder projection is quantised")
    return PrequantFormat("awq", group_size)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C, 8]: nibble i (bits 4i..4i+3) of each int32."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32)[..., None] >> shifts) & 0xF).to(torch.uint8)


def _check(name: str, key: str, t: torch.Tensor, shape: tuple, dtypes: tuple) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        raise QuantizedCheckpointError(f"{name}.{key} is {tuple(t.shape)} {t.dtype}; the format "
                                       f"needs {tuple(shape)} {' or '.join(map(str, dtypes))}")


def unpack_gptq(name: str, parts: dict, fmt: PrequantFormat):
    """(q uint8 [N, K], zeros uint8 [N, G], scales float32 [N, G], the act order or None)
    of GPTQ ``parts``; an act-order checkpoint's codes come reordered by group."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = -(-k // fmt.group_size)
    _check(name, "qzeros", qzeros, (groups, n // 8), (torch.int32,))
    _check(name, "scales", scales, (groups, n), (torch.float16, torch.bfloat16, torch.float32))
    g_idx, perm = parts.get("g_idx"), None
    if g_idx is not None:
        _check(name, "g_idx", g_idx, (k,), (torch.int32, torch.int64))
        perm = act_order(name, g_idx, fmt.group_size)
    q = unpack_int32(qweight).permute(0, 2, 1).reshape(k, n).t()  # [N, K]
    zeros = unpack_int32(qzeros).reshape(groups, n).t().to(torch.int16) + fmt.zero_offset
    if int(zeros.max()) > 15:
        raise QuantizedCheckpointError(
            f"{name}.qzeros holds a zero-point of 16 (the nibble 15 of checkpoint_format 'gptq', "
            "which stores zero - 1: a zero of 0 written as -1 by an old packer); the int4 "
            "format's zero-points are 0..15")
    q = q if perm is None else q[:, perm]  # each group's columns side by side
    return q, zeros.to(torch.uint8), scales.float().t(), perm


def unpack_awq(name: str, parts: dict, fmt: PrequantFormat):
    """(q uint8 [N, K], zeros uint8 [N, G], scales float32 [N, G], None) of AWQ (GEMM)
    ``parts``."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = -(-k // fmt.group_size)
    _check(name, "qzeros", qzeros, (groups, n // 8), (torch.int32,))
    _check(name, "scales", scales, (groups, n), (torch.float16, torch.bfloat16, torch.float32))
    order = list(AWQ_REVERSE_ORDER)
    q = unpack_int32(qweight)[..., order].reshape(k, n).t()  # [N, K]
    zeros = unpack_int32(qzeros)[..., order].reshape(groups, n).t()
    return q, zeros, scales.float().t(), None


def convert(name: str, parts: dict, fmt: PrequantFormat) -> Prequantized:
    """One projection's tensors -> a ``Prequantized`` (nibbles repacked along K)."""
    from infergraft.kernels.int4_linear import pack_nibbles

    if parts["qweight"].dtype != torch.int32:
        raise QuantizedCheckpointError(f"{name}.qweight is {parts['qweight'].dtype}; the "
                                       f"{fmt.method} format packs int32")
    unpack = unpack_gptq if fmt.method == "gptq" else unpack_awq
    q, zeros, scales, perm = unpack(name, parts, fmt)
    return Prequantized(pack_nibbles(q.contiguous()), scales.contiguous(), zeros.contiguous(),
                        fmt.group_size, q.shape[1], perm=perm)


def prequantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                         fmt: PrequantFormat) -> Iterator[tuple[str, object]]:
    """A checkpoint's stream with each projection's group of tensors replaced, once
    complete, by one ``Prequantized`` under ``P.weight``. A GPTQ group waits for its
    ``g_idx``; groups that never get one (older GPTQ-for-LLaMa files) come out at the end."""
    pending: dict[str, dict] = {}
    for key, tensor in tensors:
        name, _, leaf = key.rpartition(".")
        if leaf not in fmt.parts or not name:
            yield key, tensor
            continue
        group = pending.setdefault(name, {})
        if leaf in group:
            raise WeightLoadError(f"weight {key!r} arrived twice")
        group[leaf] = tensor
        if len(group) == len(fmt.parts):
            yield f"{name}.weight", convert(name, pending.pop(name), fmt)
    for name, group in pending.items():
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in group]
        if missing:
            raise WeightLoadError(f"{fmt.method} projection {name!r} lacks "
                                  f"{', '.join(f'{name}.{p}' for p in missing)}")
        yield f"{name}.weight", convert(name, group, fmt)


def with_prequantized(source):
    """``source`` (a ``ModelSource``) with its GPTQ / AWQ / fp8 projections converted as
    they stream, and ``prequantized`` naming the format; unchanged without a
    quantization_config."""
    fmt = prequant_format(source.config)
    if fmt is None:
        return source
    read = source.tensors
    return attrs.evolve(source, tensors=lambda: fmt.stream(read()), prequantized=fmt)


def weight_quantizer_names(prequantized: Optional[PrequantFormat], names, registered) -> tuple:
    """The quantiser names a build runs: a pre-quantised checkpoint adds its format's
    (``int4``, ``fp8``) and refuses another weight quantiser (``names``:
    ``Selection.quantizers``; ``registered``: the quantiser registry)."""
    own = None if prequantized is None else prequantized.quantizer
    if own is None or own in names:
        return tuple(names)
    from ..errors import PlanError

    for n in names:
        if registered.get(n).applies_to == "weights":
            raise PlanError(f"the checkpoint is pre-quantised ({prequantized.label}): its "
                            f"projections load in the {own!r} quantiser's format, so weight "
                            f"quantiser {n!r} cannot pack them; drop {n!r} from plugins "
                            f"({own} is chosen automatically), or load a dense checkpoint")
    return (*names, own)


def checkpoint_quantizers(prequantized: Optional[PrequantFormat], quantizers: list,
                          options: dict) -> list:
    """``quantizers`` with ``int4`` set to the checkpoint's group size (the memory plan
    counts its scales); a ``group_size=`` option naming another is refused."""
    if prequantized is None or prequantized.quantizer != "int4":
        return quantizers
    from ..errors import PlanError

    given = options.get("group_size", prequantized.group_size)
    if given != prequantized.group_size:
        raise PlanError(f"group_size={given!r}, but the {prequantized.method} checkpoint is "
                        f"quantised in groups of {prequantized.group_size}; drop group_size")
    return [q.configured(group_size=prequantized.group_size) if q.name == "int4" else q
            for q in quantizers]
