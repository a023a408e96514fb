"""core.build(): model -> policy -> spec -> plan -> weights -> Engine.

The steps, in order, are the "How a build flows" section of docs/architecture.md."""
from __future__ import annotations

import time
import warnings

import attrs
import torch

from .cpu_threads import use_cores
from .distributed.ranks import agreed, rank_device, rank_setup, world_size_for
from .engine import Engine
from .errors import PlanError, UnsupportedModelError
from .loading.packing import SlotPacker
from .loading.gptq import checkpoint_quantizers, weight_quantizer_names
from .loading.source import resolve_source
from .loading.weights import load_weights
from .long_rope import long_rope_mode
from .memory import (activation_bytes, check_fits, device_budget, step_token_budget,
                     resolve_sizes, weight_bytes)
from .plan import Plan
from .plugin_manager import get_plugin_manager
from .preemption import check_mode, policy_for
from .runner.model import DecoderModel
from .runner.model_runner import decode_graphs_for, prefill_graphs_for, step_graphs_for
from .runner.weight_stream import host_slots, streamer_for
from .speculative.config import draft_rows, parse_speculative
from .speculative.speculator import speculation_for
from .selection import (DEFAULT_CACHE_BACKEND, DEFAULT_PLANNER, DTYPES, choose_policy,
                        resolve_device, resolve_dtype, select_plugins)
from .units import element_bytes
from .weight_bytes import step_read_bytes


def _split_options(chosen: list, options: dict) -> dict[int, dict]:
    """Give each chosen plugin the options it declares; unknown ones are an error."""
    per, accepted = {}, set()
    for i, plugin in enumerate(chosen):
        declared = getattr(plugin, "options", {}) or {}
        accepted |= set(declared)
        per[i] = {k: v for k, v in options.items() if k in declared}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise PlanError(f"unknown option(s) {unknown}; the chosen plugins accept: "
                        f"{', '.join(sorted(accepted)) or 'none'}")
    return per


def _kv_quantizer(backend, quantizers):
    """The chosen K/V quantiser (at most one), checked against the backend's formats."""
    kv = [q for q in quantizers if q.applies_to == "kv"]
    if len(kv) > 1:
        raise PlanError(f"plugins name two K/V quantizers, {kv[0].name!r} and {kv[1].name!r}; "
                        "choose one")
    if kv and kv[0].kv_dtype not in getattr(backend, "quantized_kv", ()):
        raise PlanError(f"cache backend {backend.name!r} cannot store {kv[0].kv_dtype} K/V "
                        f"(quantizer {kv[0].name!r}); use a backend that can, e.g. "
                        f"plugins=['paged', {kv[0].name!r}]")
    return kv[0] if kv else None


def _less(n, m):
    return None if n is None else n - m


def _weight_quantizer(quantizers):
    """The chosen weight quantiser (at most one)."""
    found = [q for q in quantizers if q.applies_to == "weights"]
    if len(found) > 1:
        raise PlanError(f"plugins name two weight quantizers, {found[0].name!r} and "
                        f"{found[1].name!r}; choose one")
    return found[0] if found else None


