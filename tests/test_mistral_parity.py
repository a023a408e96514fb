"""Mistral policy against HF on random-initialised configs (float32, CPU), including
sliding-window attention over the contiguous cache's rolling buffer."""
import attrs
import pytest
import torch

from infergraft import core
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import random_model, random_prompt, tiny_mistral_config
from infergraft.core.testing.parity import (assert_batch_matches_alone, assert_greedy_match,
                                            assert_logits_match, hf_greedy, hf_logits,
                                            relative_error)
from infergraft.kernels._triton import HAVE_TRITON, interpreting
from infergraft.plugins.contiguous import ContiguousCache

W = 16
CONFIGS = {  # name -> (config overrides, seed that gives varied greedy output)
    "window16-gqa": (dict(sliding_window=W), 1),
    "window7-mqa-tied": (dict(sliding_window=7, num_attention_heads=6, num_key_value_heads=1,
                              hidden_size=48, head_dim=8, tie_word_embeddings=True), 2),
    "full-attention": (dict(sliding_window=None), 1),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    overrides, seed = CONFIGS[request.param]
    hf = random_model(tiny_mistral_config(**overrides), seed=seed, scale=5.0)
    return hf, core.build(hf, max_seq_len=96, max_batch_size=4)


@pytest.fixture(scope="module")
def windowed():
    hf = random_model(tiny_mistral_config(sliding_window=W), seed=1, scale=5.0)
    return hf, core.build(hf, max_seq_len=96, max_batch_size=4)


def test_logits_match_hf(pair):
    hf, engine = pair
    for n in (1, 7, 16, 17, 45):  # shorter than, equal to and past the window
        assert_logits_match(engine, hf, random_prompt(n, 256, n), rtol=1e-4)


def test_greedy_matches_hf_across_the_window(pair):
    hf, engine = pair
    short = assert_greedy_match(engine, hf, random_prompt(9, 256, 3), 32)
    long = assert_greedy_match(engine, hf, random_prompt(41, 256, 4), 40)  # ends at 81 > 5 W
    assert len(long) == 40 or long[-1] == 2  # ran to length, or stopped at EOS
    assert len(set(short + long)) >= 8, "degenerate output would make parity vacuous"


def test_batch_equals_each_alone(pair):
    hf, engine = pair
    prompts = [random_prompt(n, 256, 10 + n) for n in (3, 17, 44)]
    outs = assert_batch_matches_alone(engine, prompts, max_new_tokens=24)
    assert all(len(o) >= 1 for o in outs)


def test_rolling_cache_holds_at_most_window_slots(windowed):
    hf, engine = windowed
    cache = engine.cache
    spec = engine.spec
    # the storage itself stops at the window: [rows, Hkv, W, D] per layer, K and V
    assert cache.stats()["bytes"] == 2 * spec.num_layers * 4 * spec.num_kv_heads * W * \
        spec.head_dim * 4
    prompts = [random_prompt(44, 256, 5), random_prompt(5, 256, 6)]
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    bytes0, peak = cache.stats()["bytes"], 0
    while engine.has_unfinished():
        engine.step()
        st = cache.stats()
        assert st["max_slots_per_sequence"] <= W and st["slots"] <= W * st["sequences"]
        assert st["bytes"] == bytes0
        peak = max(peak, st["max_slots_per_sequence"])
        assert st["tokens"] >= st["slots"]  # positions seen keep growing past the slots held
    assert peak == W
    assert cache.stats()["sequences"] == 0
    for seq, p in zip(seqs, prompts):  # and the output is still HF's
        assert seq.output_ids == hf_greedy(hf, p, 40)


def test_chunked_prefill_across_the_wrap(windowed):
    """Continued prefill (start > 0) reads the ring plus the fresh keys."""
    hf, engine = windowed
    ids = random_prompt(60, 256, 7)
    ref = hf_logits(hf, ids)
    sid = "chunked"
    engine.cache.allocate(sid, len(ids))
    try:
        at = 0
        for n in (5, 14, 3, 1, 1, 20, 16):  # inside, across and longer than the window
            meta = engine.cache.prepare([sid], [n])
            with torch.inference_mode():
                out = engine.model(torch.tensor(ids[at:at + n], device=engine.device),
                                   engine.cache, meta)
            err = relative_error(out.cpu(), ref[at:at + n])
            assert err <= 1e-4, f"chunk {at}:{at + n} relative error {err:.2e}"
            at += n
        assert at == len(ids)
    finally:
        engine.cache.free(sid)


def test_long_prefill_writes_each_ring_column_once(windowed, monkeypatch):
    """Two prompts longer than the window: only each one's last W tokens are written, so
    no column gets two writes (their order would be undefined on the GPU)."""
    hf, engine = windowed
    ops, real, written = engine.cache.ops, engine.cache.ops.kv_write, []

    def spy(k, v, kc, vc, idx0, idx1):
        written.append(list(zip(idx0.tolist(), idx1.tolist())))
        return real(k, v, kc, vc, idx0, idx1)

    monkeypatch.setattr(ops, "kv_write", spy)
    prompts = [random_prompt(40, 256, 30), random_prompt(23, 256, 31)]
    outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=2)]
    monkeypatch.setattr(ops, "kv_write", real)
    prefill = written[0]  # layer 0 of the prefill step
    assert len(prefill) == 2 * W and len(set(prefill)) == 2 * W
    assert outs == [hf_greedy(hf, p, 2) for p in prompts]


