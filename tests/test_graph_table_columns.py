"""The graph steps' block tables (plugins/paged_graph.py): a step copies, and the kernels
read, only the table columns its longest sequence uses, whatever ``max_seq_len`` makes the
tables' width. Checked on the CPU through the graph runners' static buffers
(``use_graphs=False``): before every step the device buffer is poisoned with negative
block ids; what the step copies overwrites them, the columns it leaves must never be read
(a negative id would index another block: other tokens), and the slots copied must not
grow with ``max_seq_len``."""
import pytest
import torch

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.runner.step_graph import StepGraphRunner
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)

POISON = -3  # in every int64 slot: two int32 ids, -3 and -1, both never a real block


def poisoned_copies(cache, method: str, buffers: str) -> list[int]:
    """Wrap ``cache.<method>`` (prepare_step_into / prepare_decode_into): before each call
    every slot of its device buffer is POISON; after it, the slots it copied (not POISON)
    are appended to the returned list."""
    copied, real = [], getattr(cache, method)

    def wrapped(meta, *args):
        flat = next(f for _, f, _ in getattr(cache, buffers).values()
                    if f.untyped_storage().data_ptr() == meta.positions.untyped_storage().data_ptr())
        flat.fill_(POISON)
        real(meta, *args)
        copied.append(int((flat != POISON).sum()))

    setattr(cache, method, wrapped)
    return copied


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
def test_mixed_steps_copy_the_columns_they_use(family):
    cfg = tiny_llama_config() if family == "llama" else tiny_mistral_config(sliding_window=6)
    hf = random_model(cfg, seed=5, scale=5.0)
    # a long prompt that finishes first, then short ones: later steps use fewer columns
    # than earlier ones left behind
    prompts = [random_prompt(n, cfg.vocab_size, n) for n in (37, 5, 11, 3)]
    new = [2, 9, 7, 12]
    want = run(build(hf, 64, max_num_batched_tokens=64), prompts, new)
    copied = {}
    for max_seq_len in (64, 512):
        engine = build(hf, max_seq_len, max_num_batched_tokens=8)
        runner = StepGraphRunner(engine.model, engine.cache, 8, 3, buckets=(4, 8),
                                 use_graphs=False)
        runner.capture()
        engine.runner.step_graphs = runner
        copied[max_seq_len] = poisoned_copies(engine.cache, "prepare_step_into", "_step_buffers")
        assert run(engine, prompts, new) == want
        assert runner.replays == len(copied[max_seq_len]) > 5
    assert copied[64] == copied[512]
    # 512 tokens: 128 columns of 3 sequences; no step copied the tables whole
    assert max(copied[512]) < 64 * 3


def test_decode_steps_copy_the_columns_they_use():
    cfg = tiny_llama_config()
    hf = random_model(cfg, seed=6, scale=5.0)
    prompts = [random_prompt(n, cfg.vocab_size, n) for n in (30, 4, 9, 6)]
    new = [3, 14, 10, 12]
    want = run(build(hf, 64), prompts, new)
    copied = {}
    for max_seq_len in (64, 512):
        engine = build(hf, max_seq_len)
        runner = CudaGraphRunner(engine.model, engine.cache, 3, buckets=(2,), use_graphs=False)
        runner.capture()
        engine.decode_graphs = runner
        copied[max_seq_len] = poisoned_copies(engine.cache, "prepare_decode_into",
                                              "_graph_buffers")
        assert run(engine, prompts, new) == want
        assert runner.replays == len(copied[max_seq_len]) > 5
    assert copied[64] == copied[512]
    assert max(copied[512]) < 4 * 3 + 128 * 3 // 2  # the tables of 512 tokens, whole


def test_the_kernels_see_the_used_columns_in_place():
    """The step meta's tables are a [B, width] view, column by column (strides (1, B)),
    and hold each sequence's blocks in its used columns."""
    hf = random_model(tiny_llama_config(), seed=7, scale=5.0)
    cache = build(hf, 512).cache
    meta = cache.static_step_meta(8, 3)
    assert meta.block_tables.shape == (3, 128) and meta.block_tables.stride() == (1, 3)
    for s, n in (("a", 5), ("b", 2)):
        cache.allocate(s, n)
    cache.prepare_step_into(meta, ["a", "b"], [5, 2])
    assert meta.block_tables[0, :2].tolist() == cache._tables["a"]
    assert meta.block_tables[1, :1].tolist() == cache._tables["b"]
    assert meta.block_tables[2, :2].tolist() == [0, 0]  # a padding sequence: no blocks
    assert torch.equal(meta.context_lens, torch.tensor([5, 2, 0], dtype=torch.int32))
