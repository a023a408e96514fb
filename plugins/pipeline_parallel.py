"""The ``pp`` planner: pipeline parallelism over every process of the torch.distributed
world, rank r running stage r, a contiguous range of layers (``core/stages.py`` runs
it). Stages run in turn (no micro-batches), so this splits a model's memory across
devices, not its time; ``tp`` splits both. With ``tensor_parallel=T`` each stage is T
ranks splitting its layers as ``tp`` does (ranks s*T .. s*T+T-1 run stage s).

    torchrun --nproc-per-node 2 my_script.py   # each rank: core.build(model, plugins=["pp"])
    torchrun --nproc-per-node 4 my_script.py   # plugins=["pp"], tensor_parallel=2: 2 x 2
"""
from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.plan import ParallelPlan

from .tensor_parallel import TensorParallelPlanner, check_divides


class PipelineParallelPlanner(TensorParallelPlanner):  # its shard / shard_style for T > 1
    name = "pp"
    options = {"tensor_parallel": 1}

    def plan(self, spec, world_size=1, tensor_parallel=1, **options):
        tp = tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
            raise PlanError(f"planner 'pp': tensor_parallel={tp!r} must be an integer >= 1 "
                            f"that divides world_size={world_size}")
        stages = world_size // tp
        if not 1 <= stages <= spec.num_layers:
            raise PlanError(f"planner 'pp': {stages} stages for {spec.num_layers} layers "
                            f"(world_size={world_size}, tensor_parallel={tp}); use 1 to "
                            f"{spec.num_layers} stages")
        check_divides(self.name, spec, tp)
        base, extra = divmod(spec.num_layers, stages)  # the first `extra` take one more
        bounds = [0]
        for s in range(stages):
            bounds.append(bounds[-1] + base + (s < extra))
        return ParallelPlan(world_size, tp, tuple(zip(bounds, bounds[1:])))


@hookimpl
def infergraft_register_planners(register):
    register(PipelineParallelPlanner())
