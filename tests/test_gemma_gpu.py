"""Gemma 2 / 3 on the GPU: the Triton kernels (the softcap in the decode and mixed-step
attention, Gemma's RMSNorm, gelu_mul) under CUDA graphs (decode, mixed steps, the
contiguous cache's prefill), against HF in float32; in bfloat16 (and the torch reference
ops, eager), as close to HF's float32 logits as HF's own bfloat16 forward. Skipped cleanly without CUDA (CI); run on the GPU machine."""
import copy

import pytest
import torch

from infergraft import core
from infergraft.core.testing.models import (random_gemma, random_prompt, tiny_gemma2_config,
                                            tiny_gemma3_config)
from infergraft.core.testing.parity import hf_greedy, hf_logits, relative_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIGS = {"gemma2": tiny_gemma2_config, "gemma3": tiny_gemma3_config}


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_fp32_greedy_matches_hf_through_graphs(family, backend):
    hf = random_gemma(CONFIGS[family](), seed=1).cuda()
    engine = core.build(hf, plugins=[backend], device="cuda", dtype=torch.float32,
                        max_seq_len=128, max_batch_size=4)
    assert engine.decode_graphs is not None, "decode must run under CUDA graphs on the GPU"
    replays = engine.decode_graphs.replays
    prompts = [random_prompt(n, 256, n) for n in (5, 23, 45)]  # across the window of 8
    outs = engine.generate(prompts, max_new_tokens=40)
    assert engine.decode_graphs.replays > replays
    for p, c in zip(prompts, outs):
        assert c.token_ids == hf_greedy(hf, p, 40)
    prefill = engine.prefill_graphs if backend == "contiguous" else engine.runner.step_graphs
    assert prefill is not None, "a single prompt's prefill must run under CUDA graphs"
    before = prefill.replays
    p = random_prompt(30, 256, 30)
    assert engine.generate(p, max_new_tokens=8)[0].token_ids == hf_greedy(hf, p, 8)
    assert prefill.replays > before
    assert relative_error(engine.logits(prompts[2]), hf_logits(hf, prompts[2])) < 1e-4


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bf16_is_as_close_to_float32_as_hfs_own_bf16(family):
    """bfloat16 through the Triton kernels (the softcapped attention, Gemma's RMSNorm,
    gelu_mul; decode graphs on) and through the torch reference ops: each no further from
    HF's float32 logits than HF's own bfloat16 forward is, give or take half."""
    hf = random_gemma(CONFIGS[family](), seed=1, scale=3.0, norm_std=0.5)
    ids = random_prompt(40, 256, 4)
    truth = hf_logits(hf, ids)
    hf_bf16 = relative_error(hf_logits(copy.deepcopy(hf).to(torch.bfloat16).cuda(), ids), truth)
    assert hf_bf16 < 0.05, hf_bf16  # a model tame enough in bf16 for the bound to mean much
    kw = dict(plugins=["paged"], device="cuda", dtype=torch.bfloat16, max_seq_len=96,
              max_batch_size=2)
    for kernels in ("triton", "torch"):
        engine = core.build(hf, kernels=kernels, **kw)
        assert (engine.decode_graphs is not None) == (kernels == "triton")
        assert not engine.model.norms_folded  # Gemma's layers run the plain (unfused) path
        err = relative_error(engine.logits(ids).float().cpu(), truth)
        assert err < 1.5 * hf_bf16, (kernels, err, hf_bf16)