def build(model=None, plugins=None, *, config=None, dtype=None, device=None, max_seq_len=None,
          max_batch_size=None, tokenizer=None, kernels: str = "auto", progress: bool = False,
          device_memory=None, cuda_graphs: bool | None = None,
          prefill_graphs: bool | None = None, step_graphs: bool | None = None,
          max_num_batched_tokens: int | None = None, max_prefill_tokens: int | None = None,
          checkpoint=None, preemption: str = "auto", revision: str | None = None,
          speculative=None, async_steps: bool | None = None, **plugin_options) -> Engine:
    """Compose plugins around ``model`` and return a ready Engine.

    ``config``: a JSON file or a dict of these arguments and plugin options, or
    DeepSpeed's inference keys (docs/config.md); read whole before anything is built, every
    argument given here (other than its default) winning over it, its ``model`` used when
    ``model`` is None. ``checkpoint``: the weights from a directory of safetensors files or
    DeepSpeed's checkpoint JSON, ``model`` then giving the config (e.g. on the meta device).
    A hub id ``model`` ("org/name") loads from the local Hugging Face cache, never the
    network (core/loading/hub.py); ``revision``: its branch, tag or commit (default main).

    ``max_seq_len``: tokens per sequence, prompt + output (default: the model's
    max_position_embeddings, at most ``memory.DEFAULT_MAX_SEQ_LEN``, 4096).
    ``device_memory`` ("80GiB" or bytes) is the budget weights + K/V + the activations of
    a ``max_num_batched_tokens`` step must fit in (default: the free memory of a CUDA device;
    on the CPU the host's physical memory); the paged cache's pool is by default what
    ``gpu_memory_utilization`` (0.9) of it leaves beside the weights and activations, at
    most max_batch_size sequences of max_seq_len (``num_blocks`` overrides). ``cuda_graphs``: decode under CUDA graphs
    (default: on CUDA when the cache supports it); ``step_graphs``: every other step too,
    per token-count bucket (default: with ``cuda_graphs`` where the cache supports it: the
    paged cache); ``prefill_graphs``: a single fresh prompt's prefill, per length bucket,
    on caches without step graphs (default: with ``cuda_graphs`` where the cache supports
    it: the contiguous one). ``max_num_batched_tokens``: tokens one step carries at most,
    decode tokens and prompt chunks together (default ``scheduler.DEFAULT_BATCHED_TOKENS``);
    longer prompts are split (``max_prefill_tokens``: its old name, deprecated).
    ``preemption``: where the cache runs short, "swap" (K/V to host memory and back),
    "recompute" (prefilled again) or "auto" (the cheaper: core/preemption.py).
    ``speculative``: speculative decoding, e.g. ``{"method": "ngram", "k": 4}`` or
    ``{"method": "draft", "model": ..., "k": 4}`` (core/speculative/config.py; None: off).
    ``async_steps``: step N+1 launched before step N's tokens are read, its decode rows
    fed N's tokens on the device (greedy steps only: core/runner/async_steps.py; default
    on where the engine schedules ahead, on CUDA in one process; True runs it on the CPU
    too, False turns it off).
    ``plugins=["tp"]`` under torchrun: tensor parallel over the ranks (core/distributed/)."""
    if config is not None:  # first statement: locals() are the arguments
        from .config import explicit_arguments, resolve_config
        return build(**resolve_config(config, explicit_arguments(build, locals())))
    t0 = time.perf_counter()
    max_num_batched_tokens = _budget_alias(max_num_batched_tokens, max_prefill_tokens)
    check_mode(preemption)
    for flag, value in (("cuda_graphs", cuda_graphs), ("prefill_graphs", prefill_graphs),
                        ("step_graphs", step_graphs), ("progress", progress),
                        ("async_steps", async_steps)):
        if value is not None and not isinstance(value, bool):
            raise PlanError(f"{flag} must be True, False or None (the default), got {value!r}")
    pm, sel = select_plugins(get_plugin_manager(), plugins)
    speculation = parse_speculative(speculative, pm.proposers())  # checked before loading
    source = resolve_source(model, tokenizer, checkpoint=checkpoint, revision=revision)
    policy = choose_policy(pm, source.config, sel.policy)
    spec = policy.describe(source.config)
    device = resolve_device(device)
    default_dtype = source.dtype if source.dtype in DTYPES.values() else torch.float32
    dtype = resolve_dtype(dtype, default_dtype)
    backend = pm.cache_backends().get(sel.cache_backend or DEFAULT_CACHE_BACKEND)
    _check_attention(pm, backend, spec)
    planner = pm.planners().get(sel.planner or DEFAULT_PLANNER)
    # a GPTQ / AWQ checkpoint's projections arrive as int4 (loading/gptq.py)
    names = weight_quantizer_names(source.prequantized, sel.quantizers, pm.quantizers())
    quantizers = [pm.quantizers().get(n) for n in names]
    opts = _split_options([backend, planner, *quantizers], plugin_options)
    quantizers = [q.configured(**opts[2 + i]) for i, q in enumerate(quantizers)]
    quantizers = checkpoint_quantizers(source.prequantized, quantizers, plugin_options)
    kv_quant = _kv_quantizer(backend, quantizers)
    weight_quant = _weight_quantizer(quantizers)

    parallel = planner.plan(spec, world_size_for(planner, device, opts[1]), **opts[1])
    rank = rank_setup(planner, spec, parallel)  # what this process runs of the plan
    device, run_spec = rank_device(device, parallel), rank.spec
    use_cores(device)  # torch's threads on the CPU, from the cores left to this process
    preempt = policy_for(preemption, run_spec, device, dtype, parallel.world_size)
    max_seq_len, max_batch_size = resolve_sizes(spec, max_seq_len, max_batch_size)
    long_rope, opts[0] = long_rope_mode(spec.rope, max_seq_len, backend, opts[0])
    step_tokens = step_token_budget(max_num_batched_tokens)
    from infergraft.kernels import switches  # here, not at import: it imports triton
    from infergraft.kernels.dispatch import get_ops

    ops = get_ops(device, kernels)
    plan = Plan(
        model=source.name, architecture=spec.architecture, policy=policy.name,
        dtype=str(dtype).replace("torch.", ""), device=str(device), kernels=ops.backend,
        max_seq_len=max_seq_len, max_batch_size=max_batch_size, cache_backend=backend.name,
        kv_dtype=kv_quant.kv_dtype if kv_quant else str(dtype).replace("torch.", ""),
        quantizers=names,
        planner=planner.name, parallel=parallel,
        weight_bytes=weight_bytes(run_spec, dtype, weight_quant, device, ops.backend)  # this rank's
        - rank.not_held * element_bytes(dtype),
        step_weight_bytes=_less(step_read_bytes(run_spec, dtype, weight_quant, device, ops.backend),
                                rank.not_held * element_bytes(dtype)),
        kv_bytes_per_token=backend.bytes_per_token(run_spec, dtype, kv_quant) if kv_quant
        else backend.bytes_per_token(run_spec, dtype),
        options=tuple(sorted(plugin_options.items())), sliding_window=spec.kv_window,
        max_num_batched_tokens=step_tokens,
        activation_bytes=activation_bytes(run_spec, dtype, step_tokens, max_batch_size))
    plan = _with_activations(pm.prepare_plan(plan, spec), plan, run_spec, dtype)
    budget, budget_source = device_budget(device, device_memory)
    if hasattr(planner, "place_weights"):  # layers that do not fit stay in host memory
        # placed beside the default pool, which then keeps its size (no memory_budget)
        plan = attrs.evolve(plan, weight_placement=planner.place_weights(
            plan, run_spec, budget, _kv_bytes(backend, plan, device, opts[0]),
            weight_quantizer=weight_quant, **opts[1]))
    else:  # the cache may size its pool to what the weights and activations leave
        plan = attrs.evolve(plan, memory_budget=budget)
    # before any weight is loaded, and every rank's verdict on every rank (device_bytes
    # refuses a pool sized to the budget that cannot hold one sequence)
    agreed(lambda: check_fits(plan, _kv_bytes(backend, plan, device, opts[0]), budget,
                              budget_source), parallel)
    plan = _same_pool(plan, _kv_bytes(backend, plan, device, opts[0]), parallel)

    # each layer composed from the implementations the spec names (infergraft_register_layers)
    net = DecoderModel(run_spec, ops, device, plan.max_seq_len, tp=rank.tp, stage=rank.stage,
                       layers=pm.layers())
    tensors = source.tensors()
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, desc="loading weights", unit=" tensors", leave=False)
    pack = None if weight_quant is None else SlotPacker(weight_quant, ops, net,
                                                        net.will_fuse(dtype), device)
    load_weights(net, spec, policy.weight_map(spec), tensors, policy_name=policy.name,
                 device=device, dtype=dtype, on_slot_ready=pack,  # packed as they stream in
                 place=rank.place,  # this rank's pieces
                 device_of=host_slots(plan.weight_placement))  # streamed layers: to the host
    if pack is not None:
        pack.finish()
    net.fold_norm_weights()  # where the fused decode layer runs (Triton ops, RMSNorm + SwiGLU)
    net.streamer = streamer_for(net, plan.weight_placement, device)  # host buffers + ring
    if kv_quant is not None:
        opts[0]["kv_quantizer"] = kv_quant
    cache = backend.create(run_spec, plan, device=device, dtype=dtype, ops=ops, **opts[0])
    engine = Engine(net.eval(), cache, source.tokenizer, plan, spec, plan.max_num_batched_tokens)
    engine.ranks, engine.scheduler.preemption = rank.ranks, preempt
    engine.scheduler.long_rope = engine.runner.long_rope = long_rope  # LongRoPE's per sequence
    engine.constraints.processors = pm.logits_processors()  # inline plugins' too
    engine.schedule_ahead = device.type == "cuda" and rank.ranks is None \
        and switches.value("INFERGRAFT_SCHEDULE_AHEAD")
    engine.async_steps.enabled = _async_steps(async_steps, rank.ranks, engine.schedule_ahead)
    engine.schedule_ahead |= engine.async_steps.enabled  # (the step it launches early)
    engine.decode_graphs = decode_graphs_for(net, cache, plan, device, cuda_graphs)
    engine.prefill_graphs = prefill_graphs_for(net, cache, plan, engine.decode_graphs,
                                               prefill_graphs)
    engine.runner.step_graphs = step_graphs_for(net, cache, plan, engine.decode_graphs,
                                                plan.max_num_batched_tokens, step_graphs,
                                                draft_rows(speculation, plan.max_batch_size))
    engine.speculation = speculation_for(engine, speculation, pm.proposers(), build)
    engine.build_seconds = time.perf_counter() - t0
    return engine


