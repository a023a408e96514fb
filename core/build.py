"""core.build(): model -> policy -> spec -> plan -> weights -> Engine (DESIGN §3)."""
from __future__ import annotations

import time
from typing import Any, Iterable, Optional

import attrs
import torch


from .engine import Engine
from .errors import PlanError, UnknownPluginError, UnsupportedModelError
from .memory import (activation_bytes, check_fits, device_budget, element_bytes,
                     prefill_step_tokens, resolve_sizes, weight_bytes)
from .model import DecoderModel
from .parallel import rank_device, rank_setup, world_size_for
from .plan import Plan
from .quant import SlotPacker
from .plugins import PluginManager, get_plugin_manager
from .source import resolve_source
from .weights import load_weights

DEFAULT_CACHE_BACKEND = "contiguous"
DEFAULT_PLANNER = "single"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@attrs.define
class Selection:
    """What ``plugins=[...]`` asked for, sorted by kind."""

    policy: Optional[str] = None
    cache_backend: Optional[str] = None
    planner: Optional[str] = None
    quantizers: list[str] = attrs.field(factory=list)


def resolve_dtype(dtype, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise PlanError(f"unsupported dtype {dtype!r}; choose float32, bfloat16 or float16")


def resolve_device(device) -> torch.device:
    """``device`` (None: cuda if present, else cpu) as a torch.device this machine has."""
    here = "cpu" + (f", cuda:0..{torch.cuda.device_count() - 1}" if torch.cuda.is_available() else "")
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError, ValueError):
        raise PlanError(f"device {device!r} is not a device name; available here: {here}") from None
    if dev.type not in ("cpu", "cuda"):
        raise PlanError(f"device type {dev.type!r} is not supported; use cpu or cuda (here: {here})")
    if dev.type == "cuda" and (not torch.cuda.is_available() or
                               (dev.index or 0) >= torch.cuda.device_count()):
        raise PlanError(f"device {str(dev)!r} is not available here; available: {here}")
    return dev


def select_plugins(pm: PluginManager, plugins: Optional[Iterable[Any]]):
    """Resolve names and plugin objects; returns (manager, Selection)."""
    if plugins is not None and (isinstance(plugins, (bytes, dict))
                                or not isinstance(plugins, (str, Iterable))):
        raise UnknownPluginError(f"plugins must be a list of names and plugin objects, got "
                                 f"{type(plugins).__name__} {plugins!r}")
    plugins = [plugins] if isinstance(plugins, str) else list(plugins or [])
    objects = [p for p in plugins if not isinstance(p, str)]
    names = [p for p in plugins if isinstance(p, str)]
    if objects:
        before = {k: set(r.names()) for k, r in pm.registries().items()}
        pm = pm.copy_with(objects)
        for kind, reg in pm.registries().items():  # what the objects brought is selected
            names += sorted(set(reg.names()) - before[kind])
    regs = pm.registries()
    sel = Selection()
    for name in names:
        kinds = [k for k, r in regs.items() if name in r]
        if not kinds:
            known = "; ".join(f"{'policies' if k == 'policy' else k + 's'}: "
                              f"{', '.join(r.names()) or '-'}" for k, r in regs.items())
            raise UnknownPluginError(f"unknown plugin {name!r}. Registered {known}")
        kind = kinds[0]
        if kind == "quantizer":
            if name not in sel.quantizers:
                sel.quantizers.append(name)
            continue
        field = {"policy": "policy", "cache backend": "cache_backend", "planner": "planner"}[kind]
        if getattr(sel, field) not in (None, name):
            raise PlanError(f"plugins name two {kind}s, {getattr(sel, field)!r} and {name!r}; "
                            "choose one")
        setattr(sel, field, name)
    return pm, sel


def choose_policy(pm: PluginManager, config, forced: Optional[str]):
    registry = pm.policies()
    if forced is not None:
        policy = registry.get(forced)
        policy.check(config)
        return policy
    claimants = [p for p in registry if p.claims(config)]
    archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
    if not claimants:
        supported = sorted({a for p in registry for a in p.architectures})
        raise UnsupportedModelError(
            f"no registered policy supports {', '.join(archs)}; supported architectures: "
            f"{', '.join(supported) or '(none)'}")
    if len(claimants) > 1:
        names = ", ".join(repr(p.name) for p in claimants)
        raise UnsupportedModelError(f"policies {names} (plugins {', '.join(registry.origin(p.name) for p in claimants)}) "
                                    f"all claim {', '.join(archs)}; pick one with plugins=[name]")
    return claimants[0]


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


