"""Pick each op's implementation: Triton on CUDA, the torch reference elsewhere.

``backend="auto"`` falls back to the reference where Triton cannot run; an explicit
``backend="triton"`` that cannot run raises. Under ``TRITON_INTERPRET=1`` Triton runs
on the CPU (slowly), which is how the kernels are tested without a GPU.
"""
from __future__ import annotations

import functools
import importlib
import types

import torch

from infergraft.core.errors import KernelUnavailableError
from . import switches
from ._triton import HAVE_TRITON, interpreting

#: op name -> module in this package; each module defines ``<op>_torch`` and ``<op>_triton``.
OPS = {
    "rms_norm": "rms_norm",
    "add_rms_norm": "rms_norm",
    "rotary": "rotary",
    "rotary_kv_write": "rotary",
    "rotary_kv_write_quant": "rotary_quant",
    "silu_mul": "silu_mul",
    "gelu_mul": "gelu_mul",
    "kv_write": "kv_write",
    "linear": "linear",
    "linear_partials": "linear_partials",
    "lm_head": "lm_head",
    "normed_linear": "fused_linear",
    "normed_swiglu": "fused_linear",
    "normed_qkv_rope": "fused_linear",
    "linear_residual": "fused_linear",
    "layer_norm": "layer_norm",
    "add_layer_norm": "layer_norm",
    "gelu": "gelu",
    "kv_write_quant": "kv_write",
    "paged_attention": "paged_attention",
    "varlen_attention": "varlen_attention",
    "int8_linear": "int8_linear",
    "int4_linear": "int4_linear",
    "fp8_linear": "fp8_linear",
    "embed_sum_sq": "embedding",
    "logits_argmax": "greedy",
    "fused_moe": "fused_moe",
    "moe_decode": "moe_decode",
    "apply_token_bitmask": "token_bitmask",
}
BACKENDS = ("auto", "torch", "triton")
#: the Triton ops that take ``mma=`` (INFERGRAFT_QUANT_MMA's value: each applies its route
#: rule, ``int4_linear.int4_mma_chosen`` / ``fp8_mma.rows_mma_chosen``): the weight
#: quantisers' GEMMs and the fused decode GEMMs over 8-bit rows or int4; those with
#: ``counters=`` count split-K on them
MMA_OPS = {"int4_linear": True, "fp8_linear": True, "int8_linear": True,
           "normed_linear": True, "normed_swiglu": True, "normed_qkv_rope": True,
           "linear_residual": True}


def triton_usable(device: torch.device | str) -> bool:
    dev = torch.device(device)
    return HAVE_TRITON and (dev.type == "cuda" or (dev.type == "cpu" and interpreting()))


def resolve_backend(device, backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise KernelUnavailableError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_usable(device) else "torch"
    if backend == "triton" and not triton_usable(device):
        why = "Triton is not installed" if not HAVE_TRITON else \
            f"Triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {device}"
        raise KernelUnavailableError(f"kernel backend 'triton' cannot run: {why}")
    return backend


def get_op(name: str, backend: str):
    if name not in OPS:
        raise KernelUnavailableError(f"unknown op {name!r}; known ops: {sorted(OPS)}")
    module = importlib.import_module(f"{__package__}.{OPS[name]}")
    fn = getattr(module, f"{name}_{backend}", None)
    if fn is None:
        raise KernelUnavailableError(f"op {name!r} has no {backend} implementation")
    return fn


def get_ops(device, backend: str = "auto") -> types.SimpleNamespace:
    """A namespace of every op for ``device``, e.g. ``ops.rms_norm(x, w, eps)``.
    ``quant_mma``: how the quantised decode GEMMs pick the tensor-core MMA kernels
    (``INFERGRAFT_QUANT_MMA``, read here, at each build: one process can build all three):
    False never, True wherever they take the GEMM, "auto" by the measured rule; always
    False on the torch references."""
    chosen = resolve_backend(device, backend)
    ops = {n: get_op(n, chosen) for n in OPS}
    mma = switches.value("INFERGRAFT_QUANT_MMA") if chosen == "triton" else False
    if mma:  # True or "auto"
        from .paged_plan import CounterPool  # not at import: it imports triton

        # this engine's own counters (engines on other streams share none)
        pool = CounterPool()
        for name, counts in MMA_OPS.items():
            extra = {"counters": pool} if counts else {}
            # (named as the op it binds: callers and tests tell the ops apart by name)
            ops[name] = functools.update_wrapper(
                functools.partial(ops[name], mma=mma, **extra), ops[name])
    return types.SimpleNamespace(backend=chosen, fuse_max_rows=fuse_max_rows(chosen),
                                 quant_mma=mma, **ops)


def fuse_max_rows(backend: str) -> int:
    """Steps of at most this many tokens take the fused decode layer (norms, SwiGLU and
    residual adds inside the GEMMs: ``kernels/fused_linear.py``); ``build`` folds the norm
    weights into the GEMMs where this is > 0. 0 = never (the torch reference, and the
    Triton ops with ``INFERGRAFT_FUSE=0``): the plain layer, weights as loaded."""
    # INFERGRAFT_FUSE is read at each build, not at import, so one process can build both
    # layers and compare them (docs/kernels.md has what each costs)
    if backend != "triton" or not switches.value("INFERGRAFT_FUSE"):
        return 0
    from .fused_linear import FUSE_MAX_ROWS
    return FUSE_MAX_ROWS
