"""Speculative decoding on CUDA: verify steps replay the mixed-step graphs (their logits
rows captured for drafts), plain steps the decode graphs and the look-ahead, and every
greedy request keeps the tokens of an engine without speculation; the draft proposer's
own engine runs its graphs too. Skipped without CUDA (CI); run on the GPU machine."""
import pytest
import torch
from speculative_support import assert_a_nan_fails_its_drafted_request_alone, lone_requests

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                        num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)
KW = dict(plugins=["paged"], device="cuda", dtype=torch.float32, max_seq_len=256,
          max_batch_size=8)
PROMPTS = [random_prompt(n, 1024, n) * 3 for n in (5, 11, 17)] + [random_prompt(40, 1024, 2)]


@pytest.fixture(scope="module")
def hf():
    return random_model(CFG, seed=5, scale=5.0).cuda()


@pytest.mark.parametrize("speculative", [{"method": "ngram", "k": 4},
                                         {"method": "draft", "model": "self", "k": 3}])
def test_greedy_tokens_through_the_graphs(hf, speculative):
    if speculative.get("model") == "self":
        speculative = dict(speculative, model=hf)
    plain = core.build(hf, **KW)
    want = [c.token_ids for c in plain.generate(PROMPTS, max_new_tokens=48, ignore_eos=True)]
    engine = core.build(hf, **KW, speculative=speculative)
    steps = engine.runner.step_graphs
    assert steps is not None and steps.extra_rows == speculative["k"] * 8
    before = steps.replays
    done = engine.generate(PROMPTS, max_new_tokens=48, ignore_eos=True)
    assert [c.token_ids for c in done] == want
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0, stats  # verify steps ran
    if "model" in speculative:  # the target as its own draft: its tokens hold (but ties)
        assert stats["spec_decode_draft_acceptance_rate"] > 0.9, stats
    assert steps.replays > before
    engine.cache.check_invariants()


def test_opted_out_requests_keep_the_look_ahead(hf):
    engine = core.build(hf, **KW, speculative={"method": "ngram", "k": 4})
    want = core.build(hf, **KW).generate(PROMPTS[:2], max_new_tokens=32)
    launched = []
    run = engine.lookahead.run
    engine.lookahead.run = lambda seqs, tokens: (launched.append(len(seqs)), run(seqs, tokens))[1]
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=32, speculative=False))
            for p in PROMPTS[:2]]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == [c.token_ids for c in want]
    assert launched and engine.stats()["spec_decode_num_drafts"] == 0
    # the look-ahead's steps are points of the cost fit (what a plain token costs there)
    assert engine.speculation.cost.seen[False] >= len(launched), engine.speculation.cost.seen


def _paused_runs(hf, graphs: bool, async_steps: bool) -> list:
    engine = core.build(hf, **KW, cuda_graphs=graphs, async_steps=async_steps,
                        speculative={"method": "ngram", "k": 4})
    engine.speculation.cost.share = lambda *args, **kw: 0.0  # (it reads the clock)
    return [(seq.output_ids, seq.metrics.num_drafts, seq.metrics.num_accepted_tokens)
            for seq in lone_requests(engine, 1024)]


def test_a_pause_ends_under_the_look_ahead(hf):
    """Lone greedy requests whose drafts are refused pause, then propose again: under the
    decode graphs' look-ahead (its steps count toward the pause) as without the graphs,
    draft for draft; with asynchronous steps (the default on one CUDA device, whose steps
    are scheduled one ahead, so a pause may end a step apart) the same tokens, and the
    pauses end there too."""
    eager, graphs = _paused_runs(hf, False, False), _paused_runs(hf, True, False)
    assert eager == graphs
    assert sum(drafts for _, drafts, _ in graphs) > 12, graphs
    pipelined = _paused_runs(hf, True, True)
    assert [ids for ids, _, _ in pipelined] == [ids for ids, _, _ in graphs]
    assert sum(drafts for _, drafts, _ in pipelined) > 12, pipelined


def test_nan_logits_fail_their_drafted_request_alone(hf):
    """A NaN in one drafted request's rows of a replayed verify step (NaN's max is NaN on
    CUDA too): it finishes with an error, the other drafted request keeps its tokens."""
    want = [c.token_ids for c in core.build(hf, **KW).generate(
        PROMPTS[:2], max_new_tokens=48, ignore_eos=True)]
    # (synchronous verify steps: the path that splits a replayed step's logits; verify
    # steps launched ahead read NaN flags instead, ahead.py's settle)
    engine = core.build(hf, **KW, async_steps=False, speculative={"method": "ngram", "k": 4})
    engine.speculation.cost.share = lambda *args, **kw: 0.0
    assert_a_nan_fails_its_drafted_request_alone(
        engine, PROMPTS[:2], SamplingParams(max_new_tokens=48, ignore_eos=True), want)