def _weight_quantizer(quantizers):
    """The chosen weight quantiser (at most one)."""
    found = [q for q in quantizers if q.applies_to == "weights"]
    if len(found) > 1:
        raise PlanError(f"plugins name two weight quantizers, {found[0].name!r} and "
                        f"{found[1].name!r}; choose one")
    return found[0] if found else None


def build(model, plugins=None, *, dtype=None, device=None, max_seq_len=None,
          max_batch_size=None, tokenizer=None, kernels: str = "auto", progress: bool = False,
          device_memory=None, cuda_graphs: bool | None = None,
          prefill_graphs: bool | None = None, max_prefill_tokens: int | None = None,
          **plugin_options) -> Engine:
    """Compose plugins around ``model`` and return a ready Engine (see DESIGN §3).

    ``device_memory`` ("80GiB" or bytes) is the budget weights + K/V + the activations of
    a ``max_prefill_tokens`` step must fit in (default: the free memory of a CUDA device;
    on the CPU the host's physical memory). ``cuda_graphs``: decode under CUDA graphs
    (default: on CUDA when the cache supports it); ``prefill_graphs``: a single fresh
    prompt's prefill too, per length bucket (default: with ``cuda_graphs`` when the cache
    supports it). ``max_prefill_tokens``: prompt tokens one prefill step feeds at most
    (default max(max_seq_len, 2048)); a longer prompt is prefilled in chunks, each step
    also carrying one decode token of every running sequence. ``plugins=["tp"]`` under
    torchrun: tensor parallel over the ranks (core/parallel.py)."""
    t0 = time.perf_counter()
    for flag, value in (("cuda_graphs", cuda_graphs), ("prefill_graphs", prefill_graphs),
                        ("progress", progress)):
        if value is not None and not isinstance(value, bool):
            raise PlanError(f"{flag} must be True, False or None (the default), got {value!r}")
    pm, sel = select_plugins(get_plugin_manager(), plugins)
    source = resolve_source(model, tokenizer)
    policy = choose_policy(pm, source.config, sel.policy)
    spec = policy.describe(source.config)
    device = resolve_device(device)
    default_dtype = source.dtype if source.dtype in _DTYPES.values() else torch.float32
    dtype = resolve_dtype(dtype, default_dtype)
    backend = pm.cache_backends().get(sel.cache_backend or DEFAULT_CACHE_BACKEND)
    planner = pm.planners().get(sel.planner or DEFAULT_PLANNER)
    quantizers = [pm.quantizers().get(n) for n in sel.quantizers]
    opts = _split_options([backend, planner, *quantizers], plugin_options)
    kv_quant = _kv_quantizer(backend, quantizers)
    weight_quant = _weight_quantizer(quantizers)

    parallel = planner.plan(spec, world_size_for(planner, device), **opts[1])
    rank = rank_setup(planner, spec, parallel)  # what this process runs of the plan
    device, run_spec = rank_device(device, parallel), rank.spec
    max_seq_len, max_batch_size = resolve_sizes(spec, max_seq_len, max_batch_size)
    prefill_tokens = prefill_step_tokens(max_prefill_tokens, max_seq_len)
    from infergraft.kernels import get_ops  # here, not at import: it imports triton

    ops = get_ops(device, kernels)
    plan = Plan(
        model=source.name, architecture=spec.architecture, policy=policy.name,
        dtype=str(dtype).replace("torch.", ""), device=str(device), kernels=ops.backend,
        max_seq_len=max_seq_len, max_batch_size=max_batch_size, cache_backend=backend.name,
        kv_dtype=kv_quant.kv_dtype if kv_quant else str(dtype).replace("torch.", ""),
        quantizers=tuple(sel.quantizers),
        planner=planner.name, parallel=parallel,
        weight_bytes=weight_bytes(run_spec, dtype, weight_quant)  # this rank's
        - rank.unheld * element_bytes(dtype),
        kv_bytes_per_token=backend.bytes_per_token(run_spec, dtype, kv_quant) if kv_quant
        else backend.bytes_per_token(run_spec, dtype),
        options=tuple(sorted(plugin_options.items())), sliding_window=spec.sliding_window,
        max_prefill_tokens=prefill_tokens,
        activation_bytes=activation_bytes(run_spec, dtype, prefill_tokens, max_batch_size))
    plan = _with_activations(pm.prepare_plan(plan, spec), plan, run_spec, dtype)
    budget, budget_source = device_budget(device, device_memory)
    kv_device = getattr(backend, "device_bytes", lambda p, **o: p.kv_bytes_total)(plan, **opts[0])
    if device.type == "cpu":  # a cache's host pool (offload's slow blocks) is this memory too
        kv_device += getattr(backend, "host_bytes", lambda p, **o: 0)(plan, **opts[0])
    check_fits(plan, kv_device, budget, budget_source)  # before any weight is loaded

    net = DecoderModel(run_spec, ops, device, plan.max_seq_len, tp=rank.tp, stage=rank.stage)
    tensors = source.tensors()
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, desc="loading weights", unit="tensor", leave=False)
    pack = None if weight_quant is None else SlotPacker(weight_quant, ops, net, net.will_fuse(dtype))
    load_weights(net, spec, policy.weight_map(spec), tensors, policy_name=policy.name,
                 device=device, dtype=dtype, on_slot_ready=pack,  # packed as they stream in
                 place=rank.place)  # this rank's pieces
    if pack is not None:
        pack.finish()
    net.fold_norm_weights()  # where the fused decode layer runs (Triton ops, RMSNorm + SwiGLU)
    if kv_quant is not None:
        opts[0]["kv_quantizer"] = kv_quant
    cache = backend.create(run_spec, plan, device=device, dtype=dtype, ops=ops, **opts[0])
    engine = Engine(net.eval(), cache, source.tokenizer, plan, spec, plan.max_prefill_tokens)
    engine.ranks = rank.ranks
    engine.graph_runner = _graph_runner(net, cache, plan, device, cuda_graphs)
    engine.prefill_graphs = _prefill_graphs(net, cache, plan, engine.graph_runner,
                                            prefill_graphs)
    engine.build_seconds = time.perf_counter() - t0
    return engine


