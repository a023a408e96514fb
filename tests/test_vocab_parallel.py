"""Vocab-parallel embeddings and LM head under ``tp`` (core/distributed/vocab.py): the
padding and range arithmetic, the lookup and the gather on a stand-in group, and two gloo
ranks against HF's own forward and greedy generate with vocabs that tp does not divide
(GPT-2's 50257, tied; a LLaMA of 251, untied), each rank holding only its rows."""
import pytest
import torch
import torch.nn.functional as F

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.testing.distributed import run_ranks, tp_parity
from infergraft.core.testing.models import random_model, tiny_llama_config
from infergraft.core.distributed.vocab import (VocabParallel, padded_vocab, shard_rows,
                                               shard_vocab, vocab_range)

PROMPTS = [[1, 5, 9, 33, 7, 80, 50256], [1, 200, 3], [1, 17, 25128, 25129, 99]]


def _gpt2():
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=50257, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=1, eos_token_id=2)
    config.architectures = ["GPT2LMHeadModel"]
    return config


def _cases():
    llama = tiny_llama_config(vocab_size=251)  # 126 rows a rank, the last one padding
    short = [[1, 250, 125, 126, 3, 9], [1, 7, 200]]  # ids on both sides of the cut
    return {"gpt2-50257": dict(config=_gpt2(), plugins=["tp"], prompts=PROMPTS),
            "llama-251-contiguous": dict(config=llama, plugins=["tp"], prompts=short),
            "llama-251-paged": dict(config=llama, plugins=["tp", "paged"], prompts=short)}


