"""The kits themselves: real test plugins pass them, deliberately wrong ones are caught.

The int8 quantiser and the tensor x pipeline planner here are test plugins, written
apart from the built-ins (the `int8` weight quantiser passes the kit in
tests/test_weight_int8.py, the `tp` planner in tests/test_conformance_builtin.py), so
that the kits are proven on something that really splits and packs.
"""
import attrs
import pytest
import torch

from infergraft.core.errors import PlanError
from infergraft.core.runner.model import slot_layout
from infergraft.core.plan import ParallelPlan, Planner
from infergraft.core.quant import Quantizer
from infergraft.core.testing import planner_kit, quant_kit
from infergraft.core.testing.planner_kit import PlannerTests
from infergraft.core.testing.quant_kit import QuantizerTests


@attrs.frozen
class Int8Packed:
    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] float32
    dtype: torch.dtype


class Int8PerChannel(Quantizer):
    """Symmetric per-output-channel int8: error <= max|row| / 254 <= max|w| / 254."""

    name = "test-int8"
    applies_to = "weights"
    max_relative_error = 1.001 / 254  # float rounding of the scale

    def _scale(self, w):
        scale = w.float().abs().amax(dim=1) / 127
        return torch.where(scale > 0, scale, torch.ones_like(scale))  # zero rows stay zero

    def pack(self, w):
        scale = self._scale(w)
        q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return Int8Packed(q, scale, w.dtype)

    def unpack(self, p):
        return (p.q.float() * p.scale[:, None]).to(p.dtype)

    def matmul(self, x, p):  # x: [..., in] -> [..., out]; scale applied per output column
        return ((x.float() @ p.q.float().t()) * p.scale).to(x.dtype)

    def packed_bytes(self, p):
        return p.q.numel() + 4 * p.scale.numel()


class TestInt8Quantizer(QuantizerTests):
    @pytest.fixture
    def quantizer(self):
        return Int8PerChannel()


class TensorPipelinePlanner(Planner):
    """Megatron-style tensor parallel inside each of world/tp pipeline stages."""

    name = "test-tp-pp"
    options = {"tensor_parallel": None}

    def plan(self, spec, world_size=1, tensor_parallel=None):
        tp = tensor_parallel or world_size
        for what, n in (("world_size", world_size), ("num_heads", spec.num_heads),
                        ("num_kv_heads", spec.num_kv_heads),
                        ("intermediate_size", spec.intermediate_size),
                        ("vocab_size", spec.vocab_size)):
            if n % tp:
                raise PlanError(f"planner {self.name!r}: tensor_parallel={tp} does not divide "
                                f"{what}={n}")
        pp = world_size // tp
        if pp > spec.num_layers:
            raise PlanError(f"planner {self.name!r}: {pp} pipeline stages for "
                            f"{spec.num_layers} layers")
        base, extra = divmod(spec.num_layers, pp)
        bounds = [0]
        for s in range(pp):
            bounds.append(bounds[-1] + base + (s < extra))
        return ParallelPlan(world_size, tp, tuple(zip(bounds, bounds[1:])))

    def shard_style(self, spec, slot):
        if slot.endswith(("qkv.weight", "qkv.bias", "gate_up.weight", "gate_up.bias",
                          "fc_in.weight", "fc_in.bias")) or slot in ("embed.weight", "lm_head.weight"):
            return "column"
        if slot.endswith(("o.weight", "down.weight")):
            return "row"
        return "replicated"

    def shard(self, spec, pplan, slot, tensor, rank):
        tp, style = pplan.tensor_parallel, self.shard_style(spec, slot)
        if style == "replicated":
            return tensor
        if style == "row":
            return tensor.chunk(tp, dim=-1)[rank]
        parts = slot_layout(spec)[slot][1] or (tensor.shape[0],)
        return torch.cat([p.chunk(tp)[rank] for p in torch.split(tensor, list(parts))])


class TestTensorParallelPlanner(PlannerTests):
    world_sizes = (1, 2, 4)
    bad_world_sizes = (3, 8)  # 8 heads / 3; 4 kv heads / 8

    @pytest.fixture
    def planner(self):
        return TensorPipelinePlanner()


class TestTensorPipelinePlanner(TestTensorParallelPlanner):
    plan_options = {"tensor_parallel": 2}
    world_sizes = (2, 4, 6, 8)  # 1, 2, 3 and 4 stages over 4 layers
    bad_world_sizes = (3, 10)  # not a multiple of tp; 5 stages for 4 layers


# -- the kits catch what they are meant to catch ------------------------------------
SPEC = planner_kit.default_spec()


class NaiveQKVPlanner(TensorPipelinePlanner):
    name = "naive-qkv"

    def shard(self, spec, pplan, slot, tensor, rank):  # cuts the fused qkv straight through
        if self.shard_style(spec, slot) == "column":
            return tensor.chunk(pplan.tensor_parallel)[rank]
        return super().shard(spec, pplan, slot, tensor, rank)