def _with_activations(plan, before, spec, dtype):
    """``plan`` (from the prepare_plan hooks) with its activation bytes recounted for its
    batch and prefill step, unless a hook set them itself (they differ from ``before``)."""
    prefill_tokens = prefill_step_tokens(plan.max_prefill_tokens, plan.max_seq_len)
    counted = plan.activation_bytes
    if counted == before.activation_bytes:  # a hook may have changed the batch or the step
        counted = activation_bytes(spec, dtype, prefill_tokens, plan.max_batch_size)
    return attrs.evolve(plan, max_prefill_tokens=prefill_tokens, activation_bytes=counted)


def _graph_runner(net, cache, plan, device, wanted):
    """Decode under CUDA graphs on the GPU (default) when the cache supports it."""
    from .cuda_graph import CudaGraphRunner

    if wanted is None:
        wanted = device.type == "cuda" and CudaGraphRunner.supported(cache) \
            and plan.parallel.world_size == 1
    if not wanted:
        return None
    if plan.parallel.world_size > 1:
        raise PlanError("cuda_graphs=True is not supported across processes yet (world size "
                        f"{plan.parallel.world_size}): decode runs eagerly")
    if device.type != "cuda" or not CudaGraphRunner.supported(cache):
        raise PlanError(f"cuda_graphs=True needs a CUDA device and a cache backend that "
                        f"supports them (contiguous, paged); got {device} / {plan.cache_backend}")
    runner = CudaGraphRunner(net, cache, plan.max_batch_size)
    runner.capture()
    return runner


def _prefill_graphs(net, cache, plan, decode_runner, wanted):
    """A fresh prompt's prefill under CUDA graphs (captured per length bucket on first use)."""
    from .prefill_graph import PrefillGraphRunner

    if wanted is None:
        wanted = decode_runner is not None and PrefillGraphRunner.supported(cache)
    if not wanted:
        return None
    if decode_runner is None or not PrefillGraphRunner.supported(cache):
        raise PlanError(f"prefill_graphs=True needs decode CUDA graphs and a cache that can "
                        f"capture a prefill (paged, or contiguous without a sliding window or "
                        f"int8 K/V); got {plan.cache_backend} with kv_dtype={plan.kv_dtype}")
    return PrefillGraphRunner(net, cache, plan.max_seq_len, share_pool_with=decode_runner)
