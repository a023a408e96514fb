"""Mixed steps through the captured-graph path (core/runner/step_graph.py, the paged
cache's static step buffers).

Run eagerly on the CPU through the runner's static, padded buffers (``use_graphs=False``):
steps of decode tokens and prompt chunks padded to a token bucket must give the plain
engine's greedy tokens (and HF's logits for a prompt), write nothing for padding rows,
and leave steps over the largest bucket to the eager path. On CUDA the same steps replay
real graphs: tests/test_gpu.py.
"""
import pytest
import torch

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.request import SamplingParams
from infergraft.core.runner.step_graph import StepGraphRunner
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)

CFG = tiny_llama_config()
BUCKETS = (4, 8, 16)


@pytest.fixture(scope="module")
def hf():
    return random_model(CFG, seed=11, scale=5.0)


def plain(hf, plugins=("paged",), budget=16, batch=3, **kw):
    # no decode graphs (hence no decode look-ahead) on a GPU either: steps stay in lockstep
    return core.build(hf, plugins=list(plugins), max_seq_len=64, max_batch_size=batch,
                      max_num_batched_tokens=budget, cuda_graphs=False, block_size=4, **kw)


def with_step_graphs(hf, plugins=("paged",), budget=16, batch=3, **kw):
    engine = plain(hf, plugins, budget, batch, **kw)
    runner = StepGraphRunner(engine.model, engine.cache, budget, batch, buckets=BUCKETS,
                             use_graphs=False)
    runner.capture()
    engine.runner.step_graphs = runner
    return engine, runner


def run_arrivals(engine, arrivals):
    """(arrival step, prompt length, new tokens) requests; returns their output ids."""
    pending, seqs, step = sorted(arrivals), [], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, n, new = pending.pop(0)
            seqs.append(engine.add_request(random_prompt(n, CFG.vocab_size, 7 * n + new),
                                           SamplingParams(max_new_tokens=new, ignore_eos=True)))
        engine.step()
        step += 1
    engine.cache.check_invariants()
    return [s.output_ids for s in seqs]


def test_buckets_and_the_sequences_each_holds(hf):
    runner = with_step_graphs(hf, budget=12, batch=3)[1]
    assert runner.buckets == [4, 8, 12] and [runner.seqs_of(b) for b in runner.buckets] == [3, 3, 3]
    assert runner.bucket([1, 1, 1]) == 4 and runner.bucket([3, 2]) == 8
    assert runner.bucket([12]) == 12 and runner.bucket([13]) is None
    wide = StepGraphRunner(runner.model, runner.cache, 64, 8, buckets=BUCKETS, use_graphs=False)
    assert wide.buckets == [4, 8, 16, 64] and wide.seqs_of(4) == 4
    assert wide.bucket([1] * 5) == 8  # five sequences do not fit a bucket of four


@pytest.mark.parametrize("budget", [3, 7, 16])
def test_mixed_steps_through_the_buffers_give_the_eager_tokens(hf, budget):
    arrivals = [(0, 9, 6), (0, 3, 8), (2, 21, 5), (3, 5, 7), (5, 14, 4), (6, 2, 9)]
    engine, runner = with_step_graphs(hf, budget=budget)
    got = run_arrivals(engine, arrivals)
    assert runner.replays > 0
    assert got == run_arrivals(plain(hf, budget=64), arrivals)


def test_a_prompt_through_the_buffers_gives_hf_logits(hf):
    engine, runner = with_step_graphs(hf)
    prompt = random_prompt(11, CFG.vocab_size, 3)
    engine.add_request(prompt, SamplingParams(max_new_tokens=1))
    engine.step()
    assert runner.replays == 1
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1:].float()
    torch.testing.assert_close(runner.logits[16][:1].cpu(), want, rtol=1e-4, atol=1e-4)


def test_padding_rows_write_nothing(hf):
    # a decodes while b's 6-token prompt joins it: a step of 7 tokens in the 8 bucket
    engine, runner = with_step_graphs(hf)
    a = engine.add_request(random_prompt(9, CFG.vocab_size, 1), SamplingParams(max_new_tokens=9))
    engine.step()
    before = torch.stack([engine.cache.k[-1].clone(), engine.cache.v[-1].clone()])
    b = engine.add_request(random_prompt(6, CFG.vocab_size, 2), SamplingParams(max_new_tokens=9))
    engine.step()
    after = torch.stack([engine.cache.k[-1], engine.cache.v[-1]])
    changed = {int(i) for i in (after != before).flatten(2).any(-1).any(0).nonzero()}
    a_new = engine.cache._tables[a.id][9 // 4]  # the block a's 10th token went to
    assert changed <= set(engine.cache._tables[b.id]) | {a_new}, changed
    assert set(engine.cache._tables[b.id]) <= changed


@pytest.mark.parametrize("case", ["window", "kv-int8"])
def test_windows_and_int8_kv_through_the_buffers(case):
    cfg = tiny_mistral_config(sliding_window=5) if case == "window" else CFG
    hf = random_model(cfg, seed=3, scale=5.0)
    plugins = ("paged", "kv-int8") if case == "kv-int8" else ("paged",)
    arrivals = [(0, 13, 6), (1, 4, 9), (2, 18, 5), (4, 7, 6)]
    engine, runner = with_step_graphs(hf, plugins, budget=8)
    got = run_arrivals(engine, arrivals)
    assert runner.replays > 0 and got == run_arrivals(plain(hf, plugins, budget=64), arrivals)


def test_a_step_over_the_buffers_is_refused(hf):
    cache = plain(hf).cache
    meta = cache.static_step_meta(8, 2)
    for s in "abc":
        cache.allocate(s, 4)
    with pytest.raises(ValueError, match="3 sequences and 6 tokens does not fit graph "
                                         "buffers of 2 sequences and 8 tokens"):
        cache.prepare_step_into(meta, ["a", "b", "c"], [2, 2, 2])
    with pytest.raises(ValueError, match="9 tokens"):
        cache.prepare_step_into(meta, ["a", "b"], [4, 5])
    cache.prepare_step_into(meta, ["a", "b"], [4, 3])
    assert (cache.length("a"), cache.length("b")) == (4, 3)
    cu, lens = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist()
    assert cu == [0, 4, 7] and lens == [4, 3]
    assert meta.slot_block.tolist()[7:] == [-1] and meta.positions.tolist()[:7] == [0, 1, 2, 3, 0, 1, 2]


def test_which_caches_capture_mixed_steps_and_the_errors(hf):
    supported = StepGraphRunner.supported
    assert supported(plain(hf).cache) and supported(plain(hf, ("paged", "kv-int8")).cache)
    assert not supported(core.build(hf, max_seq_len=64).cache)  # contiguous: prefill graphs
    assert not supported(core.build(hf, plugins=["offload"], max_seq_len=64).cache)
    with pytest.raises(PlanError, match="step_graphs=True needs decode CUDA graphs"):
        core.build(hf, plugins=["paged"], max_seq_len=64, cuda_graphs=False, step_graphs=True)
    assert plain(hf).runner.step_graphs is None  # off without decode graphs (the CPU)


def test_the_torch_reference_ops_are_never_captured(hf):
    """The reference ops read values back on the host (a padding row's check), which a
    capture forbids: asked for, graphs over kernels='torch' are refused, naming the choices."""
    with pytest.raises(PlanError, match="cannot capture kernels='torch'.*kernels='triton'"):
        core.build(hf, plugins=["paged"], max_seq_len=64, kernels="torch", cuda_graphs=True)
