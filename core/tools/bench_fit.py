"""Whether ``infergraft bench``'s two copies of a model, HF's and our engine's, fit its
device together, and the order the systems run in.

- **interleaved** (both fit): HF's model on the device, our engine built from it, each
  batch measured on every system in turn;
- **sequential** (only one at a time fits): our engine built from HF's weights in host
  memory (``core.build`` copies them to the device) and measured at every batch, the
  ``--compare-plugins`` builds after it, each freed; then HF's model moved to the device
  and measured, each batch against the roofline of our engine's plan;
- neither copy fits alone: a PlanError that says so, before anything is loaded.

The choice is made from the shapes before any weight is loaded: each copy's weights (ours
packed as ``--plugins`` quantise them), its K/V for the largest batch and its activations
(``core.memory.plan_memory``'s estimates), against ``gpu_memory_utilization`` (the paged
cache's default, 0.9) of the device's free memory (``core.budget.device_budget``; a
``--config``'s ``device_memory`` instead)."""
from __future__ import annotations

import itertools
import math
from typing import Optional

import attrs
import torch

from .. import budget
from ..errors import PlanError
from ..memory import activation_bytes, plan_memory
from ..plugin_manager import get_plugin_manager
from ..units import element_bytes, fmt_bytes, kv_bytes_per_token
from .bench import Roofline, run_benchmark
from .bench_variants import BASE, engine_plugins, free_device, run_variants

INTERLEAVED, SEQUENTIAL = "interleaved", "sequential"
UTILIZATION = 0.9  # the paged cache's default gpu_memory_utilization


@attrs.frozen
class Fit:
    """The bytes each copy needs, the device's budget, and the order they give."""

    model: str
    ours: int  # our engine: weights, K/V of max_batch x max_seq_len, a step's activations
    ours_least: int  # what its build refuses below: weights, activations, one sequence's K/V
    ours_weights: int
    hf: int  # HF's model: weights, its K/V, its batch's prefill activations; 0 without HF
    hf_weights: int
    budget: Optional[int]  # None: it could not be read (both copies then taken to fit)
    source: str  # where the budget comes from
    utilization: float = UTILIZATION

    @property
    def room(self) -> float:
        return math.inf if self.budget is None else int(self.budget * self.utilization)

    @property
    def order(self) -> str:
        if not self.hf:  # HF not measured: its model on the device would only take room
            return SEQUENTIAL
        return INTERLEAVED if self.ours + self.hf <= self.room else SEQUENTIAL

    def sizes(self) -> str:
        hf = f" + HF's {fmt_bytes(self.hf)}" if self.hf else ""
        of = "an unread budget" if self.budget is None else \
            f"{self.utilization:g} x {fmt_bytes(self.budget)} ({self.source})"
        return f"our engine's {fmt_bytes(self.ours)}{hf} against {of}"

    def describe(self) -> str:
        if not self.hf:
            return (f"order: our engine alone (built from HF's weights in host memory, which "
                    f"stay there): {self.sizes()}")
        if self.order == INTERLEAVED:
            return (f"order: interleaved (HF's model and our engine on the device together, "
                    f"each batch on every system in turn): {self.sizes()}")
        return (f"order: sequential (the two copies do not fit together: our engine built "
                f"from HF's weights in host memory and measured at every batch, freed, then "
                f"HF's model moved to the device and measured): {self.sizes()}")

    def check(self) -> None:
        """PlanError where a copy does not fit the device even alone."""
        if self.ours_least > self.room:
            raise PlanError(
                f"{self.model} does not fit the device even alone: our engine needs "
                f"{fmt_bytes(self.ours_least)} (weights {fmt_bytes(self.ours_weights)}, "
                f"activations, one sequence's K/V) > {self.utilization:g} x "
                f"{fmt_bytes(self.budget)} ({self.source}); use a smaller --dtype, a weight "
                "quantiser (--plugins int8), or several devices (--tensor-parallel)")
        if self.hf > self.room:
            raise PlanError(
                f"{self.model}: HF's model does not fit the device even alone: it needs "
                f"{fmt_bytes(self.hf)} (weights {fmt_bytes(self.hf_weights)}, its K/V and "
                f"prefill activations) > {self.utilization:g} x {fmt_bytes(self.budget)} "
                f"({self.source}); measure our engine alone (--systems infergraft), or use a "
                "smaller --dtype or --batches")


