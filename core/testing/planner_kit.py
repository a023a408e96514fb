"""Conformance kit for parallel planners.

A planner's suite subclasses :class:`PlannerTests`, provides a ``planner`` fixture and
sets ``world_sizes`` (accepted for the ``spec`` fixture) and ``bad_world_sizes``
(refused with a PlanError); ``spec`` and ``plan_options`` may be overridden.

Sharding contract for planners whose plans have ``tensor_parallel > 1``::

    planner.shard_style(spec, slot) -> "column" | "row" | "vocab" | "replicated"
        column:     dim 0 split into tp equal pieces *inside each fused part* (q, k and v
                    each split by heads; gate and up each split), parts kept in order;
                    with fewer kv heads than ranks, k and v give each rank the one kv
                    head its query heads read (rank r: head r // (tp / kv_heads))
        row:        dim 1 split into tp equal pieces (o, down)
        vocab:      dim 0 padded with zero rows to a multiple of tp, then split into tp
                    equal pieces (the embeddings, the LM head)
        replicated: every rank holds the whole tensor (norms, biases after an all-reduce)
    planner.shard(spec, parallel, slot, tensor, rank) -> the piece ``rank`` holds

The kit reassembles the pieces by that meaning and compares with the full weight, so a
planner that cuts a fused qkv straight through (q rows landing on the k rank) fails.
"""
from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given

from ..errors import PlanError
from ..slots import slot_layout
from ..plan import ParallelPlan
from ..registry import _NAME
from ..spec import ModelSpec, RopeSpec
from . import strategies

STYLES = ("column", "row", "vocab", "replicated")


def check_stages(planner, spec, pplan, world_size: int) -> None:
    """The plan is a frozen ParallelPlan whose stages cover every layer exactly once."""
    who = f"planner {planner.name!r}"
    assert isinstance(pplan, ParallelPlan), f"{who} returned {type(pplan).__name__}"
    assert pplan.world_size == world_size, f"{who}: world_size {pplan.world_size} != {world_size}"
    assert pplan.tensor_parallel >= 1 and pplan.stages, f"{who}: empty plan {pplan}"
    assert pplan.tensor_parallel * len(pplan.stages) == world_size, \
        f"{who}: tp {pplan.tensor_parallel} x {len(pplan.stages)} stages != world {world_size}"
    covered = [i for a, b in pplan.stages for i in range(a, b)]
    assert all(a < b for a, b in pplan.stages), f"{who}: empty stage in {pplan.stages}"
    assert covered == list(range(spec.num_layers)), \
        f"{who}: stages {pplan.stages} do not cover layers 0..{spec.num_layers - 1} once, in order"


