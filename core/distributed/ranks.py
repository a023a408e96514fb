"""Running a ParallelPlan: the process group, and each rank's spec, groups and weight
shards (Megatron-style tensor parallelism; pipeline stages in ``stages``; the collectives
in ``collectives``).

Every rank runs the same program (``torchrun --nproc-per-node N script.py``, each rank
calling ``core.build(..., plugins=["tp"])`` and then the same ``generate`` calls), as
with DeepSpeed-Inference. Column-parallel projections (qkv, gate_up / fc_in) hold their
rank's heads and MLP rows; row-parallel ones (o, down) the matching input columns, and
their outputs are summed across ranks (one all-reduce each). The embeddings and an untied
LM head hold the rank's rows of the padded vocab (``vocab``); the logits are gathered to
rank 0, which samples, and sampled tokens are taken from rank 0, so sampling without a
seed still agrees everywhere.
"""
from __future__ import annotations

import atexit
import os

import attrs
import torch

from ..errors import PlanError, WeightLoadError
from ..slots import slot_layout
from .collectives import TensorParallelGroup
from .failure import adopt, collective_timeout, leave_group, new_group
from .stages import PipelineStage, not_held_elements, stage_slot, stage_spec
from .vocab import VOCAB_SLOTS, rank_layout, vocab_not_held

ROW_BIASES = (".o.bias", ".down.bias")  # added once, after the all-reduce (rank 0 keeps them)
# the splits the model runs (all-reduce after o and down): a planner must shard so. The
# experts of a mixture of experts as the dense MLP: each expert's gate and up rows cut
# (the stacked slot's every part), its down's columns
COLUMN = (".qkv.weight", ".qkv.bias", ".gate_up.weight", ".gate_up.bias", ".fc_in.weight",
          ".fc_in.bias", ".experts_gate_up.weight")
ROW = (".o.weight", ".down.weight", ".experts_down.weight")


def runtime_style(slot: str) -> str:
    """How the tensor-parallel runtime splits ``slot``: column, row, vocab (the embedding
    and LM head's rows, ``vocab.py``) or replicated."""
    if slot in VOCAB_SLOTS:
        return "vocab"
    return "column" if slot.endswith(COLUMN) else "row" if slot.endswith(ROW) else "replicated"


def world_size_for(planner, device: torch.device, options: dict | None = None) -> int:
    """1 for planners that stay in one process; else the torch.distributed world size,
    initialising the default group from torchrun's environment if nobody has. Without
    one, the error names the processes the planner's ``options`` ask for (its optional
    ``processes(**options)``)."""
    if not getattr(planner, "spans_processes", False):
        return 1
    dist = torch.distributed
    if not dist.is_available():
        raise PlanError(f"planner {planner.name!r} needs torch.distributed, which this "
                        "torch build lacks")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            wanted = getattr(planner, "processes", lambda **o: None)(**(options or {}))
            asked = f", {wanted} as its options ask" if wanted else ""
            raise PlanError(
                f"planner {planner.name!r} runs one process per rank{asked}: launch with "
                f"`torchrun --nproc-per-node {wanted or 'N'} script.py` (or call torch."
                f"distributed.init_process_group first); this process is alone (no process "
                f"group, no WORLD_SIZE)")
        # every collective waits failure.collective_timeout() at most (torch's: 30 min)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=collective_timeout())
        atexit.register(_leave_group)  # a group alive at interpreter exit aborts the process
    else:  # the caller's group: ours unless it chose a timeout (send / recv keep theirs)
        adopt()
    return dist.get_world_size()


def _leave_group() -> None:
    """At exit: leave the group (a rank that failed has left it already)."""
    if torch.distributed.is_initialized():
        try:
            leave_group()
        except Exception:  # a peer gone meanwhile: the process exits anyway
            pass


def rank_device(device: torch.device, parallel) -> torch.device:
    """On CUDA without an index, each rank takes its own GPU (torchrun's LOCAL_RANK), and
    makes it current: Triton launches and NCCL use the current device."""
    if parallel.world_size > 1 and device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return device


@attrs.frozen
class RankSetup:
    """What this process runs of a ParallelPlan."""

    spec: object  # its ModelSpec: its heads and MLP rows of its stage's layers
    tp: object = None  # TensorParallelGroup: the all-reduce after o and down
    stage: object = None  # stages.PipelineStage: the stream in and out
    place: object = None  # slot, tensor -> (slot, piece) or None (loading.weights.load_weights)
    not_held: int = 0  # elements of spec's non-layer slots this rank does not hold

    @property
    def ranks(self):
        """Whom the engine asks for the sampled tokens: the stage, or the tp group."""
        return self.stage if self.stage is not None else self.tp


