"""Packing weights as they stream in: ``load_weights``' slot callback for a weight
quantiser (the ``Quantizer`` contract is ``core.quant``)."""
from __future__ import annotations

import re

import torch

from ..runner.model import Linear, QuantizedLinear, folded
from ..runner.weight_stream import map_tensors
from .prequantized import fold_act_orders

_LAYER_SLOT = re.compile(r"^layers\.(\d+)\.(\w+)\.weight$")


def packed_device(packed) -> torch.device:
    """Where a packed form's tensors are (the CPU if it holds none)."""
    found = []
    map_tensors(packed, lambda t: found.append(t.device) or t)
    return found[0] if found else torch.device("cpu")


class SlotPacker:
    """``load_weights``' slot callback: a slot the quantiser packs becomes a
    ``QuantizedLinear``. With ``fold_norms`` (the fused decode layer will run) an RMSNorm
    weight that feeds a packed projection is folded into it first (``model.folded``),
    whichever of the two arrives first: a projection waits, unpacked, for its norm (layer
    by layer in a checkpoint that goes so); ``finish`` sets those norms to ones."""

    def __init__(self, quantizer, ops, net, fold_norms: bool, device=None):
        # norms fold only into a form the fused decode layer reads (8-bit rows, a scale
        # each): a group-wise format (int4) would quantise W g, whose groups the norm's
        # outliers widen
        if fold_norms:
            fold_norms = quantizer.scaled_rows(quantizer.pack(torch.ones(1, 128))) is not None
        self.quantizer, self.ops, self.net, self.fold_norms = quantizer, ops, net, fold_norms
        self.device = device  # where packing runs: the build's device (None: the weight's)
        self.norms, self.waiting = {}, set()  # (layer, norm) -> weight; (layer, projection)
        self.folded = set()  # (layer, norm) whose weight lives in its packed projection

    def _packed(self, weight, bias):
        # a streamed layer's weight waits in host memory, but packs on the device, as it
        # would resident: the same packed bits (CUDA divides by a scalar as a multiply by
        # its reciprocal, the CPU does not)
        home = weight.device
        packed = self.quantizer.pack(weight if self.device is None else weight.to(self.device))
        if self.device is not None and home != torch.device(self.device):
            packed = map_tensors(packed, lambda t: t.to(home))
        return self._linear(packed, bias)

    def _linear(self, packed, bias) -> QuantizedLinear:
        lin = QuantizedLinear(self.quantizer, packed, bias, self.ops)
        # where the quantiser's matmul is slower than the dense GEMM (int4 on the CPU),
        # its weight dequantised once, here, rather than at every call
        on = packed_device(packed) if self.device is None else torch.device(self.device)
        return lin.keep_dense() if self.quantizer.dense_on(on, self.ops.backend) else lin

    def __call__(self, slot, module, weight):
        if getattr(weight, "prequantized", False):  # GPTQ / AWQ / fp8: its norm stays
            return self._linear(weight.packed(), module.bias)
        m = _LAYER_SLOT.match(slot) if self.fold_norms else None
        name = m and m[2]  # a norm, its projection, or another slot
        # norm -> the projection it feeds, as the layer's parts say (DecoderLayer.norm_feeds)
        feeds = dict(self.net.layers[int(m[1])].norm_feeds) if m else {}
        fed_by = {p: n for n, p in feeds.items()}
        proj = feeds.get(name, name if name in fed_by else None)
        if proj is None or not self.quantizer.quantizes(f"layers.{m[1]}.{proj}.weight"):
            quantized = self.quantizer.quantizes(slot) and type(module) is Linear
            return self._packed(weight, module.bias) if quantized else None
        i = int(m[1])
        if name in feeds:  # a norm (installed as loaded until ``finish``)
            self.norms[(i, name)] = weight
            if (i, proj) in self.waiting:  # its projection came first: pack it now
                self.waiting.discard((i, proj))
                lin = getattr(self.net.layers[i], proj)
                setattr(self.net.layers[i], proj, self._packed(folded(lin.weight, weight), lin.bias))
                self.folded.add((i, name))
            return None
        norm = fed_by[name]
        if (i, norm) not in self.norms:
            self.waiting.add((i, name))
            return None  # installed unpacked until the norm arrives
        self.folded.add((i, norm))
        return self._packed(folded(weight, self.norms[(i, norm)]), module.bias)

    def finish(self) -> None:
        """After loading: norms folded into packed projections become ones; a GPTQ
        act-order down projection's order moves into the rows before it
        (``prequantized.fold_act_orders``: no gather of its input at each step)."""
        assert not self.waiting, f"projections never met their norms: {sorted(self.waiting)}"
        for i, name in self.folded:
            self.net.layers[i].mark_norm_folded(name)
        fold_act_orders(self.net.layers)