def reassemble(style: str, parts, pieces: list[torch.Tensor], copies: int = 1) -> torch.Tensor:
    """Inverse of the sharding contract above. ``copies`` > 1: a qkv slot whose k and v
    parts (all but the first) each rank holds one kv head of, shared by ``copies`` ranks."""
    if style == "replicated":
        return pieces[0]
    if style == "row":
        return torch.cat(pieces, dim=-1)
    if style == "vocab":  # the padded rows, in rank order (the caller trims the padding)
        return torch.cat(pieces)
    tp = len(pieces)
    reps = [1] + [copies] * (len(parts) - 1) if parts else [1]
    sizes = [p * c // tp for p, c in zip(parts, reps)] if parts else [pieces[0].shape[0]]
    splits = [torch.split(p, sizes) for p in pieces]  # per rank: its slice of each part
    return torch.cat([torch.cat([s[j] for s in splits[::reps[j]]]) for j in range(len(sizes))])


def check_shards(planner, spec, pplan, seed: int = 0) -> None:
    """Every slot's pieces reassemble to the full weight, without duplicated data."""
    who = f"planner {planner.name!r}"
    tp = pplan.tensor_parallel
    if tp == 1 and not hasattr(planner, "shard"):
        return  # nothing is split: every rank loads the whole weight
    assert hasattr(planner, "shard") and hasattr(planner, "shard_style"), \
        f"{who} plans tensor_parallel={tp} but lacks shard()/shard_style()"
    g = torch.Generator().manual_seed(seed)
    for slot, (shape, parts) in slot_layout(spec).items():
        full = torch.randn(shape, generator=g)
        style = planner.shard_style(spec, slot)
        assert style in STYLES, f"{who}: shard_style({slot!r}) = {style!r}, expected one of {STYLES}"
        kept = full.clone()
        pieces = [planner.shard(spec, pplan, slot, full, r) for r in range(tp)]
        assert torch.equal(full, kept), f"{who}: shard() modified {slot!r} in place"
        if style == "replicated":
            assert all(torch.equal(p, full) for p in pieces), f"{who}: {slot!r} not replicated"
            continue
        assert len({tuple(p.shape) for p in pieces}) == 1, \
            f"{who}: {slot!r} pieces differ in shape: {[tuple(p.shape) for p in pieces]}"
        if style == "vocab":  # V rows, then zero rows up to a multiple of tp
            whole = reassemble(style, None, pieces)
            assert whole.shape[0] == -(-full.shape[0] // tp) * tp, \
                f"{who}: {slot!r} pieces hold {whole.shape[0]} rows of {full.shape[0]}, " \
                f"expected the vocab padded to a multiple of {tp}"
            assert torch.equal(whole[:full.shape[0]], full) and not whole[full.shape[0]:].any(), \
                f"{who}: {slot!r} (vocab) pieces are not its rows in rank order, zero-padded"
            continue
        qkv = slot.endswith(("qkv.weight", "qkv.bias")) and style == "column"
        copies = tp // spec.num_kv_heads if qkv and spec.num_kv_heads < tp else 1
        held = full.numel() + (copies - 1) * 2 * spec.kv_size * (full.numel() // full.shape[0])
        assert sum(p.numel() for p in pieces) == held, \
            f"{who}: {slot!r} pieces hold {sum(p.numel() for p in pieces)} values, expected " \
            f"{held} (the weight's {full.numel()}, kv heads copied {copies}x)"
        if slot.endswith("qkv.weight") and style == "column":  # heads are never cut
            assert pieces[0].shape[0] % spec.head_dim == 0, f"{who}: {slot!r} cuts a head"
        assert torch.equal(reassemble(style, parts if style == "column" else None, pieces,
                                      copies), full), \
            f"{who}: {slot!r} ({style}) pieces do not reassemble to the full weight"


def check_refusal(planner, spec, world_size: int, **options) -> PlanError:
    """Planning must fail with a PlanError that names the planner and the numbers."""
    with pytest.raises(PlanError) as info:
        planner.plan(spec, world_size, **options)
    msg = str(info.value)
    assert planner.name in msg, f"PlanError does not name planner {planner.name!r}: {msg}"
    assert any(ch.isdigit() for ch in msg), f"PlanError gives no numbers: {msg}"
    return info.value


def default_spec() -> ModelSpec:
    """4 layers, 8 heads, 4 KV heads, every bias: divides by 1, 2 and 4."""
    return ModelSpec(architecture="LlamaForCausalLM", num_layers=4, hidden_size=64,
                     num_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=128,
                     vocab_size=256, max_position=128, rope=RopeSpec(), qkv_bias=True,
                     o_bias=True, mlp_bias=True)


class PlannerFixtures:
    world_sizes: tuple[int, ...] = (1,)
    bad_world_sizes: tuple[int, ...] = ()
    plan_options: dict = {}

    @pytest.fixture
    def spec(self):
        return default_spec()


class PlannerStageTests(PlannerFixtures):
    def test_name_is_valid(self, planner):
        assert isinstance(planner.name, str) and _NAME.match(planner.name), planner.name

    def test_plans_are_frozen_and_deterministic(self, planner, spec):
        for w in self.world_sizes:
            a, b = planner.plan(spec, w, **self.plan_options), planner.plan(spec, w, **self.plan_options)
            assert a == b
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                a.world_size = w + 1

    def test_stages_cover_every_layer_once(self, planner, spec):
        for w in self.world_sizes:
            check_stages(planner, spec, planner.plan(spec, w, **self.plan_options), w)

    @strategies.kit_settings(max_examples=25, deadline=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                    HealthCheck.differing_executors])
    @given(drawn=strategies.model_specs())
    def test_any_spec_is_planned_or_refused_clearly(self, planner, drawn):
        for w in self.world_sizes:
            try:
                pplan = planner.plan(drawn, w, **self.plan_options)
            except PlanError:
                check_refusal(planner, drawn, w, **self.plan_options)
                continue
            check_stages(planner, drawn, pplan, w)
            check_shards(planner, drawn, pplan)


class PlannerShardTests(PlannerFixtures):
    def test_shards_reassemble_to_full_weight(self, planner, spec):
        for w in self.world_sizes:
            check_shards(planner, spec, planner.plan(spec, w, **self.plan_options), seed=w)


class PlannerErrorTests(PlannerFixtures):
    def test_refuses_world_sizes_it_cannot_split(self, planner, spec):
        for w in self.bad_world_sizes:
            check_refusal(planner, spec, w, **self.plan_options)


class PlannerTests(PlannerStageTests, PlannerShardTests, PlannerErrorTests):
    """Everything a planner must pass; subclass with a ``planner`` fixture."""
