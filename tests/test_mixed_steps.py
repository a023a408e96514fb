"""Token-budget steps against HF transformers' own greedy ``generate`` on the same weights
(float32): prompts chunked and fused, decode tokens beside them, forks of ``n`` samples,
recompute preemption in a tight paged pool, GQA and a sliding window shorter than a
chunk, at budgets down to a few tokens a step. On the CPU the torch references run; on
CUDA the Triton kernels under the decode and mixed-step CUDA graphs."""
import pytest
import torch

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)
from infergraft.core.testing.parity import hf_greedy

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
MODELS = {  # name -> (config, plugins, options)
    "llama-gqa-paged": (tiny_llama_config, ["paged"], dict(block_size=4)),
    "llama-gqa-paged-tight": (tiny_llama_config, ["paged"], dict(block_size=4, num_blocks=16)),
    "mistral-window6-paged": (lambda: tiny_mistral_config(sliding_window=6), ["paged"],
                              dict(block_size=4)),
    "llama-kv-int8-paged": (tiny_llama_config, ["paged", "kv-int8"], dict(block_size=4)),
    "llama-gqa-contiguous": (tiny_llama_config, [], {}),
}
_HF: dict = {}
_WANT: dict = {}


def _model(name, device):
    key = (name, device)
    if key not in _HF:
        _HF[key] = random_model(MODELS[name][0](), seed=5, scale=5.0).to(device)
    return _HF[key]


def _want(name, device, prompt, new):
    """HF's greedy tokens (for int8 K/V: our unquantised engine's, whose own parity
    with HF is tested elsewhere: int8 K/V moves logits)."""
    key = (name, device, tuple(prompt), new)
    if key not in _WANT:
        hf = _model(name, device)
        _WANT[key] = hf_greedy(hf, prompt, new)
    return _WANT[key]


def _build(name, device, budget, batch=4):
    _, plugins, options = MODELS[name]
    return core.build(_model(name, device), plugins=plugins, device=device, dtype="float32",
                      max_seq_len=64, max_batch_size=batch, max_num_batched_tokens=budget,
                      **options)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for n in MODELS if "int8" not in n])
@pytest.mark.parametrize("budget", [3, 16, 256])
def test_arrivals_get_hf_greedy_tokens(device, name, budget):
    engine = _build(name, device, budget)
    arrivals = [(0, 30, 12), (0, 5, 20), (1, 17, 9), (2, 41, 6), (3, 3, 14), (5, 9, 10),
                (6, 22, 8)]  # (arrival step, prompt length, new tokens)
    pending, seqs, step = list(arrivals), [], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, n, new = pending.pop(0)
            seqs.append(engine.add_request(random_prompt(n, 256, 50 + n),
                                           SamplingParams(max_new_tokens=new)))
        engine.step()
        step += 1
    for s in seqs:
        assert s.output_ids == _want(name, device, s.prompt_ids, s.params.max_new_tokens), \
            (name, budget, len(s.prompt_ids))
    if name.endswith("tight"):  # the pool forced recomputes and pauses
        assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_paused > 0
    graphs = engine.runner.step_graphs
    if device == "cuda" and name.endswith("paged") and graphs is not None:
        assert graphs.replays > 0, "mixed steps must replay graphs on CUDA"
    engine.cache.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [4, 64])
def test_forked_samples_chunked_and_fused_get_hf_greedy_tokens(device, budget):
    name = "llama-gqa-paged"
    engine = _build(name, device, budget, batch=8)
    prompts = [random_prompt(n, 256, 70 + n) for n in (19, 4, 33)]
    outs = engine.generate(prompts, max_new_tokens=10, n=2)  # greedy: both samples alike
    for i, p in enumerate(prompts):
        want = _want(name, device, p, 10)
        assert [c.token_ids for c in outs[2 * i:2 * i + 2]] == [want, want]
    assert engine.cache.stats()["blocks_used"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_int8_kv_mixed_steps_match_whole_prompt_steps(device):
    name = "llama-kv-int8-paged"
    prompts = [random_prompt(n, 256, 90 + n) for n in (27, 6, 14)]
    small, whole = _build(name, device, 5), _build(name, device, 256)
    got = [c.token_ids for c in small.generate(prompts, max_new_tokens=12)]
    assert got == [c.token_ids for c in whole.generate(prompts, max_new_tokens=12)]
