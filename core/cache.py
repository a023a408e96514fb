"""KV-cache contract: a backend (registered) creates a cache (one per engine).

A cache owns K/V storage for every layer, hands out room to sequences, and implements
the attention that reads its own layout. The engine drives it per forward step:
``prepare`` (where the new tokens go) -> per layer ``attention`` -> ``free`` at the end.

Layer ``i``'s attention follows ``spec.layer_attention(i)`` (core/spec.py): its scale,
sliding window and softcap. A backend written before those could vary lists in
``attention_features`` what it honours beyond LLaMA's (head_dim ** -0.5, one model-wide
window, no softcap); ``core.build`` refuses a spec that asks for more.
"""
from __future__ import annotations

import functools
from typing import Any, Hashable

import torch

from .errors import InfergraftError
from .units import kv_bytes_per_token


class CacheFullError(InfergraftError, RuntimeError):
    """No room for the requested tokens; the scheduler waits or preempts."""


class CacheBackend:
    """Registered through ``infergraft_register_cache_backends``."""

    name: str = ""
    #: plugin options this backend accepts in ``core.build(..., **options)``, with defaults
    options: dict[str, Any] = {}
    #: quantised K/V formats it can store (``Quantizer.kv_dtype``, e.g. "int8"); when a
    #: K/V quantiser is chosen, ``create`` receives it as ``kv_quantizer=``
    quantized_kv: tuple[str, ...] = ()
    #: what its attention honours of ``spec.layer_attention(i)`` beyond LLaMA's: any of
    #: ``core.spec.ATTENTION_FEATURES`` ("scale", "softcap", "layer_windows")
    attention_features: tuple[str, ...] = ()

    def create(self, spec, plan, *, device, dtype, ops, **options) -> "KVCache":
        raise NotImplementedError

    def bytes_per_token(self, spec, dtype: torch.dtype, kv_quantizer=None) -> int:
        """K and V bytes one token occupies across all layers (planner input)."""
        return kv_bytes_per_token(spec, dtype, kv_quantizer)

    def device_bytes(self, plan, **options) -> int:
        """K/V bytes the cache will hold on the device for ``plan`` (memory check input)."""
        return plan.kv_bytes_total

    def host_bytes(self, plan, **options) -> int:
        """K/V bytes it holds in host memory besides (counted when the device is the CPU)."""
        return 0


