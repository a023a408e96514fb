"""Memory planner: weight, K/V and activation bytes from the config alone (nothing is
loaded).

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element,
plus, for quantised K/V, the per-token, per-head scales. Activations: an upper bound of
what the largest forward step holds at its peak (``activation_bytes``), the memory vLLM
reserves after its profile run. ``infergraft plan`` prints these numbers; ``core.build``
refuses a configuration whose weights + K/V + activations do not fit. The budget itself,
and the paged pool sized from what the weights and activations leave of it: ``budget.py``.
"""
from __future__ import annotations

import numbers
import warnings
from typing import Optional

import attrs
import torch

from ._moved import moved_names
from .errors import PlanError
from .rope import check_rope_range
from .scheduler import DEFAULT_BATCHED_TOKENS
from .units import (KVSizes, activations_label, both_units, element_bytes,  # noqa: F401
                    fmt_bytes, kv_bytes_per_token, parse_bytes, rows_table)
from .budget import (as_bytes, check_utilization, device_budget, host_memory,  # noqa: F401
                     pool_blocks)
from .weight_bytes import active_weight_bytes, expert_counts, weight_bytes  # noqa: F401


def positive_int(name: str, value, hint: str = "") -> int:
    """``value`` as an int if it is an integer >= 1 (numpy's too), else PlanError naming
    ``name`` (+ ``hint``)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{name} must be an integer >= 1, got {value!r}{hint}")
    return int(value)


# max_seq_len=None: the model's positions, capped on every device (the contiguous cache
# reserves max_batch_size x max_seq_len tokens up front); the flags' help and the docs say
# it in these words
DEFAULT_MAX_SEQ_LEN = 4096
MAX_SEQ_LEN_DEFAULT = f"the model's max_position_embeddings, at most {DEFAULT_MAX_SEQ_LEN}"
DEFAULT_MAX_BATCH_SIZE = 8


def resolve_sizes(spec, max_seq_len, max_batch_size) -> tuple[int, int]:
    """``max_seq_len`` and ``max_batch_size`` as ``core.build`` and the planner take them:
    None for the defaults, else integers >= 1 (PlanError otherwise)."""
    hint = " (or None for the default)"
    seq = positive_int("max_seq_len", min(spec.max_position, DEFAULT_MAX_SEQ_LEN)
                       if max_seq_len is None else max_seq_len, hint)
    if spec.position == "learned" and seq > spec.max_position:
        raise PlanError(f"max_seq_len={seq} exceeds the model's {spec.max_position} "
                        "learned positions")
    check_rope_range(spec.rope, seq, spec.max_position)  # dynamic NTK: where it is HF's
    if seq > spec.max_position:  # RoPE runs on, but the model never saw those positions
        warnings.warn(f"max_seq_len={seq} exceeds the model's max_position_embeddings="
                      f"{spec.max_position}: output past that position may degrade",
                      stacklevel=3)
    return seq, positive_int("max_batch_size", DEFAULT_MAX_BATCH_SIZE if max_batch_size is None
                             else max_batch_size, hint)


def step_token_budget(max_num_batched_tokens) -> int:
    """Tokens one step carries at most: ``max_num_batched_tokens``, or the engine's
    default (``scheduler.DEFAULT_BATCHED_TOKENS``) for None."""
    if max_num_batched_tokens is None:
        return DEFAULT_BATCHED_TOKENS
    return positive_int("max_num_batched_tokens", max_num_batched_tokens, " (or None for the default)")


def activation_bytes(spec, dtype: torch.dtype, step_tokens: int, max_batch_size: int) -> int:
    """Upper bound of the transient bytes one forward step of ``step_tokens`` tokens (the
    step's token budget: decode tokens and prompt chunks together) holds at its peak: an
    estimate from the shapes, not a measurement.

    Counted, in ``dtype``: the tensors ``core.runner.model.DecoderLayer.forward`` keeps alive
    together (the formula below) for T = step_tokens rows, plus
    the LM head's logits and their float32 copy for max_batch_size rows (a step samples
    one row per sequence). Not counted: scratch inside kernels (attention workspace; the
    CPU's torch reference ops add float32 temporaries, the Triton kernels on CUDA none),
    a weight quantiser's widened weights, CUDA-graph pools, and ``Engine.logits``, which
    returns the logits of every row.
    """
    positive_int("step_tokens", step_tokens)
    positive_int("max_batch_size", max_batch_size)
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    mlp = 3 * spec.intermediate_size if spec.gated_mlp else 2 * spec.intermediate_size
    # a mixture of experts: the router's logits, each (token, expert) pair's activation
    # and weighted output (k I + k H: ops.fused_moe's), their sum
    for x in (layer.experts for layer in spec.layers if layer.experts is not None):
        mlp = max(mlp, x.num_experts + x.top_k * (x.intermediate_size + h) + h)
    # Per row: the layer's input stream and residual, the new residual and the normed
    # input (4H), and the largest of what the three phases add to them: attention (qkv,
    # rotated q and k, its output: 3q + 3kv), the second norm (o output, the new residual
    # and normed input while the first pair is still bound, attention output: 3H + q),
    # the MLP (o output, attention output, gate_up and its activation: H + q + 3I, or
    # fc_in and its activation: H + q + 2I).
    per_row = 4 * h + max(3 * q + 3 * kv, 3 * h + q, h + q + mlp)
    rows = step_tokens
    e = element_bytes(dtype)
    logits_per_row = spec.vocab_size * (4 if e == 4 else e + 4)  # float32: no copy
    return rows * per_row * e + max_batch_size * logits_per_row


@attrs.frozen
class MemoryPlan(KVSizes):
    """The numbers of one configuration; ``str()`` is the table ``infergraft plan`` prints."""

    model: str
    dtype: str
    kv_dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    max_seq_len: int
    max_batch_size: int
    budget: Optional[int] = None
    budget_source: str = ""
    sliding_window: Optional[int] = None  # the model's attention window, if any
    activation_bytes: int = 0  # the largest step's transient tensors (activation_bytes())
    max_num_batched_tokens: Optional[int] = None  # that step's tokens
    weight_placement: Optional[object] = None  # plan.WeightPlacement: layers in host memory
    device: Optional[str] = None  # where the weights are held ("cpu", "cuda"), when known
    # a mixture of experts: the parameters, those one token runs through (its top_k
    # experts a layer) and their bytes (active_weight_bytes); None without experts
    param_count: int = 0
    active_param_count: int = 0
    active_weight_bytes: Optional[int] = None
    experts: str = ""  # e.g. "top-2 of 8 experts a layer"

    @property
    def device_weight_bytes(self) -> int:
        p = self.weight_placement  # all the weights, or those a placement keeps on the device
        return self.weight_bytes if p is None else p.device_bytes(self.weight_bytes)

    @property
    def window_tokens(self) -> Optional[int]:
        """K/V tokens a sequence needs once its prompt is in, when a sliding window
        shorter than max_seq_len bounds it (the caches then hold about that many)."""
        w = self.sliding_window
        return w if w and w < self.max_seq_len else None

    @property
    def max_batch_with_window(self) -> Optional[int]:
        """Largest batch when every sequence but one (a prompt at max_seq_len, held whole
        until it decodes) holds only its window's K/V; None without a window or budget."""
        if self.budget is None or self.window_tokens is None:
            return None
        room = self.kv_room - self.kv_bytes_per_sequence
        if room < 0:
            return 0
        return 1 + room // (self.window_tokens * self.kv_bytes_per_token)

    @property
    def total_bytes(self) -> int:
        return self.device_weight_bytes + self.kv_bytes_total + self.activation_bytes

    @property
    def kv_room(self) -> Optional[int]:
        """Budget left for K/V once the weights and the activations are in."""
        if self.budget is None:
            return None
        return self.budget - self.device_weight_bytes - self.activation_bytes

    @property
    def max_batch_that_fits(self) -> Optional[int]:
        """Largest batch of ``max_seq_len`` sequences whose K/V fit beside the weights and
        the activations (those counted at ``max_batch_size``)."""
        if self.budget is None:
            return None
        return max(0, self.kv_room // self.kv_bytes_per_sequence)

    @property
    def activation_label(self) -> str:
        return activations_label(self.max_num_batched_tokens)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total_bytes <= self.budget

    def rows(self) -> list[tuple[str, str]]:
        fit = self.max_batch_that_fits
        rows = [
            ("model", self.model),
            ("dtype / K/V dtype", f"{self.dtype} / {self.kv_dtype}"),
            ("weights", fmt_bytes(self.weight_bytes)),
            *self.expert_rows(),
            *(self.weight_placement.rows(self.weight_bytes) if self.weight_placement else ()),
            ("KV per token", f"{both_units(self.kv_bytes_per_token)} "
                             f"({self.kv_bytes_per_token} B)"),
            (f"KV per sequence ({self.max_seq_len} tokens)",
             both_units(self.kv_bytes_per_sequence)),
            (f"KV total (batch {self.max_batch_size})", both_units(self.kv_bytes_total)),
            (self.activation_label, fmt_bytes(self.activation_bytes)),
            ("weights + KV + activations", fmt_bytes(self.total_bytes)),
        ]
        if self.budget is None:
            rows.append(("budget", "not given (--device-memory)"))
        else:
            rows += [("budget", f"{fmt_bytes(self.budget)} ({self.budget_source})"),
                     ("fits", "yes" if self.fits else "NO"),
                     (f"largest batch at {self.max_seq_len} tokens", str(fit))]
        if self.window_tokens:  # the counts above are full length: an upper bound
            rows.append((f"KV per sequence in its window ({self.window_tokens} tokens)",
                         fmt_bytes(self.window_tokens * self.kv_bytes_per_token)))
            if self.budget is not None:
                rows.append(("largest batch with windows", f"{self.max_batch_with_window} "
                             "(one prompt at full length, the rest at their window)"))
        return rows

    def expert_rows(self) -> list[tuple[str, str]]:
        """A mixture of experts: its parameters, total and active, and the active ones'
        bytes, which bound a batch-1 decode step (it reads no other expert)."""
        if self.active_weight_bytes is None:
            return []
        return [("parameters", f"{self.param_count / 1e9:.3g}B, {self.active_param_count / 1e9:.3g}B "
                               f"active ({self.experts})"),
                ("active weights", f"{fmt_bytes(self.active_weight_bytes)} (what a batch-1 "
                                   "decode step reads: the routed experts, the rest whole)")]

    def __str__(self) -> str:
        return rows_table(self.rows())

    def refusal(self) -> str:
        n = self.max_num_batched_tokens
        step = f" ({n}-token prefill steps)" if n else ""
        on_device = " on the device" if self.weight_placement else ""
        return (f"{self.model} does not fit: weights{on_device} "
                f"{fmt_bytes(self.device_weight_bytes)} + K/V "
                f"{fmt_bytes(self.kv_bytes_total)} ({self.max_batch_size} sequences x "
                f"{self.max_seq_len} tokens x {fmt_bytes(self.kv_bytes_per_token)} per token) + "
                f"activations {fmt_bytes(self.activation_bytes)}{step} = "
                f"{fmt_bytes(self.total_bytes)} > {fmt_bytes(self.budget)} "
                f"({self.budget_source}); the largest batch of {self.max_seq_len}-token "
                f"sequences that fits is {self.max_batch_that_fits}"
                + (f" ({self.max_batch_with_window} with one prompt at full length and the "
                   f"rest in their {self.window_tokens}-token window)" if self.window_tokens else "")
                + ". Lower max_batch_size, max_seq_len or max_num_batched_tokens, store K/V as "
                "int8 (plugins=['paged', 'kv-int8']), or use a smaller dtype")


def plan_memory(spec, *, model: str = "", dtype: torch.dtype = torch.float32,
                kv_quantizer=None, max_seq_len: Optional[int] = None,
                max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, budget: Optional[int] = None,
                budget_source: str = "", weight_quantizer=None,
                max_num_batched_tokens: Optional[int] = None, device=None) -> MemoryPlan:
    """The memory plan of ``spec`` (weights from ``spec.param_count``, packed by
    ``weight_quantizer`` when given, as it holds them on ``device``; activations of a
    ``max_num_batched_tokens`` step, by default the engine's:
    ``scheduler.DEFAULT_BATCHED_TOKENS``)."""
    max_seq_len, max_batch_size = resolve_sizes(spec, max_seq_len, max_batch_size)
    step = step_token_budget(max_num_batched_tokens)
    kv_dtype = kv_quantizer.kv_dtype if kv_quantizer is not None else str(dtype)
    return MemoryPlan(model=model or spec.architecture, dtype=str(dtype).replace("torch.", ""),
                      kv_dtype=kv_dtype.replace("torch.", ""),
                      weight_bytes=weight_bytes(spec, dtype, weight_quantizer, device),
                      kv_bytes_per_token=kv_bytes_per_token(spec, dtype, kv_quantizer),
                      max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                      budget=budget, budget_source=budget_source,
                      sliding_window=getattr(spec, "kv_window", None),
                      activation_bytes=activation_bytes(spec, dtype, step, max_batch_size),
                      max_num_batched_tokens=step, device=None if device is None else str(device),
                      **expert_counts(spec, dtype, weight_quantizer))


def check_fits(plan, kv_device_bytes: int, budget: Optional[int], source: str) -> None:
    """Raise PlanError, with the numbers, if weights + K/V + activations (the plan's
    ``activation_bytes``) exceed ``budget``."""
    if budget is None:
        return
    activations = getattr(plan, "activation_bytes", 0)
    mem = MemoryPlan(model=plan.model, dtype=plan.dtype, kv_dtype=plan.kv_dtype,
                     weight_bytes=plan.weight_bytes, kv_bytes_per_token=plan.kv_bytes_per_token,
                     max_seq_len=plan.max_seq_len, max_batch_size=plan.max_batch_size,
                     budget=budget, budget_source=source,
                     sliding_window=getattr(plan, "sliding_window", None),
                     activation_bytes=activations,
                     max_num_batched_tokens=getattr(plan, "max_num_batched_tokens", None),
                     weight_placement=getattr(plan, "weight_placement", None))
    if mem.device_weight_bytes + kv_device_bytes + activations > budget:
        msg = mem.refusal()
        if kv_device_bytes != plan.kv_bytes_total:  # a backend sized its pool otherwise
            msg += (f" (the {plan.cache_backend} cache holds {fmt_bytes(kv_device_bytes)} of "
                    "K/V on the device)")
        raise PlanError(msg)


__getattr__ = moved_names(__name__)  # names that moved out, for one release