def rank_setup(planner, spec, parallel) -> RankSetup:
    """This rank's spec, groups and weight placement. Ranks s*T .. s*T+T-1 run stage s,
    each holding 1/T of its layers (T = tensor_parallel)."""
    stages, tp = len(parallel.stages), parallel.tensor_parallel
    if stages == 1 and tp == 1:
        return RankSetup(spec)
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != tp * stages:
        raise PlanError(f"the plan has tensor_parallel={tp} x {stages} stage(s), but the "
                        f"process group has {world} rank(s)")
    index, tp_rank = divmod(dist.get_rank(), tp)
    group = None
    if tp > 1:
        # every rank creates every stage's group, in the same order (new_group's contract)
        subgroups = [new_group(list(range(s * tp, (s + 1) * tp))) if stages > 1 else None
                     for s in range(stages)]
        group = TensorParallelGroup(tp, tp_rank, subgroups[index])
        check_styles(planner, spec)
    shard = None if group is None else shard_fn(planner, spec, parallel, group)
    stage = None
    if stages > 1:
        stage = PipelineStage(index, stages, parallel.stages[index], tp=tp, tp_rank=tp_rank)
    return _placed(spec, group, stage, shard)


def check_styles(planner, spec) -> None:
    for slot in slot_layout(spec):
        style = planner.shard_style(spec, slot)
        if style != runtime_style(slot):
            raise PlanError(f"planner {planner.name!r} shards {slot!r} {style}, but the "
                            f"tensor-parallel runtime runs it {runtime_style(slot)} (column: "
                            "qkv, gate_up, fc_in, experts_gate_up; row: o, down, experts_down; "
                            "vocab: embed, lm_head; the rest replicated)")


def _placed(spec, tp, stage, shard) -> RankSetup:
    """The rank's setup; its ``place`` drops another stage's slots, cuts ours (by the whole
    model's names), renames them to the stage's and checks each piece's shape."""
    size = 1 if tp is None else tp.size
    run_spec, not_held = rank_spec(spec, stage, size)
    layout = rank_layout(slot_layout(run_spec), spec.vocab_size, size)  # vocab slots: rows

    def place(slot, tensor):
        name = slot if stage is None else stage_slot(spec, stage, slot)
        if name is None:
            return None
        piece = tensor if shard is None else shard(slot, tensor)
        if tuple(piece.shape) != tuple(layout[name][0]):
            raise WeightLoadError(f"this rank's piece of {slot!r} has shape "
                                  f"{tuple(piece.shape)}; its model expects {layout[name][0]}")
        return name, piece

    return RankSetup(run_spec, tp, stage, place, not_held)


def rank_spec(spec, stage, tp: int):
    """(what one rank runs: 1/tp of its stage's layers, elements of the embeddings and head
    that rank does not hold though ``weight_bytes`` of that spec counts them: another
    stage's, and the other ranks' vocab rows of its own). The spec keeps the model's
    ``vocab_size``: requests, logits and the sampler see the whole vocab."""
    layout = slot_layout(spec)
    if stage is None:
        return local_spec(spec, tp), vocab_not_held(layout, layout, spec.vocab_size, tp)
    held = [s for s in VOCAB_SLOTS if s in layout and stage_slot(spec, stage, s) is not None]
    return local_spec(stage_spec(spec, stage), tp), \
        not_held_elements(spec, stage) + vocab_not_held(layout, held, spec.vocab_size, tp)


def local_spec(spec, tp: int):
    """What one rank runs: its share of the heads and of the MLP's rows, every expert's
    too (the vocab whole: its rows of the embeddings and head are ``vocab.rank_layout``'s)."""
    if tp == 1:
        return spec
    layers = tuple(layer if layer.experts is None else attrs.evolve(
        layer, experts=attrs.evolve(layer.experts,
                                    intermediate_size=layer.experts.intermediate_size // tp))
        for layer in spec.layers)
    # fewer kv heads than ranks: one (a copy) a rank
    return attrs.evolve(spec, num_heads=spec.num_heads // tp,
                        num_kv_heads=max(1, spec.num_kv_heads // tp),
                        intermediate_size=spec.intermediate_size // tp, layers=layers)


def shard_fn(planner, spec, parallel, tp: TensorParallelGroup):
    """slot, full tensor -> the piece this rank holds."""

    def shard(slot: str, tensor: torch.Tensor) -> torch.Tensor:
        piece = planner.shard(spec, parallel, slot, tensor, tp.rank)
        if tp.rank and slot.endswith(ROW_BIASES):  # summed once by the all-reduce
            piece = torch.zeros_like(piece)
        return piece.contiguous()

    return shard


def agreed(check, parallel) -> None:
    """Run ``check()`` (the plan's memory check) on every rank of a multi-process plan and
    raise on all of them if it raised on any: a PlanError on some ranks only would leave
    the others waiting in their first collective. One process: ``check()`` alone."""
    if parallel.world_size == 1:
        return check()
    error = None
    try:
        check()
    except PlanError as e:
        error = str(e)
    errors = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, error)  # every rank's verdict, in rank order
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        raise PlanError(f"the plan does not fit on rank(s) {failed} of "
                        f"{len(errors)}; rank {failed[0]}: {errors[failed[0]]}")
    return None
