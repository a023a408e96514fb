"""KV-cache contract: a backend (registered) creates a cache (one per engine).

A cache owns K/V storage for every layer, hands out room to sequences, and implements
the attention that reads its own layout. The engine drives it per forward step:
``prepare`` (where the new tokens go) -> per layer ``attention`` -> ``free`` at the end.
"""
from __future__ import annotations

from typing import Any, Hashable

import torch

from .errors import InfergraftError


class CacheFullError(InfergraftError, RuntimeError):
    """No room for the requested tokens; the scheduler waits or preempts."""


class CacheBackend:
    """Registered through ``infergraft_register_cache_backends``."""

    name: str = ""
    #: plugin options this backend accepts in ``core.build(..., **options)``, with defaults
    options: dict[str, Any] = {}

    def create(self, spec, plan, *, device, dtype, ops, **options) -> "KVCache":
        raise NotImplementedError

    def bytes_per_token(self, spec, dtype: torch.dtype) -> int:
        """K and V bytes one token occupies across all layers (planner input)."""
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * \
            torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Runtime cache. ``seq_id`` is any hashable the engine chooses."""

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a new sequence needing ``num_tokens`` slots in total fits now."""
        raise NotImplementedError

    def allocate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Reserve room for a new sequence (its prompt); raises CacheFullError."""
        raise NotImplementedError

    def free(self, seq_id: Hashable) -> None:
        raise NotImplementedError

    def length(self, seq_id: Hashable) -> int:
        """Tokens written (or being written by the current step) for ``seq_id``."""
        raise NotImplementedError

    def prepare(self, seq_ids: list, counts: list[int]) -> Any:
        """Place ``counts[j]`` new tokens after each sequence's current length.

        Returns backend metadata with at least ``positions`` ([T] int64, the tokens'
        absolute positions, in ``seq_ids`` order) for one forward step.
        """
        raise NotImplementedError

    def attention(self, layer: int, q, k, v, meta) -> torch.Tensor:
        """Write this step's k, v ([T, Hkv, D]) and attend: q [T, Hq, D] -> [T, Hq, D]."""
        raise NotImplementedError

    def read(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V a sequence holds for ``layer``: ([L, Hkv, D], [L, Hkv, D])."""
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """Accounting: at least ``bytes`` (storage held) and ``sequences``."""
        raise NotImplementedError