def quantizers(names) -> tuple:
    """(the weight quantiser, the K/V quantiser) among plugin ``names``, None where none."""
    registry = get_plugin_manager().quantizers()
    chosen = [registry.get(n) for n in names if n in registry.names()]
    return tuple(next((q for q in chosen if q.applies_to == kind), None)
                 for kind in ("weights", "kv"))


def fit_of(args) -> Fit:
    """The Fit of ``args`` (resolved ``infergraft bench`` flags), from the model's config."""
    from .plan_cli import model_spec

    _, spec, _ = model_spec(args.model)
    options = args.config_options or {}
    plugins = engine_plugins(args.device, [*(options.get("plugins") or ()), *args.plugins])
    weight_quant, kv_quant = quantizers(plugins)
    batch, seq_len, dtype = max(args.batches), args.prompt_len + args.new_tokens, args.dtype
    mem = plan_memory(spec, model=args.model, dtype=dtype, weight_quantizer=weight_quant,
                      kv_quantizer=kv_quant, max_seq_len=seq_len, max_batch_size=batch,
                      max_num_batched_tokens=args.max_num_batched_tokens, device=args.device)
    hf_weights = spec.param_count * element_bytes(dtype)
    # generate prefills the whole batch in one forward, and its cache holds it in dtype
    hf = hf_weights + batch * seq_len * kv_bytes_per_token(spec, dtype) + activation_bytes(
        spec, dtype, batch * args.prompt_len, batch)
    limit, source = budget.device_budget(args.device, options.get("device_memory"))
    return Fit(args.model, ours=mem.total_bytes,
               ours_least=mem.device_weight_bytes + mem.activation_bytes
               + mem.kv_bytes_per_sequence, ours_weights=mem.device_weight_bytes,
               hf=hf if set(args.systems) - {BASE} else 0, hf_weights=hf_weights,
               budget=limit, source=source, utilization=budget.check_utilization(
                   options.get("gpu_memory_utilization", UTILIZATION)))

def run_in_turn(hf, build, args, log) -> tuple[list, float]:
    """(results, copy bandwidth) in the sequential order: our engine (``build(hf, plugins)``
    from ``hf`` in host memory) at every batch, freed, each ``--compare-plugins`` build
    likewise, then ``hf`` moved to the device for HF's systems. The rows come in the
    interleaved order's sequence (batch, then system), the variants' after them."""
    ours = [s for s in args.systems if s == BASE]
    theirs = [s for s in args.systems if s != BASE]
    free_device()  # what HF's model left cached, were it made on the device
    engine = build(hf, ())
    log(engine.plan)
    results, bw = run_benchmark(None, engine, args.batches, args.prompt_len, args.new_tokens,
                                ours, log=log)
    roofline = Roofline.of(engine)
    del engine  # the only reference: its weights, cache and graphs go with it
    free_device()
    if str(args.device).startswith("cuda"):  # what the engine left, were it still referenced
        log(f"our engine freed: {fmt_bytes(torch.cuda.memory_allocated(args.device))} "
            f"still allocated on {args.device}")
    variants = run_variants(hf, lambda plugins: build(hf, plugins), args, bw)
    if theirs:
        hf.to(args.device)
        results += run_benchmark(hf, None, args.batches, args.prompt_len, args.new_tokens,
                                 theirs, bandwidth=bw, log=log, roofline=roofline)[0]
    sequence = {key: i for i, key in enumerate(itertools.product(args.batches, args.systems))}
    return sorted(results, key=lambda r: sequence[(r.batch, r.system)]) + variants, bw

