"""The ``tp`` planner: Megatron-style tensor parallelism over every process of the
torch.distributed world, one pipeline stage (``core/distributed/ranks.py`` runs the plan).

    torchrun --nproc-per-node 2 my_script.py     # each rank: core.build(model, plugins=["tp"])

Column-parallel (dim 0 cut inside each fused part, so q, k and v are each split by
heads; with fewer kv heads than ranks each rank holds a copy of the one kv head its query
heads read, ``kv_replicas``): qkv, gate_up, fc_in and their biases, and a mixture of
experts' ``experts_gate_up`` (every expert's gate and up rows cut). Row-parallel (dim 1):
o, down, ``experts_down``: each rank computes every expert on its share of the
intermediate rows, the router whole on every rank (expert parallelism, whole experts on
each rank, is not offered: docs/architecture.md says what it would need). Vocab-parallel (dim 0, the vocab padded with zero rows to a multiple of tp:
``core/distributed/vocab.py``): the embeddings and the LM head (one matrix when tied).
Everything else (positions, norms, o / down biases) is replicated.
"""
import torch

from infergraft.core.distributed.ranks import runtime_style
from infergraft.core.distributed.vocab import shard_vocab
from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.plan import ParallelPlan, Planner
from infergraft.core.slots import slot_layout


def check_divides(planner: str, spec, tp: int) -> None:
    """PlanError unless ``tp`` ranks split the heads and the MLP evenly (each expert's
    rows too: experts are cut as the dense MLP is, every rank holding a share of each),
    and the kv heads either split evenly or, fewer than the ranks, each go whole to
    tp / kv_heads ranks."""
    experts = sorted({x.experts.intermediate_size for x in spec.layers if x.experts})
    for what, n in (("num_heads", spec.num_heads), ("intermediate_size", spec.intermediate_size),
                    *(("the experts' intermediate_size", n) for n in experts)):
        if n % tp:
            raise PlanError(f"planner {planner!r}: {tp} ranks do not divide {what}={n}; use a "
                            f"tensor-parallel size that divides {spec.num_heads} heads, "
                            f"{spec.num_kv_heads} kv heads and "
                            f"{', '.join(map(str, [spec.intermediate_size, *experts]))}")
    kv = spec.num_kv_heads
    if kv % tp and tp % kv:
        raise PlanError(f"planner {planner!r}: {tp} ranks neither divide num_kv_heads={kv} nor "
                        f"are a multiple of it (each kv head copied to tp / {kv} ranks); use a "
                        f"tensor-parallel size that divides {kv} or that {kv} divides")


def kv_replicas(spec, tp: int) -> int:
    """Ranks holding a copy of each kv head: tp / num_kv_heads where the kv heads are fewer
    than the ranks (a rank's query heads all read one kv head), else 1."""
    return tp // spec.num_kv_heads if spec.num_kv_heads < tp else 1


class TensorParallelPlanner(Planner):
    name = "tp"
    spans_processes = True  # core.build passes the torch.distributed world size
    # the size a config asks for (DeepSpeed's tensor_parallel.tp_size), checked against the
    # world; None: the world's size
    options = {"tp_size": None}

    def processes(self, tp_size=None, **options):
        """The processes these options ask for (None: any number)."""
        return tp_size

    def plan(self, spec, world_size=1, tp_size=None, **options):
        if world_size < 1:
            raise PlanError(f"planner 'tp': world_size must be >= 1, got {world_size}")
        if tp_size is not None:
            if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
                raise PlanError(f"planner 'tp': tp_size={tp_size!r} must be an integer >= 1")
            check_divides(self.name, spec, tp_size)  # a size no launch can fix, first
            if tp_size != world_size:
                raise PlanError(f"planner 'tp': tensor_parallel.tp_size={tp_size} but this run "
                                f"has {world_size} process(es): start it with `torchrun "
                                f"--nproc-per-node {tp_size} script.py`")
        check_divides(self.name, spec, world_size)
        return ParallelPlan(world_size, world_size, ((0, spec.num_layers),))

    def shard_style(self, spec, slot: str) -> str:
        return runtime_style(slot)  # Megatron's splits, the ones the runtime runs

    def shard(self, spec, parallel, slot: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        tp, style = parallel.tensor_parallel, self.shard_style(spec, slot)
        if style == "replicated" or tp == 1:
            return tensor
        if style == "row":  # [H, in] -> [H, in / tp]
            return tensor.chunk(tp, dim=1)[rank]
        if style == "vocab":  # [V, H] -> [ceil(V / tp), H], zero rows past V
            return shard_vocab(tensor, tp, rank)
        parts = slot_layout(spec)[slot][1] or (tensor.shape[0],)  # q, kv, kv / gate, up
        copies = kv_replicas(spec, tp) if slot.endswith(("qkv.weight", "qkv.bias")) else 1
        return torch.cat([p.chunk(tp)[rank] if j == 0 or copies == 1 else  # k, v: one head
                          p.chunk(spec.num_kv_heads)[rank // copies]
                          for j, p in enumerate(torch.split(tensor, list(parts)))])


@hookimpl
def infergraft_register_planners(register):
    register(TensorParallelPlanner())
