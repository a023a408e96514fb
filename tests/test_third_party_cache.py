"""A third-party cache backend written against the contract as it stood before token-budget
steps (allocate / prepare / attention / read / free, no graphs, no fork): the engine's
mixed steps (prompt chunks beside decode tokens, several prompts a step) run through it
eagerly, since mixed-step graphs are opt-in (``supports_step_graphs``), and give HF's
greedy tokens; and it passes the cache kit."""
import attrs
import pytest
import torch
import torch.nn.functional as F

from infergraft import core
from infergraft.core.cache import CacheBackend, CacheFullError, KVCache
from infergraft.core.request import SamplingParams
from infergraft.core.testing.cache_kit import CacheBackendTests
from infergraft.core.testing.models import random_model, random_prompt, tiny_mistral_config
from infergraft.core.testing.parity import hf_greedy


@attrs.frozen
class ListMeta:
    positions: torch.Tensor  # [T]
    seq_ids: list
    starts: list
    counts: list


class ListCache(KVCache):
    """Each sequence's K and V per layer as one growing tensor; attention per sequence."""

    def __init__(self, spec, max_seq_len, dtype):
        self.spec, self.max_seq_len, self.dtype = spec, max_seq_len, dtype
        self.scale, self.window = spec.head_dim ** -0.5, spec.sliding_window
        self.kv: dict = {}  # seq id -> [(k [L, Hkv, D], v) per layer]
        self.len: dict = {}

    def can_allocate(self, num_tokens):
        return num_tokens <= self.max_seq_len

    def allocate(self, seq_id, num_tokens):
        if seq_id in self.kv:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not self.can_allocate(num_tokens):
            raise CacheFullError(f"{num_tokens} tokens exceed max_seq_len={self.max_seq_len}")
        s = self.spec
        empty = torch.zeros(0, s.num_kv_heads, s.head_dim, dtype=self.dtype)
        self.kv[seq_id], self.len[seq_id] = [(empty, empty)] * s.num_layers, 0

    def free(self, seq_id):
        del self.kv[seq_id], self.len[seq_id]

    def length(self, seq_id):
        return self.len[seq_id]

    def prepare(self, seq_ids, counts):
        if not self.can_append(seq_ids, counts):
            raise CacheFullError(f"step {list(zip(seq_ids, counts))} exceeds max_seq_len")
        starts = [self.len[s] for s in seq_ids]
        for s, n in zip(seq_ids, counts):
            self.len[s] += n
        positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, counts)])
        return ListMeta(positions, list(seq_ids), starts, list(counts))

    def attention(self, layer, q, k, v, meta, rope=None):
        out, row = torch.empty_like(q), 0
        for s, start, n in zip(meta.seq_ids, meta.starts, meta.counts):
            ks, vs = self.kv[s][layer]
            ks, vs = torch.cat([ks, k[row:row + n]]), torch.cat([vs, v[row:row + n]])
            self.kv[s][layer] = (ks, vs)
            qpos = torch.arange(start, start + n)[:, None]
            kpos = torch.arange(start + n)[None, :]
            mask = (kpos <= qpos) & ((kpos > qpos - self.window) if self.window else True)
            o = F.scaled_dot_product_attention(
                q[row:row + n].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                attn_mask=mask, scale=self.scale, enable_gqa=True)  # [Hq, n, D]
            out[row:row + n] = o.transpose(0, 1)
            row += n
        return out

    def read(self, seq_id, layer):
        return self.kv[seq_id][layer]

    def stats(self):
        held = sum(k.numel() + v.numel() for layers in self.kv.values() for k, v in layers)
        return {"bytes": held * self.dtype.itemsize, "sequences": len(self.kv),
                "tokens": sum(self.len.values())}


class ListBackend(CacheBackend):
    name = "list-cache"

    def create(self, spec, plan, *, device, dtype, ops, **options):
        return ListCache(spec, plan.max_seq_len, dtype)


class ListPlugin:
    @core.hookimpl
    def infergraft_register_cache_backends(self, register):
        register(ListBackend())


class TestListBackendPassesTheKit(CacheBackendTests):
    machine_examples = 60

    @pytest.fixture
    def backend(self):
        return ListBackend()


@pytest.mark.parametrize("budget", [3, 16])
def test_token_budget_steps_run_through_a_backend_without_step_graphs(budget):
    hf = random_model(tiny_mistral_config(sliding_window=6), seed=5, scale=5.0)
    engine = core.build(hf, plugins=[ListPlugin(), "list-cache"], max_seq_len=64,
                        max_batch_size=4, max_num_batched_tokens=budget)
    assert engine.plan.cache_backend == "list-cache" and engine.runner.step_graphs is None
    shapes, schedule = [], engine.scheduler.schedule

    def record():
        step = schedule()
        if step:
            shapes.append([(s.prefilling, n) for s, n in zip(step.seqs, step.counts)])
        return step
    engine.scheduler.schedule = record
    prompts = [random_prompt(n, 256, n) for n in (13, 2, 7, 21)]
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    for p, s in zip(prompts, seqs):
        assert s.output_ids == hf_greedy(hf, p, 8)
    # steps that carried prompt tokens beside decode tokens, and (a budget of 16) several
    # prompts fused in one step
    assert any(any(pre for pre, _ in st) and any(not pre for pre, _ in st) for st in shapes)
    if budget == 16:
        assert any(sum(pre for pre, _ in st) > 1 for st in shapes), shapes
