"""A verify step's host work stays small (docs/bench/speculative.md: on a small model
under CUDA graphs the host's time is most of a verify step). The n-gram drafter encodes
only the tokens a request got since its last proposal, and proposes what a whole lookup
would; a request's tokens reach it as a view of its own lists; a mixed step's graph inputs
built as Python lists fill the buffers the tensor-op path fills; a verify step of one
request issues a few dozen tensor ops outside the model, not one a row."""
from collections.abc import Sequence

import pytest
import torch

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.runner.step_graph import StepGraphRunner
from infergraft.core.speculative.config import draft_rows
from infergraft.core.speculative.ngram import NgramDrafter, lookup
from infergraft.core.speculative.proposer import DraftRequest, TokensSoFar
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)
from infergraft.plugins import paged_graph

NGRAM = {"method": "ngram", "k": 4}


class Counted(Sequence):
    """Token ids that count the ones read (an item, or each item of a slice or a pass)."""

    def __init__(self, ids: list):
        self.ids, self.read = ids, 0

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        got = self.ids[i]
        self.read += len(got) if isinstance(i, slice) else 1
        return got

    def __iter__(self):
        self.read += len(self.ids)
        return iter(self.ids)


def test_the_ngram_drafter_reads_only_the_tokens_since_its_last_proposal():
    tokens = random_prompt(7, 256, 3) * 40 + random_prompt(5, 256, 4)
    ids, drafter = Counted(tokens), NgramDrafter(1, 4)
    assert drafter.propose([DraftRequest("a", ids, 4)])[0].tokens == lookup(tokens, 4)
    for step in range(12):
        added = random_prompt(1 + step % 3, 256, 50 + step)
        tokens += added  # (the request's own list grows between its steps)
        ids.read = 0
        got = drafter.propose([DraftRequest("a", ids, 4)])[0]
        assert got.tokens == lookup(list(tokens), 4)
        assert ids.read <= len(added) + 1, (step, ids.read)  # not the 285 before them
    other = random_prompt(9, 256, 7) * 3  # the same id with tokens that do not go on
    assert drafter.propose([DraftRequest("a", other, 3)])[0].tokens == lookup(other, 3)
    assert drafter.propose([DraftRequest("a", other[:10], 3)])[0].tokens == \
        lookup(other[:10], 3)


def test_tokens_so_far_read_the_prompt_then_the_output():
    prompt, output = [1, 2, 3], [4, 5]
    view, whole = TokensSoFar(prompt, output), prompt + output
    assert len(view) == 5 and list(view) == whole
    assert [view[i] for i in range(-5, 5)] == [whole[i] for i in range(-5, 5)]
    for s in (slice(3, None), slice(4, 5), slice(1, 4), slice(0, None, 2), slice(-2, None),
              slice(4, 2), slice(4, 1), slice(9, None)):
        assert view[s] == whole[s], s
    with pytest.raises(IndexError):
        view[5]
    output.append(6)  # a view: the request's lists as they are now
    assert view[-1] == 6 and len(view) == 6


@pytest.mark.parametrize("window", [None, 8])
def test_graph_inputs_as_lists_fill_what_the_tensor_ops_fill(window, monkeypatch):
    """The same steps (decode, verify and prompt-chunk shapes, across block boundaries;
    a sliding window's dropped blocks) through both ways of building a mixed step's row
    inputs: every buffer alike."""
    config = tiny_llama_config() if window is None else tiny_mistral_config(sliding_window=8)
    hf = random_model(config, seed=1)
    caches = [core.build(hf, plugins=["paged"], block_size=4, max_seq_len=64,
                         max_batch_size=3, num_blocks=64).cache for _ in range(2)]
    metas = [c.static_step_meta(16, 3) for c in caches]
    for c in caches:
        for seq, held in ((0, 3), (1, 9), (2, 14)):
            c.allocate(seq, 40)
            c.prepare([seq], [held])
    for counts in ([1, 1, 1], [1, 5, 3], [12, 1, 2], [5, 5, 5], [1, 4, 1]):
        for cache, meta, rows in zip(caches, metas, (10 ** 6, 0)):
            monkeypatch.setattr(paged_graph, "LIST_ROWS", rows)
            cache.prepare_step_into(meta, [0, 1, 2], counts)
        flats = [c._step_buffers[16, 3][1] for c in caches]
        assert torch.equal(flats[0], flats[1]), counts
        assert metas[0].slot_block[:sum(counts)].min() >= 0  # every fed row written


def test_a_verify_step_issues_a_few_dozen_tensor_ops():
    """One request's verify steps through the graph runners' static buffers (run eagerly on
    the CPU, as on a GPU without the replay): its tensor ops outside the model, counted
    (each one is host time a small model's verify step waits for)."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n, on = 0, True

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += self.on
            return func(*args, **(kwargs or {}))

    hf = random_model(tiny_llama_config(), seed=5, scale=5.0)
    engine = core.build(hf, plugins=["paged"], block_size=4, max_seq_len=128,
                        max_batch_size=2, speculative=NGRAM)
    net, count = engine.runner.model, Count()
    engine.decode_graphs = CudaGraphRunner(net, engine.cache, 2, use_graphs=False)
    engine.decode_graphs.capture()
    engine.runner.step_graphs = StepGraphRunner(
        net, engine.cache, 64, 2, use_graphs=False,
        extra_rows=draft_rows(engine.speculation.config, 2))
    engine.runner.step_graphs.capture()
    forward = net.forward

    def uncounted(*args, **kwargs):
        count.on = False
        try:
            return forward(*args, **kwargs)
        finally:
            count.on = True
    net.forward = uncounted
    seq = engine.add_request(random_prompt(6, 256, 10) * 8,
                             SamplingParams(max_new_tokens=40, ignore_eos=True))
    ops = []
    while engine.has_unfinished():
        drafts, count.n = seq.metrics.num_drafts, 0
        with count:
            engine.step()
        if seq.metrics.num_drafts > drafts:
            ops.append(count.n)
    assert len(ops) >= 3, ops  # the prompt's phrase repeats: drafts are proposed
    assert max(ops) <= 36, ops  # (it was 72 to 78 with a tensor op a row)