def test_planner_kit_catches_a_qkv_split_across_parts():
    p = NaiveQKVPlanner()
    with pytest.raises(AssertionError, match="naive-qkv.*qkv.weight.*reassemble"):
        planner_kit.check_shards(p, SPEC, p.plan(SPEC, 2))


def test_planner_kit_catches_overlapping_stages():
    p = TensorPipelinePlanner()
    bad = ParallelPlan(2, 1, ((0, 2), (1, 4)))
    with pytest.raises(AssertionError, match="do not cover layers"):
        planner_kit.check_stages(p, SPEC, bad, 2)
    planner_kit.check_stages(p, SPEC, p.plan(SPEC, 2, tensor_parallel=1), 2)


def test_planner_kit_catches_vague_errors_and_tp_without_shard():
    class Vague(Planner):
        name = "vague"

        def plan(self, spec, world_size=1):
            if world_size > 1:
                raise PlanError("does not divide")
            return ParallelPlan(1, 1, ((0, spec.num_layers),))

    with pytest.raises(AssertionError, match="does not name planner 'vague'"):
        planner_kit.check_refusal(Vague(), SPEC, 2)
    with pytest.raises(AssertionError, match="lacks shard"):
        planner_kit.check_shards(Vague(), SPEC, ParallelPlan(2, 2, ((0, 4),)))


class _Broken(Int8PerChannel):
    name = "broken"


def test_quant_kit_catches_a_zero_scale():
    class NoGuard(_Broken):  # keeps w / max|row| in float16: 0 / 0 on a zero row
        def pack(self, w):
            amax = w.abs().amax(dim=1)
            return Int8Packed((w / amax[:, None]).half(), amax, w.dtype)

        def unpack(self, p):
            return (p.q.float() * p.scale[:, None]).to(p.dtype)

    w = torch.randn(4, 8)
    w[1] = 0
    with pytest.raises(AssertionError, match="inf/NaN"):
        quant_kit.check_round_trip(NoGuard(), w)


def test_quant_kit_catches_an_error_above_the_declared_bound():
    class Truncating(_Broken):  # floor instead of round: error up to a whole step
        def pack(self, w):
            scale = self._scale(w)
            return Int8Packed(torch.floor(w / scale[:, None]).clamp(-127, 127).to(torch.int8),
                              scale, w.dtype)

    with pytest.raises(AssertionError, match="exceeds declared max_relative_error"):
        quant_kit.check_round_trip(Truncating(), torch.randn(16, 64))


def test_quant_kit_catches_lying_packed_bytes_and_a_wrong_matmul():
    class Lying(_Broken):
        def packed_bytes(self, p):
            return p.q.numel() // 2  # claims int4

        def matmul(self, x, p):  # forgets the scales
            return x @ p.q.float().t()

    with pytest.raises(AssertionError, match="packed_bytes"):
        quant_kit.check_packed_bytes(Lying(), torch.randn(8, 16))
    with pytest.raises(AssertionError, match="dequantised"):
        quant_kit.check_matmul(Lying(), torch.randn(8, 16), torch.randn(3, 16), 1e-4)
    assert quant_kit.check_matmul(Int8PerChannel(), torch.randn(8, 16), torch.randn(3, 16), 1e-4) < 1e-5


def test_cache_kit_catches_a_backend_that_mixes_up_k_and_v():
    from infergraft.core.testing.cache_kit import CacheContractTests
    from infergraft.core.testing.cache_machine import cache_factory, tiny_cache_spec
    from infergraft.plugins.contiguous import ContiguousBackend

    class SwapsOnRead(ContiguousBackend):
        name = "swaps"

        def create(self, *args, **kwargs):
            cache = super().create(*args, **kwargs)
            read = cache.read
            cache.read = lambda seq, layer: read(seq, layer)[::-1]
            return cache

    kit, spec = CacheContractTests(), tiny_cache_spec()
    good = cache_factory(ContiguousBackend(), spec, max_seq_len=24)()
    kit.test_attention_matches_reference_in_prefill_and_decode(good, spec)
    bad = cache_factory(SwapsOnRead(), spec, max_seq_len=24)()
    with pytest.raises(AssertionError, match="Mismatched elements"):
        kit.test_attention_matches_reference_in_prefill_and_decode(bad, spec)


def test_policy_kit_catches_a_spec_that_misreads_the_config(tiny_llama):
    from infergraft.core.testing.policy_kit import PolicyParityTests, build_with_policy
    from infergraft.policies.llama import LlamaPolicy

    class WrongTheta(LlamaPolicy):  # an unregistered policy: the kit wraps it inline
        name = "wrong-theta"

        def describe(self, config):
            spec = super().describe(config)
            return attrs.evolve(spec, rope=attrs.evolve(spec.rope, theta=spec.rope.theta * 2))

    kit, policy = PolicyParityTests(), WrongTheta()
    engine = build_with_policy(policy, tiny_llama, **kit.build_kwargs)
    assert engine.plan.policy == "wrong-theta"
    with pytest.raises(AssertionError, match="logits differ from HF"):
        kit.test_logits_match_hf(engine, tiny_llama)
    kit.test_logits_match_hf(build_with_policy(LlamaPolicy(), tiny_llama), tiny_llama)
