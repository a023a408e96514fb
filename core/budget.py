"""The memory budget: the bytes a build may use on its device (``device_memory``, else free
CUDA memory, else the host's physical memory), and the paged K/V pool sized from what the
weights and activations leave of it (``gpu_memory_utilization``, as vLLM's). Re-exported
by ``core.memory``."""
from __future__ import annotations

import numbers
import os
from typing import Optional

import torch

from .errors import PlanError
from .units import parse_bytes


def as_bytes(size) -> int:
    """``80GiB`` / ``512MiB`` / an int -> bytes (PlanError on anything else)."""
    if isinstance(size, int) and size > 0:
        return size
    try:
        n = parse_bytes(size)
    except ValueError as e:
        raise PlanError(f"device_memory: {e}") from None
    if n <= 0:
        raise PlanError(f"device_memory must be positive, got {size!r}")
    return n


def device_budget(device, device_memory=None) -> tuple[Optional[int], str]:
    """(bytes, where they come from): the explicit budget, else free CUDA memory, else on
    the CPU the host's physical memory (a plan over it would die in the allocator or the
    OOM killer); None where that cannot be read."""
    if device_memory is not None:
        return as_bytes(device_memory), "device_memory"
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        # the driver's free memory, and what torch's allocator holds unused (an engine
        # freed earlier in this process): a pool sized to the first must not starve a second
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(free + cached), f"free memory on {dev}"
    host = host_memory() if dev.type == "cpu" else None
    return (host, "the host's physical memory") if host else (None, "unchecked")


def host_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_utilization(value, name: str = "gpu_memory_utilization") -> float:
    """``value`` as a float if it is a number in (0, 1], else PlanError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise PlanError(f"{name} must be a number in (0, 1] (the fraction of the memory "
                        f"budget the weights, activations and K/V pool may take), got {value!r}")
    return float(value)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def held_blocks(plan, block_size) -> int:
    """The most blocks one sequence holds once its prompt is in: all of max_seq_len, or
    with a sliding window W (out-of-window blocks go back to the pool at each step) the
    window's blocks, the one being filled, and one taken before the step drops one."""
    per_seq = blocks_for(plan.max_seq_len, block_size)
    window = getattr(plan, "sliding_window", None)
    return min(per_seq, blocks_for(window, block_size) + 2) if window else per_seq


def default_blocks(plan, block_size) -> int:
    """The blocks max_batch_size sequences can hold at once: one max_seq_len sequence (a
    prompt holds all its blocks until its first decode step) and ``held_blocks`` for each
    other batch slot (without a window, one max_seq_len per slot)."""
    per_seq = blocks_for(plan.max_seq_len, block_size)
    return per_seq + (plan.max_batch_size - 1) * held_blocks(plan, block_size)


def pool_blocks(plan, budget: int, block_size: int, utilization: float, cuda: bool) -> int:
    """The paged pool's blocks when ``num_blocks`` is not given: floor((budget x
    utilization - weights on the device - activations) / bytes per block), at most
    ``default_blocks`` (what max_batch_size sequences can hold: more would only keep
    evicted prefixes, and starve another engine of the same process). On the CPU (``cuda``
    False) ``default_blocks`` is kept while it fits the whole budget, and only a pool that
    does not is cut to the fraction: the host is shared, and tests build many engines on
    it. ``plan``: a ``Plan`` or a ``MemoryPlan``; may be below one sequence (0 at least)."""
    most = default_blocks(plan, block_size)
    block_bytes = block_size * plan.kv_bytes_per_token
    held = plan.device_weight_bytes + plan.activation_bytes
    if not cuda and held + most * block_bytes <= budget:
        return most
    return max(0, min(most, (int(budget * utilization) - held) // block_bytes))