def test_decode_with_a_hole_in_the_rows(windowed):
    """Rows 0 and 2 decoding while row 1 is gone (a gathered batch), then refilled."""
    hf, engine = windowed
    prompts = [random_prompt(n, 256, 20 + n) for n in (30, 8, 19, 25)]
    budgets = [36, 4, 36, 20]
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=b))
            for p, b in zip(prompts[:3], budgets[:3])]
    while not seqs[1].finished:
        engine.step()
    seqs.append(engine.add_request(prompts[3], SamplingParams(max_new_tokens=budgets[3])))
    while engine.has_unfinished():
        engine.step()
    for seq, p, b in zip(seqs, prompts, budgets):
        assert seq.output_ids == engine.generate([p], max_new_tokens=b)[0].token_ids


def test_read_returns_the_window_oldest_first(windowed):
    hf, engine = windowed
    spec, ids = engine.spec, random_prompt(37, 256, 8)
    # layer 0's keys do not depend on attention: a full-length cache gives the reference
    full = ContiguousCache(attrs.evolve(spec, sliding_window=None), 1, 64, engine.device,
                           torch.float32, engine.model.ops)
    full.allocate("r", len(ids))
    engine.cache.allocate("r", len(ids))
    try:
        for cache in (engine.cache, full):
            with torch.inference_mode():
                engine.model(torch.tensor(ids, device=engine.device), cache,
                             cache.prepare(["r"], [len(ids)]))
        k, v = engine.cache.read("r", 0)
        k_ref, v_ref = full.read("r", 0)
        assert k.shape == (W, spec.num_kv_heads, spec.head_dim)
        assert torch.equal(k, k_ref[-W:]) and torch.equal(v, v_ref[-W:])
        assert engine.cache.stats()["max_slots_per_sequence"] == W
    finally:
        engine.cache.free("r")


def test_memory_check_counts_the_ring_not_max_seq_len():
    # 1,024-token rows would be 32x the ring's W=32 columns: a budget that fits weights +
    # the ring + the activations must be accepted, one that does not must still be refused
    from infergraft.core.errors import PlanError

    hf = random_model(tiny_mistral_config(sliding_window=32), seed=0)
    kw = dict(max_seq_len=1024, max_batch_size=2, device="cpu")
    engine = core.build(hf, **kw)
    ring = engine.cache.stats()["bytes"]
    assert engine.plan.sliding_window == 32
    assert ring == engine.plan.kv_bytes_per_token * 32 * 2 < engine.plan.kv_bytes_total
    needed = engine.plan.weight_bytes + ring + engine.plan.activation_bytes
    core.build(hf, device_memory=needed, **kw)
    with pytest.raises(PlanError, match="holds"):
        core.build(hf, device_memory=needed - 1, **kw)


def test_spec_and_ring_width():
    policy = core.get_plugin_manager().policies().get("mistral")
    spec = policy.describe(tiny_mistral_config(sliding_window=W, num_key_value_heads=1))
    assert (spec.sliding_window, spec.num_kv_heads, spec.norm, spec.rope.type) == (W, 1, "rms", "default")
    assert policy.describe(tiny_mistral_config(sliding_window=None)).sliding_window is None
    with pytest.raises(UnsupportedModelError, match="sliding_window must be a positive integer"):
        policy.describe(tiny_mistral_config(sliding_window=0))
    # a window no shorter than max_seq_len never cuts: plain full-width rows
    hf = random_model(tiny_mistral_config(sliding_window=32), seed=0)
    assert core.build(hf, max_seq_len=32, max_batch_size=1).cache.stats()["slots_per_row"] == 32
    assert core.build(hf, max_seq_len=40, max_batch_size=1).cache.stats()["slots_per_row"] == 32


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
def test_triton_kernels_through_the_ring_match_hf(windowed):
    """kv_write (Triton, interpreted) addressing ring columns, in prefill and decode."""
    hf, _ = windowed
    engine = core.build(hf, max_seq_len=40, max_batch_size=2, kernels="triton")
    assert engine.plan.kernels == "triton" and engine.cache.stats()["slots_per_row"] == W
    assert_logits_match(engine, hf, random_prompt(21, 256, 40), rtol=1e-4)
    assert_greedy_match(engine, hf, random_prompt(19, 256, 41), 12)
