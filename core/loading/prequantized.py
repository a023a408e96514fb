"""A GPTQ / AWQ projection in the ``int4`` quantiser's format before it is an
``Int4Weight`` (``Prequantized``), and act-order: a GPTQ ``g_idx`` that puts the input
columns in groups out of their order.

GPTQ with ``desc_act: true`` quantises the columns in the order of its Hessian's diagonal
and stores the codes in the columns' own order, each column naming its group in ``g_idx``.
The int4 format needs each group's columns side by side, so the codes are reordered by
group (``act_order``: ``perm``, stable) and the input is gathered the same way before the
product: W x = W[:, perm] x[perm]. Fused parts (q, k, v; gate, up) read one input, so they
must share their order, as GPTQ's own do (one Hessian from one input).

The down projection's gather needs no gather at all: its input is act(gate) * up (or
act(fc_in)), column j from rows j of the projection before it, so that projection's rows
reordered by down's ``perm`` hand down its input already in order (``fold_act_orders``,
once, after loading). qkv, o and gate_up keep theirs: their inputs come from a norm or from
attention, which no row order of a weight reorders.
"""
from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..errors import QuantizedCheckpointError


def act_order(name: str, g_idx: torch.Tensor, group_size: int) -> Optional[torch.Tensor]:
    """None where ``g_idx`` is ``arange(K) // group_size`` (columns in their groups' order);
    else ``perm`` (int64 [K]): the columns ordered by group, each group's ``group_size``
    columns (the last one's K's remainder) in their own order. A ``g_idx`` that gives a
    group another number of columns is refused."""
    k = g_idx.shape[0]
    want = torch.arange(k, device=g_idx.device) // group_size
    g = g_idx.long()
    if torch.equal(g, want):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], want):
        counts = torch.bincount(g.clamp(min=0), minlength=int(want[-1]) + 1).tolist()
        raise QuantizedCheckpointError(
            f"{name}.g_idx does not give each group {group_size} of the {k} input columns "
            f"(columns per group: {counts}); act-order checkpoints are loaded where every "
            f"group of group_size={group_size} holds group_size columns")
    return perm


@attrs.frozen
class Prequantized:
    """One projection of a GPTQ / AWQ checkpoint in the int4 format's tensors, not yet an
    ``Int4Weight`` (the build's dtype and device come at loading). ``shape`` is the dense
    weight's, [N, K], for the weight map's checks."""

    qweight: torch.Tensor  # uint8 [N, ceil(K / 2)]: column 2c low nibble, 2c + 1 high
    scales: torch.Tensor  # float32 [N, G]
    zeros: torch.Tensor  # uint8 [N, G]
    group_size: int
    in_features: int  # K
    dtype: Optional[torch.dtype] = None
    perm: Optional[torch.Tensor] = None  # act-order: int64 [K], the input's columns in order
    prequantized = True  # what load_weights and SlotPacker look for

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.in_features)

    def to(self, device=None, dtype=None) -> "Prequantized":
        return attrs.evolve(self, qweight=self.qweight.to(device), scales=self.scales.to(device),
                            zeros=self.zeros.to(device), dtype=dtype or self.dtype,
                            perm=None if self.perm is None else self.perm.to(device))

    @staticmethod
    def cat(parts: list["Prequantized"]) -> "Prequantized":
        """Fused parts (q, k, v) stacked along N: one slot's weight."""
        first = parts[0]
        if any((p.group_size, p.in_features) != (first.group_size, first.in_features)
               for p in parts):
            raise QuantizedCheckpointError(
                "the parts of a fused projection differ in group_size or in_features: "
                f"{[(p.group_size, p.in_features) for p in parts]}")
        if any(not _same_order(p.perm, first.perm) for p in parts):
            raise QuantizedCheckpointError(
                "the parts of a fused projection (q, k, v or gate, up: one input) have "
                "different act orders (g_idx); infergraft multiplies them as one matrix, "
                "which needs one order of the input's columns")
        return attrs.evolve(first, qweight=torch.cat([p.qweight for p in parts]),
                            scales=torch.cat([p.scales for p in parts]),
                            zeros=torch.cat([p.zeros for p in parts]))

    def packed(self):  # what SlotPacker installs
        return self.int4()

    def int4(self):
        """The ``kernels.int4_linear.Int4Weight`` the ``int4`` quantiser multiplies by."""
        from infergraft.kernels.int4_linear import Int4Weight

        return Int4Weight(self.qweight.contiguous(), self.scales.contiguous(),
                          self.zeros.contiguous(), self.group_size, self.in_features,
                          self.dtype or torch.float32, self.perm)


def fold_act_orders(layers) -> int:
    """Move each down projection's act order into the rows of the projection before it
    (the MLP part's ``down_input_blocks``: gate_up's two blocks, fc_in's one), where both
    are packed int4 (``Int4Weight``); a dequantised copy kept beside (``dense_on``) follows.
    Exact: rows are independent, so the same products in the same order. Returns how many
    layers it folded."""
    from infergraft.kernels.int4_linear import Int4Weight

    folded = 0
    for layer in layers:
        blocks = getattr(getattr(layer, "mlp", None), "down_input_blocks", 0)
        down = getattr(layer, "down", None)
        up = getattr(layer, getattr(layer.mlp, "input_projection", ""), None) if blocks else None
        packed = [getattr(m, "packed", None) for m in (down, up)]
        if up is None or not all(isinstance(p, Int4Weight) for p in packed) \
                or packed[0].perm is None:
            continue
        perm = packed[0].perm
        k = perm.numel()
        assert packed[1].qweight.shape[0] == blocks * k, \
            f"{layer.mlp.input_projection} has {packed[1].qweight.shape[0]} rows, not " \
            f"{blocks} x down's {k} columns"
        rows = torch.cat([perm + b * k for b in range(blocks)])  # each block in down's order
        up.packed = attrs.evolve(packed[1], qweight=packed[1].qweight[rows].contiguous(),
                                 scales=packed[1].scales[rows].contiguous(),
                                 zeros=packed[1].zeros[rows].contiguous())
        if up.bias is not None:
            up.bias = up.bias[rows].contiguous()
        down.packed = attrs.evolve(packed[0], perm=None)  # its columns: the input's order now
        for lin in (down, up):
            if lin.dense is not None:  # the dequantised copy, again
                lin.keep_dense()
        folded += 1
    return folded


def _same_order(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