def test_padding_and_ranges():
    assert (padded_vocab(50257, 2), shard_rows(50257, 2)) == (50258, 25129)
    assert [vocab_range(50257, 2, r) for r in (0, 1)] == [(0, 25129), (25129, 50257)]
    assert (padded_vocab(256, 2), padded_vocab(251, 1), shard_rows(251, 4)) == (256, 251, 63)
    # 5 ids at tp 4: 2 rows a rank; rank 2 holds one id and a zero row, rank 3 padding only
    assert [vocab_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    for vocab, tp in ((5, 4), (251, 2), (256, 2), (7, 3), (50257, 4)):
        w = torch.randn(vocab, 3)
        pieces = [shard_vocab(w, tp, r) for r in range(tp)]
        assert {tuple(p.shape) for p in pieces} == {(shard_rows(vocab, tp), 3)}
        whole = torch.cat(pieces)
        assert torch.equal(whole[:vocab], w) and not whole[vocab:].any()
        assert all(p.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
                   for p in pieces)  # copies: the whole matrix is freed after loading


class _Rank:
    """One rank of a group of ``size`` simulated in this process: the all-reduce left to
    the caller (it sums the ranks' partial lookups), the gather answered by ``parts``, the
    broadcast from rank 0 a no-op."""

    def __init__(self, size, rank, parts=None):
        self.size, self.rank, self.parts = size, rank, parts

    def all_reduce(self, x):
        return x

    def gather_to_first(self, x):
        return self.parts if self.rank == 0 else None

    def broadcast_from_first(self, x):  # the group's rank 0's argmax: here, its own
        return x


def test_lookup_and_gather_on_a_stand_in_group():
    vocab, tp, h = 11, 4, 5  # 3 rows a rank, the last rank 2 ids + 1 zero row
    w, x = torch.randn(vocab, h), torch.randn(3, h)
    tokens = torch.tensor([0, 2, 3, 8, 9, 10, 5])
    partial = [VocabParallel(vocab, _Rank(tp, r)).embed(tokens, shard_vocab(w, tp, r))
               for r in range(tp)]
    looked_up = torch.stack([(p != 0).any(-1) for p in partial])  # [tp, T]
    assert torch.equal(looked_up.sum(0), torch.ones(len(tokens), dtype=torch.long))
    assert torch.equal(sum(partial), F.embedding(tokens, w))  # what the all-reduce sums
    slices = [x @ shard_vocab(w, tp, r).t() for r in range(tp)]  # [3, 3] each
    assert not slices[-1][:, 2].any()  # the padding row's logits: 0, trimmed below
    greedy = torch.empty(3, dtype=torch.long)
    full = VocabParallel(vocab, _Rank(tp, 0, slices)).logits(slices[0], greedy)
    assert full.dtype == torch.float32 and full.shape == (3, vocab)
    assert torch.allclose(full, x @ w.t(), atol=1e-6)
    assert torch.equal(greedy, full.argmax(-1))
    assert VocabParallel(vocab, _Rank(tp, 1)).logits(slices[1]) is None  # not the sampler


def test_a_planner_that_replicates_the_embeddings_is_refused():
    from infergraft.core.distributed.ranks import check_styles
    from infergraft.plugins.tensor_parallel import TensorParallelPlanner

    class Replicated(TensorParallelPlanner):  # the runtime would look up rows it lacks
        name = "replicated-embed"

        def shard_style(self, spec, slot):
            return "replicated" if slot == "embed.weight" else super().shard_style(spec, slot)

    spec = core.get_plugin_manager().policies().get("llama").describe(tiny_llama_config())
    with pytest.raises(PlanError, match="'replicated-embed' shards 'embed.weight' replicated, "
                                        "but the tensor-parallel runtime runs it vocab"):
        check_styles(Replicated(), spec)


def vocab_cases(cases: list[dict]) -> list[dict]:
    """On one rank: ``tp_parity`` of each case, and what a second build of it holds: its
    embedding / head shapes, and the logits of one forward on this rank (only rank 0
    gets them whole; the others None)."""
    out = []
    for case in cases:
        result = tp_parity(**case)
        engine = core.build(random_model(case["config"]), plugins=case["plugins"],
                            dtype="float32", device="cpu", max_seq_len=32)
        model = engine.model
        result["shapes"] = {name: list(getattr(model, name).weight.shape)
                            for name in ("embed", "lm_head") if hasattr(model, name)}
        engine.cache.allocate("probe", 3)
        rows = engine.runner.every_row("probe", [1, 2, 3])  # [3, V] or None
        engine.cache.free("probe")
        result["rows"] = None if rows is None else list(rows.shape)
        out.append(result)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """Every case on the same two ranks: name -> [rank 0, rank 1] results."""
    cases = _cases()
    ranks = run_ranks(vocab_cases, 2, list(cases.values()), timeout=300)
    return {name: [r[i] for r in ranks] for i, name in enumerate(cases)}


@pytest.mark.parametrize("name", list(_cases()))
def test_two_ranks_match_hf(two_ranks, name):
    r0, r1 = two_ranks[name]
    assert r0["tensor_parallel"] == 2 and r0["errors"] == r1["errors"]
    assert max(r0["errors"]) < 1e-4, r0["errors"]
    assert r0["ours"] == r0["hf"] == r0["alone"]  # greedy tokens, whole continuations
    assert r0["ours"] == r1["ours"] and r0["sampled"] == r1["sampled"]  # ranks agree
    vocab = _cases()[name]["config"].vocab_size
    assert (r0["rows"], r1["rows"]) == ([3, vocab], None)  # the whole logits on rank 0 only


def _layer_elements(h, q, kv, i, gpt2):
    """One layer's elements on one of two ranks: projections halved, norms whole (GPT-2:
    its biases: column ones halved, o / down ones whole)."""
    if gpt2:  # LayerNorm w + b twice; qkv, fc_in (+ bias) halved; o, down halved + bias
        return 4 * h + (3 * h * h + 3 * h) // 2 + h * h // 2 + h + (4 * h * h + 4 * h) // 2 \
            + 4 * h * h // 2 + h
    return 2 * h + (q + 2 * kv) * h // 2 + q * h // 2 + 3 * h * i // 2


def test_each_rank_holds_its_rows(two_ranks):
    gpt2 = two_ranks["gpt2-50257"]
    for r in gpt2:  # tied: one [25129, 32] matrix is the embedding and the head
        assert r["shapes"] == {"embed": [25129, 32]}
        held = 2 * _layer_elements(32, 32, 32, 128, True) + 25129 * 32 + 64 * 32 + 2 * 32
        assert r["weight_bytes"] == held * 4
        assert r["weight_bytes"] < 0.51 * r["alone_weight_bytes"]
    for name in ("llama-251-contiguous", "llama-251-paged"):
        for r in two_ranks[name]:  # untied: both 126 of 251 rows (rank 1: 125 + a zero row)
            assert r["shapes"] == {"embed": [126, 64], "lm_head": [126, 64]}
            held = 2 * _layer_elements(64, 64, 32, 112, False) + 2 * 126 * 64 + 64
            assert r["weight_bytes"] == held * 4
