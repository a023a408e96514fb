"""The composed plan: frozen, printable, decided before any weight is loaded."""
from __future__ import annotations

from typing import Any

import attrs

from .units import KVSizes, activations_label, fmt_bytes


@attrs.frozen
class ParallelPlan:
    """What a planner decides: tensor-parallel degree and pipeline stages."""

    world_size: int = 1
    tensor_parallel: int = 1
    #: per pipeline stage, the [first, last) layer range it runs
    stages: tuple[tuple[int, int], ...] = ()


class Planner:
    """Registered through ``infergraft_register_planners``."""

    name: str = ""
    options: dict[str, Any] = {}

    def plan(self, spec, world_size: int = 1, **options) -> ParallelPlan:
        raise NotImplementedError


@attrs.frozen
class Plan(KVSizes):
    model: str
    architecture: str
    policy: str
    dtype: str
    device: str
    kernels: str
    max_seq_len: int
    max_batch_size: int
    cache_backend: str
    kv_dtype: str
    quantizers: tuple[str, ...]
    planner: str
    parallel: ParallelPlan
    weight_bytes: int
    kv_bytes_per_token: int
    options: tuple[tuple[str, Any], ...] = ()
    sliding_window: int | None = None  # the model's attention window (caches may hold less)
    max_num_batched_tokens: int | None = None  # tokens one step carries at most
    activation_bytes: int = 0  # that step's transient tensors (core.memory.activation_bytes)

    def rows(self) -> list[tuple[str, str]]:
        p = self.parallel
        each = " (per rank)" if p.tensor_parallel > 1 else ""
        rows = [
            ("model", f"{self.model} ({self.architecture})"),
            ("policy", self.policy),
            ("dtype / device", f"{self.dtype} / {self.device}"),
            ("kernels", self.kernels),
            ("cache backend", f"{self.cache_backend} (K/V {self.kv_dtype})"),
            ("quantizers", ", ".join(self.quantizers) or "none"),
            ("planner", f"{self.planner} (world {p.world_size}, tp {p.tensor_parallel}, "
                        f"{len(p.stages)} stage(s))"),
            ("max batch x seq", f"{self.max_batch_size} x {self.max_seq_len}"),
            (f"weights{each}", fmt_bytes(self.weight_bytes)),
            (f"KV per token{each}", fmt_bytes(self.kv_bytes_per_token)),
            (f"KV per sequence{each}", fmt_bytes(self.kv_bytes_per_sequence)),
            (f"KV total{each}", fmt_bytes(self.kv_bytes_total)),
        ]
        if self.max_num_batched_tokens:
            rows.append((activations_label(self.max_num_batched_tokens),
                         fmt_bytes(self.activation_bytes)))
        if self.sliding_window:
            rows.append(("sliding window",
                         f"{self.sliding_window} tokens (a cache may hold only those)"))
        return rows + [(f"option {k}", repr(v)) for k, v in self.options]

    def __str__(self) -> str:
        rows = self.rows()
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