def _async_steps(wanted: bool | None, ranks, schedules_ahead: bool) -> bool:
    """Whether the engine launches a step before reading the one before (default: where
    it schedules ahead, on CUDA in one process; docs/BENCHMARKS.md has the runs)."""
    if wanted and ranks is not None:
        raise PlanError("async_steps=True runs in one process: tensor / pipeline parallel "
                        "ranks take the sampling rank's tokens after every step; leave it "
                        "out (None) or False")
    return schedules_ahead if wanted is None else bool(wanted)


def _check_attention(pm, backend, spec) -> None:
    """UnsupportedModelError where the model's attention asks for what the cache backend
    does not declare it honours (``CacheBackend.attention_features``), naming both."""
    from .spec import ATTENTION_FEATURES

    has = set(getattr(backend, "attention_features", ()))
    missing = [f for f in spec.attention_features if f not in has]
    if missing:
        able = [n for n in pm.cache_backends().names()
                if set(missing) <= set(getattr(pm.cache_backends().get(n),
                                               "attention_features", ()))]
        raise UnsupportedModelError(
            f"{spec.architecture} needs {'; '.join(ATTENTION_FEATURES[f] for f in missing)}, "
            f"which cache backend {backend.name!r} does not declare it implements "
            f"(CacheBackend.attention_features); backends that do: {', '.join(able) or 'none'}")