class KVCache:
    """Runtime cache. ``seq_id`` is any hashable the engine chooses.

    Optional, for CUDA graphs (core/runner/cuda_graph.py, core/runner/prefill_graph.py): a
    cache with ``supports_cuda_graphs = True`` provides ``static_decode_meta(batch)`` and
    ``prepare_decode_into(meta, seq_ids)``; one whose ``supports_prefill_graphs`` is
    true provides ``static_prefill_meta(length)`` and ``prepare_prefill_into(meta,
    seq_id, n)`` (a fresh prompt of ``n <= length`` tokens; the padding rows' K/V must
    land nowhere a sequence reads).

    Optional: a cache with ``fuses_rotary = True`` receives q and k *before* RoPE and
    ``attention(..., rope=(cos, sin, positions))``, so that it can fuse the rotation with
    its K/V write (the paged cache does at decode: one kernel instead of two).
    """

    fuses_rotary: bool = False

    @functools.cached_property
    def counters(self):
        """This cache's own ``kernels.paged_plan.CounterPool``, for ``ops.paged_attention(...,
        counters=)``: its split merge counts there, never on another engine's (whose graphs
        may replay on another stream)."""
        from infergraft.kernels.paged_plan import CounterPool  # not at import: it imports triton

        return CounterPool()

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a new sequence needing ``num_tokens`` slots in total fits now."""
        raise NotImplementedError

    def allocate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Reserve room for a new sequence (its prompt); raises CacheFullError."""
        raise NotImplementedError

    def allocate_cached(self, seq_id: Hashable, token_ids: list[int]) -> int:
        """Reserve room for a new sequence of these tokens, reusing K/V the cache already
        holds for a prefix of them (prefix caching); returns how many leading tokens need
        no prefill (at most ``len(token_ids) - 1``). Raises CacheFullError, changing
        nothing. The default: no prefix cache, ``allocate`` and 0."""
        if not self.can_allocate(len(token_ids)):
            raise CacheFullError(f"no room for a {len(token_ids)}-token sequence")
        self.allocate(seq_id, len(token_ids))
        return 0

    def free(self, seq_id: Hashable) -> None:
        raise NotImplementedError

    def key_tokens(self, seq_id: Hashable, token_ids: list[int]) -> None:
        """Before ``free``: the ids of every token ``seq_id`` holds K/V for, and maybe
        more (its prompt and output). A prefix cache keys the full blocks they fill, so a
        conversation's next turn, whose prompt repeats this one's answer, hits them. The
        default: nothing."""

    def discard(self, seq_id: Hashable) -> None:
        """``free`` for a sequence whose last step may have left its K/V half written (the
        step failed): nothing it holds may be reused by a later request."""
        self.free(seq_id)

    #: True if ``truncate`` works (speculative decoding needs it: core/speculative/)
    supports_truncate: bool = False

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Forget ``seq_id``'s tokens at ``length`` and after (speculative tokens the
        verification rejected; ``length`` at least its length before the last step): the
        next step writes after ``length``, room no token needs any more is freed, and
        nothing derived from the forgotten tokens (a prefix-cache key) is kept."""
        raise NotImplementedError(f"{type(self).__name__} cannot truncate a sequence")

    def length(self, seq_id: Hashable) -> int:
        """Tokens written (or being written by the current step) for ``seq_id``."""
        raise NotImplementedError

    def prepare(self, seq_ids: list, counts: list[int]) -> Any:
        """Place ``counts[j]`` new tokens after each sequence's current length.

        Returns backend metadata with at least ``positions`` ([T] int64, the tokens'
        absolute positions, in ``seq_ids`` order) for one forward step.
        """
        raise NotImplementedError

    def attention(self, layer: int, q, k, v, meta, rope=None) -> torch.Tensor:
        """Write this step's k, v ([T, Hkv, D]) and attend: q [T, Hq, D] -> [T, Hq, D].
        ``rope``: only for caches that set ``fuses_rotary`` (q, k then still unrotated).
        k = v = None: the step's producer already wrote them (``decode_kv_slots``)."""
        raise NotImplementedError

    def decode_kv_slots(self, layer: int, meta) -> tuple | None:
        """Optional: where a decode step's K/V go, for a producer that writes them itself
        (the fused qkv GEMM: RoPE and the write in its epilogue, one kernel fewer per
        layer): (k_cache, v_cache [NB, BS, Hkv, D], idx0 [T], idx1 [T]), token t at
        ``cache[idx0[t], idx1[t]]``, nowhere where idx0 < 0; the producer then calls
        ``attention(layer, rotated q, None, None, meta)``. None: write through attention."""
        return None

    def read(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V a sequence holds for ``layer``: ([L, Hkv, D], [L, Hkv, D])."""
        raise NotImplementedError

    def can_append(self, seq_ids: list, counts: list[int]) -> bool:
        """True if ``prepare(seq_ids, counts)`` would succeed now (the scheduler asks
        before a step, and preempts or pauses sequences when it would not). The default
        checks only a ``max_seq_len`` attribute, if the cache has one."""
        limit = getattr(self, "max_seq_len", None)
        return limit is None or all(self.length(s) + n <= limit for s, n in zip(seq_ids, counts))

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Make ``child`` a new sequence holding a copy of ``parent``'s K/V (prefix
        sharing: block backends share full blocks, copy-on-write for the partial one).
        Raises CacheFullError, leaving everything unchanged, when there is no room."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support fork (prefix sharing); the engine "
            "prefills each sample on its own instead")

    def stats(self) -> dict[str, int]:
        """Accounting: at least ``bytes`` (storage held) and ``sequences``. Block
        backends add ``blocks_total``, ``blocks_free`` and ``blocks_used``
        (free + used = total; a block shared by several sequences counts once)."""
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (a leaked or doubly
        freed block, a negative reference count, ...). The conformance state machine
        (``infergraft.core.testing.cache_machine``) calls it after every step."""
        st = self.stats()
        if "blocks_total" in st:
            assert st["blocks_free"] + st["blocks_used"] == st["blocks_total"], st
            assert min(st["blocks_free"], st["blocks_used"]) >= 0, st

    # -- optional: preemption by swap (the scheduler recomputes where a cache has none) ----
    #: True if the cache implements the swap methods below
    supports_swap: bool = False

    def can_swap_out(self, seq_id: Hashable) -> bool:
        """True if ``swap_out(seq_id)`` would succeed now (room in host memory)."""
        return False

    def swap_out(self, seq_id: Hashable) -> None:
        """Move a sequence's K/V to host memory and release its device room: it is no longer
        allocated (``length``, ``prepare`` and ``read`` do not know it) until ``swap_in``."""
        raise NotImplementedError(f"{type(self).__name__} does not support swap")

    def swap_bytes(self, seq_id: Hashable) -> int:
        """Bytes ``swap_out(seq_id)`` would copy (``swap_in`` copies as many back)."""
        raise NotImplementedError(f"{type(self).__name__} does not support swap")

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """True if the swapped-out ``seq_id`` fits on the device now, room for its next
        token included, so that it can run in the step that follows."""
        return False

    def swap_in(self, seq_id: Hashable) -> None:
        """Bring a swapped-out sequence back: allocated again with the K/V and length it had;
        any copy is ordered before the next step reads it. Raises CacheFullError, changing
        nothing, when there is no room."""
        raise NotImplementedError(f"{type(self).__name__} does not support swap")

    def free_swapped(self, seq_id: Hashable) -> None:
        """Drop a swapped-out sequence's host copy (an abort)."""
        raise NotImplementedError(f"{type(self).__name__} does not support swap")

    def swapped_ids(self) -> list:
        """The sequences swapped out now, in the order they were swapped out."""
        return []
