"""The composed plan: frozen, printable, decided before any weight is loaded."""
from __future__ import annotations

from typing import Any

import attrs

from .units import KVSizes, activations_label, fmt_bytes, rows_table


@attrs.frozen
class ParallelPlan:
    """What a planner decides: tensor-parallel degree and pipeline stages."""

    world_size: int = 1
    tensor_parallel: int = 1
    #: per pipeline stage, the [first, last) layer range it runs
    stages: tuple[tuple[int, int], ...] = ()
    #: token groups of one step in flight across the stages at once (the ``pp`` planner's
    #: ``micro_batches``; 1: the stages run the whole step in turn)
    micro_batches: int = 1


@attrs.frozen
class WeightPlacement:
    """Which decoder layers' weights stay on the device and which stream from host memory
    into a ring of device slots, one layer at a time (a planner's optional
    ``place_weights``: ``plugins/offload_weights.py``; ``core/runner/weight_stream.py``
    streams them). Embeddings, norms and the head always stay on the device."""

    resident: tuple[int, ...]  # layer indices held on the device
    streamed: tuple[int, ...]  # layer indices held in host memory, copied into the ring
    layer_bytes: tuple[int, ...]  # every layer's weight bytes (packed where quantised)
    slot_bytes: int = 0  # one ring slot: the largest streamed layer, each tensor aligned
    ring_size: int = 0  # device slots the streamed layers take turns in (0: none stream)
    note: str = ""  # why nothing streams, when nothing does

    @property
    def streamed_bytes(self) -> int:
        """Bytes of the layers held in host memory."""
        return sum(self.layer_bytes[i] for i in self.streamed)

    @property
    def copied(self) -> tuple[int, ...]:
        """The streamed layers copied in every step: those that share their ring slot (the
        j-th streamed takes slot j % ring_size; a layer alone in its slot stays there)."""
        m, r = len(self.streamed), self.ring_size
        return tuple(i for j, i in enumerate(self.streamed) if j % r < m - r)

    @property
    def copied_bytes(self) -> int:
        """Bytes copied from host memory to the device each step."""
        return sum(self.layer_bytes[i] for i in self.copied)

    @property
    def ring_bytes(self) -> int:
        return self.ring_size * self.slot_bytes

    def device_bytes(self, weight_bytes: int) -> int:
        """Weight bytes on the device, of a model of ``weight_bytes``: all but the
        streamed layers, plus the ring."""
        return weight_bytes - self.streamed_bytes + self.ring_bytes

    def rows(self, weight_bytes: int) -> list[tuple[str, str]]:
        n = len(self.layer_bytes)
        if not self.streamed:
            return [("weight placement", f"all {n} layers on the device, nothing streams"
                     + (f" ({self.note})" if self.note else ""))]
        return [("weights on the device",
                 f"{fmt_bytes(self.device_bytes(weight_bytes))}: embeddings, norms, head, "
                 f"{len(self.resident)} of {n} layers ({layer_ranges(self.resident)}) and a "
                 f"{self.ring_size}-slot ring ({fmt_bytes(self.ring_bytes)})"),
                ("weights in host memory",
                 f"{fmt_bytes(self.streamed_bytes)}: {len(self.streamed)} layers "
                 f"({layer_ranges(self.streamed)}), {fmt_bytes(self.copied_bytes)} of them "
                 f"copied into the ring each step ({layer_ranges(self.copied)})")]


def layer_ranges(layers) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"; () -> "none"."""
    out, layers = [], sorted(layers)
    for i in layers:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out) or "none"


class Planner:
    """Registered through ``infergraft_register_planners``. Optional:
    ``place_weights(plan, spec, budget, kv_device_bytes, weight_quantizer=None, **options)
    -> WeightPlacement``, which ``core.build`` calls before the memory check (layers kept
    in host memory and streamed: ``plugins/offload_weights.py``); ``processes(**options)
    -> int | None``, the processes its options ask for, which the error for a run started
    without torchrun names (``tp``: its ``tp_size``)."""

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
    # what a decode step reads of them where that is less (a quantiser's dense copies, not
    # the packed forms held beside: core.weight_bytes.step_read_bytes); None: all of them
    step_weight_bytes: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    sliding_window: int | None = None  # the model's attention window (caches may hold less)
    max_num_batched_tokens: int | None = None  # tokens one step carries at most
    activation_bytes: int = 0  # that step's transient tensors (core.memory.activation_bytes)
    weight_placement: WeightPlacement | None = None  # layers streamed from host memory
    # the device's budget (core.budget.device_budget) a cache may size its pool from, and
    # at most this many K/V tokens in it: the smallest rank's, so every rank makes the same
    # pool (each schedules on its own); both None: the default pool (core.build sets them)
    memory_budget: int | None = None
    pool_tokens: int | None = None

    @property
    def device_weight_bytes(self) -> int:
        """The weight bytes on the device (all of them unless layers stream)."""
        p = self.weight_placement
        return self.weight_bytes if p is None else p.device_bytes(self.weight_bytes)

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
                        f"{len(p.stages)} stage(s)"
                        + (f", {p.micro_batches} micro-batches" if p.micro_batches > 1 else "")
                        + ")"),
            ("max batch x seq", f"{self.max_batch_size} x {self.max_seq_len}"),
            (f"weights{each}", fmt_bytes(self.weight_bytes)),
            *(self.weight_placement.rows(self.weight_bytes) if self.weight_placement else ()),
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
        if self.memory_budget is not None:
            rows.append((f"memory budget{each}", fmt_bytes(self.memory_budget)
                         + (f", a pool of at most {self.pool_tokens} tokens"
                            if self.pool_tokens is not None else "")))
        return rows + [(f"option {k}", repr(v)) for k, v in self.options]

    def __str__(self) -> str:
        return rows_table(self.rows())