def _budget_alias(budget, old):
    """``max_num_batched_tokens``, or the value given under its old name (warned)."""
    if old is None:
        return budget
    if budget is not None and budget != old:
        raise PlanError(f"max_prefill_tokens={old!r} and max_num_batched_tokens={budget!r} "
                        "name the same step budget; give only max_num_batched_tokens")
    warnings.warn("max_prefill_tokens is now max_num_batched_tokens (the step's token budget, "
                  "decode tokens included)", DeprecationWarning, stacklevel=3)
    return old


def _kv_bytes(backend, plan, device, options) -> int:
    """The K/V bytes a cache of ``plan`` holds in ``device``'s memory."""
    kv = getattr(backend, "device_bytes", lambda p, **o: p.kv_bytes_total)(plan, **options)
    if device.type == "cpu":  # a cache's host pool (offload's slow blocks) is this memory too
        kv += getattr(backend, "host_bytes", lambda p, **o: 0)(plan, **options)
    return kv


def _same_pool(plan, kv_bytes: int, parallel):
    """Every rank schedules on its own cache, so every rank's pool must hold as many
    tokens: a pool sized to each rank's budget is cut to the smallest (``pool_tokens``)."""
    if parallel.world_size == 1 or plan.memory_budget is None:
        return plan
    tokens = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(tokens, kv_bytes // plan.kv_bytes_per_token)
    return plan if len(set(tokens)) == 1 else attrs.evolve(plan, pool_tokens=min(tokens))


def _with_activations(plan, before, spec, dtype):
    """``plan`` (from the prepare_plan hooks) with its activation bytes recounted for its
    batch and prefill step, unless a hook set them itself (they differ from ``before``)."""
    step_tokens = step_token_budget(plan.max_num_batched_tokens)
    counted = plan.activation_bytes
    if counted == before.activation_bytes:  # a hook may have changed the batch or the step
        counted = activation_bytes(spec, dtype, step_tokens, plan.max_batch_size)
    return attrs.evolve(plan, max_num_batched_tokens=step_tokens, activation_bytes=counted)
