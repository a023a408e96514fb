"""Public hypothesis strategies for plugin tests: configs, specs, prompts, cache operations,
weight tensors.

Tensors are drawn as (shape, seed, scale) and generated with torch, not element by
element: hypothesis then shrinks towards small shapes and seed 0, and drawing stays fast.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from hypothesis import settings
from hypothesis import strategies as st

from ..spec import ModelSpec, RopeSpec

def kit_settings(**kw) -> settings:
    """Hypothesis settings for the conformance kits: the same examples on every run (a
    pass in one place is a pass in CI, a failure reproduces) unless the environment sets
    ``INFERGRAFT_HYPOTHESIS=explore``, which draws new ones each run."""
    explore = os.environ.get("INFERGRAFT_HYPOTHESIS", "repeatable") == "explore"
    return settings(derandomize=not explore, **kw)


#: token ids prompts avoid (pad, bos, eos of the tiny configs): an EOS inside a prompt is legal
#: but makes a 32-token parity run end after one token and test little.
SPECIAL_IDS = (0, 1, 2)


@st.composite
def llama_config_kwargs(draw, max_layers: int = 3, tie: Optional[bool] = None) -> dict:
    """kwargs for a tiny LLaMA-shaped HF config with a valid GQA layout.

    num_key_value_heads divides num_attention_heads; head_dim is even (RoPE rotates pairs).
    """
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 16, 24]))
    return dict(
        vocab_size=draw(st.integers(32, 300)),
        hidden_size=heads * head_dim,
        intermediate_size=draw(st.integers(4, 48)) * 4,
        num_hidden_layers=draw(st.integers(1, max_layers)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=draw(st.booleans()) if tie is None else tie,
    )


def model_configs(factory: Optional[Callable] = None, **kwargs) -> st.SearchStrategy:
    """HF configs from ``factory(**kw)`` (default: a tiny LLaMA config) over drawn kwargs.

    A family plugin passes its own factory, e.g. ``model_configs(tiny_qwen2_config)``.
    """
    if factory is None:
        from .models import tiny_llama_config as factory
    return llama_config_kwargs(**kwargs).map(lambda kw: factory(**kw))


@st.composite
def model_specs(draw, max_layers: int = 8) -> ModelSpec:
    """ModelSpecs (no HF involved), e.g. for planners: sizes chosen to divide in some ways
    and not in others, so that both the success and the divisibility paths are exercised."""
    kv_heads = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    hidden = heads * head_dim
    return ModelSpec(
        architecture="LlamaForCausalLM", num_layers=draw(st.integers(1, max_layers)),
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=draw(st.integers(1, 12)) * 8, vocab_size=draw(st.integers(8, 64)) * 4,
        max_position=256, rope=RopeSpec(), qkv_bias=draw(st.booleans()),
        o_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()))


def prompts(vocab_size: int, min_len: int = 1, max_len: int = 48,
            avoid: tuple[int, ...] = SPECIAL_IDS) -> st.SearchStrategy:
    """Token-id prompts over ``vocab_size`` that avoid the special ids."""
    ids = st.integers(0, vocab_size - 1).filter(lambda t: t not in avoid)
    return st.lists(ids, min_size=min_len, max_size=max_len)


def prompt_batches(vocab_size: int, max_batch: int = 4, **kw) -> st.SearchStrategy:
    """Batches of prompts of mixed lengths."""
    return st.lists(prompts(vocab_size, **kw), min_size=1, max_size=max_batch)


@st.composite
def block_operations(draw, max_seqs: int = 4, max_tokens: int = 40, max_ops: int = 30):
    """A valid sequence of KV-cache operations on sequence ids 0..max_seqs-1.

    Each item is one of ``("allocate", seq, n)``, ``("append", seq, n)``,
    ``("fork", parent, child)``, ``("read", seq, layer_fraction)``, ``("free", seq)``;
    ``layer_fraction`` in [0, 1) is scaled to the model's layer count by the consumer.
    Only live sequences are appended to, forked, read or freed, and lengths stay within
    ``max_tokens``, so every operation is legal for a cache of that capacity.
    """
    live: dict[int, int] = {}
    ops = []
    for _ in range(draw(st.integers(1, max_ops))):
        free_ids = [s for s in range(max_seqs) if s not in live]
        choices = (["allocate"] if free_ids else []) + \
            (["append", "read", "free"] + (["fork"] if free_ids else []) if live else [])
        op = draw(st.sampled_from(choices))
        if op == "allocate":
            seq = draw(st.sampled_from(free_ids))
            live[seq] = draw(st.integers(1, max_tokens))
            ops.append((op, seq, live[seq]))
            continue
        seq = draw(st.sampled_from(sorted(live)))
        if op == "append":
            if live[seq] >= max_tokens:
                continue
            n = draw(st.integers(1, max_tokens - live[seq]))
            live[seq] += n
            ops.append((op, seq, n))
        elif op == "fork":
            child = draw(st.sampled_from(free_ids))
            live[child] = live[seq]
            ops.append((op, seq, child))
        elif op == "read":
            ops.append((op, seq, draw(st.floats(0, 1, exclude_max=True))))
        else:
            del live[seq]
            ops.append((op, seq))
    return ops


@st.composite
def weight_tensors(draw, max_out: int = 64, max_in: int = 96,
                   dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> torch.Tensor:
    """2-D weights [out, in] with the shapes and values that break quantisers: odd sizes,
    tiny and huge scales, a zero row, single outliers."""
    out_f, in_f = draw(st.integers(1, max_out)), draw(st.integers(1, max_in))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([1e-3, 0.02, 1.0, 30.0]))
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * scale
    if draw(st.booleans()):  # a zero row: per-channel scales must not divide by zero
        w[draw(st.integers(0, out_f - 1))] = 0
    if draw(st.booleans()):  # one outlier
        w[draw(st.integers(0, out_f - 1)), draw(st.integers(0, in_f - 1))] = 20 * scale
    return w.to(dtype)
