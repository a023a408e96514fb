"""Python ints to a host tensor, fast: a step's small inputs (token ids, positions, block
ids) are lists, and ``torch.tensor(list)`` converts them one Python object at a time at a
few times the cost of packing them into an ``array`` and viewing its buffer."""
from __future__ import annotations

from array import array

import torch

_CODES = {torch.long: "q", torch.int32: "i"}


def from_ints(values, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (ints) as a 1-D CPU tensor of ``dtype`` (torch.long or torch.int32)."""
    packed = array(_CODES[dtype], values)
    if not packed:  # (frombuffer refuses an empty buffer)
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(packed, dtype=dtype)  # (keeps ``packed`` alive)
