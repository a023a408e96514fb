"""The public hypothesis strategies produce what they promise, and drive real plugins."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infergraft import core
from infergraft.core.runner.model import slot_layout
from infergraft.core.testing import strategies
from infergraft.core.testing.cache_machine import cache_factory, tiny_cache_spec
from infergraft.core.testing.models import random_model
from infergraft.core.testing.policy_kit import check_weights_consumed

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(cfg=strategies.model_configs())
def test_drawn_llama_configs_are_served_by_the_llama_policy(cfg):
    policy = core.get_plugin_manager().policies().get("llama")
    spec = policy.describe(cfg)
    assert spec.num_heads % spec.num_kv_heads == 0 and spec.head_dim % 2 == 0
    hf = random_model(cfg)
    check_weights_consumed(policy, spec, {k: tuple(v.shape) for k, v in hf.state_dict().items()})
    assert spec.param_count == sum(p.numel() for p in hf.parameters())


@FAST
@given(spec=strategies.model_specs())
def test_drawn_specs_count_what_their_slots_hold(spec):
    assert sum(torch.Size(shape).numel() for shape, _ in slot_layout(spec).values()) == \
        spec.param_count


@FAST
@given(data=st.data())
def test_prompts_avoid_special_ids_and_respect_lengths(data):
    vocab = data.draw(st.integers(8, 500))
    batch = data.draw(strategies.prompt_batches(vocab, max_batch=3, min_len=2, max_len=9))
    assert 1 <= len(batch) <= 3
    for p in batch:
        assert 2 <= len(p) <= 9 and all(0 <= t < vocab and t not in (0, 1, 2) for t in p)


@FAST
@given(w=strategies.weight_tensors(max_out=7, max_in=5, dtypes=(torch.float32, torch.float16)))
def test_weight_tensors_are_finite_2d_and_bounded(w):
    assert w.dim() == 2 and 1 <= w.shape[0] <= 7 and 1 <= w.shape[1] <= 5
    assert w.dtype in (torch.float32, torch.float16) and torch.isfinite(w).all()


@FAST
@given(ops=strategies.block_operations(max_seqs=3, max_tokens=20))
def test_block_operations_are_legal_for_a_cache_of_that_size(ops):
    cache = cache_factory("contiguous", tiny_cache_spec(), max_seq_len=20, max_batch_size=3)()
    lengths = {}
    for op in ops:
        kind, seq = op[0], op[1]
        if kind == "allocate":
            cache.allocate(seq, op[2])
            cache.prepare([seq], [op[2]])
            lengths[seq] = op[2]
        elif kind == "append":
            cache.prepare([seq], [op[2]])
            lengths[seq] += op[2]
        elif kind == "fork":
            cache.fork(seq, op[2])
            lengths[op[2]] = lengths[seq]
        elif kind == "read":
            layer = int(op[2] * cache.spec.num_layers)
            assert cache.read(seq, layer)[0].shape[0] == lengths[seq]
        else:
            cache.free(seq)
            del lengths[seq]
        assert {s: cache.length(s) for s in lengths} == lengths
        assert cache.stats()["sequences"] == len(lengths)
