"""Running a ParallelPlan: the process group, each rank's spec and weight shards, and the
collectives the model and engine call (Megatron-style tensor parallelism).

Every rank runs the same program (``torchrun --nproc-per-node N script.py``, each rank
calling ``core.build(..., plugins=["tp"])`` and then the same ``generate`` calls), as
with DeepSpeed-Inference. Column-parallel projections (qkv, gate_up / fc_in) hold their
rank's heads and MLP rows; row-parallel ones (o, down) the matching input columns, and
their outputs are summed across ranks (one all-reduce each). Sampled tokens are taken
from rank 0, so sampling without a seed still agrees everywhere.
"""
from __future__ import annotations

import atexit
import os

import attrs
import torch

from .errors import PlanError

ROW_BIASES = (".o.bias", ".down.bias")  # added once, after the all-reduce (rank 0 keeps them)


class TensorParallelGroup:
    """This process's rank in a tensor-parallel group and the two collectives it needs."""

    def __init__(self, size: int, rank: int, group=None):
        self.size, self.rank, self.group = size, rank, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (or split-K partials [S, T, H]) -> the sum over ranks, in place
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def share(self, logits, shape, device):
        return logits  # every rank computed them whole

    def agree(self, tokens: list[int], device) -> list[int]:
        """Rank 0's sampled tokens, on every rank."""
        if not tokens:
            return tokens
        t = torch.tensor(tokens, dtype=torch.int64, device=device)
        torch.distributed.broadcast(t, src=self._global(0), group=self.group)
        return t.tolist()

    def _global(self, rank: int) -> int:
        if self.group is None:
            return rank
        return torch.distributed.get_global_rank(self.group, rank)


def world_size_for(planner, device: torch.device) -> int:
    """1 for planners that stay in one process; else the torch.distributed world size,
    initialising the default group from torchrun's environment if nobody has."""
    if not getattr(planner, "spans_processes", False):
        return 1
    dist = torch.distributed
    if not dist.is_available():
        raise PlanError(f"planner {planner.name!r} needs torch.distributed, which this "
                        "torch build lacks")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise PlanError(
                f"planner {planner.name!r} runs one process per rank: launch with `torchrun "
                f"--nproc-per-node N script.py` (or call torch.distributed."
                f"init_process_group first); no process group and no WORLD_SIZE found")
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        atexit.register(_leave_group)  # a group alive at interpreter exit aborts the process
    return dist.get_world_size()


def _leave_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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
    stage: object = None  # core.stages.PipelineStage: the stream in and out
    place: object = None  # slot, tensor -> (slot, piece) or None (core.weights.load_weights)
    unheld: int = 0  # elements of spec's non-layer slots this rank does not hold

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
        subgroups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) if stages > 1 else None
                     for s in range(stages)]
        group = TensorParallelGroup(tp, tp_rank, subgroups[index])
    if stages == 1:
        return RankSetup(local_spec(spec, tp), tp=group,
                         place=shard_fn(planner, spec, parallel, group))
    from .stages import PipelineStage, stage_slot, stage_spec, unheld_elements

    stage = PipelineStage(index, stages, parallel.stages[index], tp=tp, tp_rank=tp_rank)
    shard = None if group is None else shard_fn(planner, spec, parallel, group)

    def place(slot, tensor):  # another stage's slot: dropped; ours: cut (by the whole
        name = stage_slot(spec, stage, slot)  # model's name), then renamed
        if name is None:
            return None
        return name, tensor if shard is None else shard(slot, tensor)[1]

    return RankSetup(local_spec(stage_spec(spec, stage), tp), group, stage, place,
                     unheld_elements(spec, stage))


def local_spec(spec, tp: int):
    """What one rank runs: its share of the heads and of the MLP's rows."""
    if tp == 1:
        return spec
    return attrs.evolve(spec, num_heads=spec.num_heads // tp,
                        num_kv_heads=spec.num_kv_heads // tp,
                        intermediate_size=spec.intermediate_size // tp)


def shard_fn(planner, spec, parallel, tp: TensorParallelGroup):
    """slot, full tensor -> (slot, the piece this rank holds)."""

    def shard(slot: str, tensor: torch.Tensor):
        piece = planner.shard(spec, parallel, slot, tensor, tp.rank)
        if tp.rank and slot.endswith(ROW_BIASES):  # summed once by the all-reduce
            piece = torch.zeros_like(piece)
        return slot, piece.contiguous()

    return shard
