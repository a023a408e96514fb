"""The graph steps' block tables (plugins/paged_graph.py): a step gathers only the table
entries its longest sequence uses, whatever ``max_seq_len`` makes the tables' width.
Checked on the CPU through the graph runners' static buffers (``use_graphs=False``): before
every step both staging buffers are poisoned with negative block ids; the entries the step
writes are counted, and the ones it leaves go to the device as they are, so they must never
be read (a negative id would index another block: other tokens)."""
import pytest
import torch

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.runner.step_graph import StepGraphRunner
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)
from infergraft.plugins.paged_graph import _decode_views, _step_views

POISON = -3  # in every int64 slot: two int32 ids, -3 and -1, both never a real block


def poisoned_staging(cache, method: str) -> list[int]:
    """Wrap ``cache.<method>`` (prepare_decode_into / prepare_step_into): before each call
    both staging buffers of its bucket are POISON; after it, the table entries it wrote
    are appended to the returned list."""
    written, real = [], getattr(cache, method)
    decode = method == "prepare_decode_into"

    def wrapped(meta, *args):
        if decode:
            batch = meta.positions.shape[0]
            staging, _, width = cache._graph_buffers[batch]
            tables = lambda host: _decode_views(host, batch, width)[1]  # noqa: E731
        else:
            shape = (meta.positions.shape[0], meta.context_lens.shape[0])
            staging, _, width = cache._step_buffers[shape]
            tables = lambda host: _step_views(host, *shape, width)[3]  # noqa: E731
        for host in staging._buffers:
            host.fill_(POISON)
        real(meta, *args)
        written.append(sum(int((tables(host) >= 0).sum()) for host in staging._buffers))

    setattr(cache, method, wrapped)
    return written


def run(engine, prompts, new_tokens):
    """Each prompt with its own number of new tokens, all at once; their output ids."""
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, new_tokens)]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


def build(hf, max_seq_len, **kw):
    return core.build(hf, plugins=["paged"], max_seq_len=max_seq_len, max_batch_size=3,
                      cuda_graphs=False, block_size=4, **kw)


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_mixed_steps_gather_the_entries_they_use(family):
    cfg = tiny_llama_config() if family == "llama" else tiny_mistral_config(sliding_window=6)
    hf = random_model(cfg, seed=5, scale=5.0)
    # a long prompt that finishes first, then short ones: later steps use fewer entries
    # than earlier ones left behind
    prompts = [random_prompt(n, cfg.vocab_size, n) for n in (37, 5, 11, 3)]
    new = [2, 9, 7, 12]
    want = run(build(hf, 64, max_num_batched_tokens=64), prompts, new)
    written = {}
    for max_seq_len in (64, 512):
        engine = build(hf, max_seq_len, max_num_batched_tokens=8)
        runner = StepGraphRunner(engine.model, engine.cache, 8, 3, buckets=(4, 8),
                                 use_graphs=False)
        runner.capture()
        engine.runner.step_graphs = runner
        written[max_seq_len] = poisoned_staging(engine.cache, "prepare_step_into")
        assert run(engine, prompts, new) == want
        assert runner.replays == len(written[max_seq_len]) > 5
    assert written[64] == written[512]
    assert max(written[512]) <= 3 * 64 // 4 < 3 * 512 // 4  # never a whole table


def test_decode_steps_gather_the_entries_they_use():
    cfg = tiny_llama_config()
    hf = random_model(cfg, seed=6, scale=5.0)
    prompts = [random_prompt(n, cfg.vocab_size, n) for n in (30, 4, 9, 6)]
    new = [3, 14, 10, 12]
    want = run(build(hf, 64), prompts, new)
    written = {}
    for max_seq_len in (64, 512):
        engine = build(hf, max_seq_len)
        # bucket 2 only: a lone sequence left runs with a padding row, which attends as
        # the last live one does (its entries are written too)
        runner = CudaGraphRunner(engine.model, engine.cache, 3, buckets=(2,), use_graphs=False)
        runner.capture()
        engine.decode_graphs = runner
        written[max_seq_len] = poisoned_staging(engine.cache, "prepare_decode_into")
        assert run(engine, prompts, new) == want
        assert runner.replays == len(written[max_seq_len]) > 5
    assert written[64] == written[512]
    assert max(written[512]) <= 2 * 64 // 4
