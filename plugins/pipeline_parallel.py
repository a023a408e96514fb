"""The ``pp`` planner: pipeline parallelism over every process of the torch.distributed
world, rank r running stage r, a contiguous range of layers (``core/stages.py`` runs
it). Stages run in turn (no micro-batches), so this splits a model's memory across
devices, not its time; ``tp`` splits both.

    torchrun --nproc-per-node 2 my_script.py     # each rank: core.build(model, plugins=["pp"])
"""
from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.plan import ParallelPlan, Planner


class PipelineParallelPlanner(Planner):
    name = "pp"
    spans_processes = True  # core.build passes the torch.distributed world size

    def plan(self, spec, world_size=1, **options):
        if not 1 <= world_size <= spec.num_layers:
            raise PlanError(f"planner 'pp': {world_size} stages for {spec.num_layers} layers; "
                            f"use 1 to {spec.num_layers} ranks")
        base, extra = divmod(spec.num_layers, world_size)  # the first `extra` take one more
        bounds = [0]
        for s in range(world_size):
            bounds.append(bounds[-1] + base + (s < extra))
        return ParallelPlan(world_size, 1, tuple(zip(bounds, bounds[1:])))


@hookimpl
def infergraft_register_planners(register):
    register(PipelineParallelPlanner())
