"""Parity checks against HF transformers' own forward and generate (same weights).

Used by our policy tests and by the conformance kit that third-party policies run.
"""
from __future__ import annotations

import torch


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (a scale-free error for logits)."""
    ref = ref.float()
    return float((ours.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@torch.inference_mode()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    dev = next(hf_model.parameters()).device
    return hf_model(torch.tensor([ids], device=dev)).logits[0].float().cpu()


def int8_kv_cache(config):
    """An HF ``DynamicCache`` that stores K/V as our ``kv-int8`` does: each (token, head) row
    through int8 with its absmax scale (``kv_write.quantize_int8_torch``), back in the
    model's dtype: HF's reference for a build with int8 K/V."""
    from transformers.cache_utils import DynamicCache

    from infergraft.kernels.kv_write import quantize_int8_torch

    def through_int8(x):  # x: [B, H, T, D]
        q, scale = quantize_int8_torch(x)
        return (q.float() * scale[..., None]).to(x.dtype)

    cache = DynamicCache(config=config)
    for layer in cache.layers:
        def update(k, v, *args, _update=layer.update, **kwargs):
            return _update(through_int8(k), through_int8(v), *args, **kwargs)
        layer.update = update
    return cache


@torch.inference_mode()
def hf_greedy(hf_model, ids: list[int], max_new_tokens: int, kv_int8: bool = False) -> list[int]:
    """HF greedy continuation, cut after the first EOS exactly like the engine stops;
    ``kv_int8``: with K/V stored as int8 rows (``int8_kv_cache``)."""
    dev = next(hf_model.parameters()).device
    cache = {"past_key_values": int8_kv_cache(hf_model.config)} if kv_int8 else {}
    out = hf_model.generate(torch.tensor([ids], device=dev), max_new_tokens=max_new_tokens,
                            min_new_tokens=0, do_sample=False,
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                            pad_token_id=hf_model.config.eos_token_id or 0, **cache)
    return _through_eos(out[0, len(ids):].tolist(), hf_model.config)


@torch.inference_mode()
def greedy_by_full_forwards(hf_model, ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation as one forward over the whole sequence at each step (no
    cache), cut after the first EOS: the semantics we follow where HF's generate changed
    across transformers versions. Phi-3 past LongRoPE's original length: 5.25's generate
    recomputes the whole sequence where it crosses (these tokens), 5.17's feeds the new
    token alone without its context from there on (docs/architecture.md, LongRoPE)."""
    seq, eos = list(ids), _eos_ids(hf_model.config)
    for _ in range(max_new_tokens):
        seq.append(int(hf_logits(hf_model, seq)[-1].argmax()))
        if seq[-1] in eos:
            break
    return seq[len(ids):]


def _eos_ids(config) -> set:
    eos = config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def _through_eos(new: list[int], config) -> list[int]:
    eos = _eos_ids(config)
    for n, t in enumerate(new):
        if t in eos:
            return new[:n + 1]
    return new


def assert_logits_match(engine, hf_model, ids: list[int], rtol: float = 1e-4) -> float:
    err = relative_error(engine.logits(ids), hf_logits(hf_model, ids))
    assert err <= rtol, f"logits differ from HF: relative error {err:.2e} > {rtol:.0e}"
    return err


def assert_greedy_match(engine, hf_model, ids: list[int], max_new_tokens: int = 32,
                        reference=hf_greedy) -> list[int]:
    """Our greedy tokens are ``reference``'s (HF's generate, or ``greedy_by_full_forwards``)."""
    ours = engine.generate([ids], max_new_tokens=max_new_tokens)[0].token_ids
    ref = reference(hf_model, ids, max_new_tokens)
    assert ours == ref, f"greedy tokens differ from HF:\n ours {ours}\n HF   {ref}"
    return ours


def assert_batch_matches_alone(engine, prompts: list[list[int]], max_new_tokens: int = 16):
    """A batch of prompts gives each prompt exactly what it gives alone."""
    together = [c.token_ids for c in engine.generate(prompts, max_new_tokens=max_new_tokens)]
    alone = [engine.generate([p], max_new_tokens=max_new_tokens)[0].token_ids for p in prompts]
    assert together == alone, f"batched output differs from solo output:\n {together}\n {alone}"
    return together
