"""The default planner: the whole model on one device, one pipeline stage."""
from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.plan import ParallelPlan, Planner


class SingleDevicePlanner(Planner):
    name = "single"

    def plan(self, spec, world_size=1, **options):
        if world_size != 1:
            raise PlanError(f"planner 'single' runs on one device, got world_size={world_size}")
        return ParallelPlan(world_size=1, tensor_parallel=1, stages=((0, spec.num_layers),))


@hookimpl
def infergraft_register_planners(register):
    register(SingleDevicePlanner())
