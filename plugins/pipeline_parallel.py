"""The ``pp`` planner: pipeline parallelism over every process of the torch.distributed
world, rank r running stage r, a contiguous range of layers (``core/distributed/stages.py``
runs it). With ``micro_batches=1`` (the default) the stages run a step in turn, which
splits a model's memory across devices, not its time; ``micro_batches=M`` cuts each step's
tokens into up to M groups in flight across the stages at once (stage s on group g while
stage s+1 runs group g-1: ``core/distributed/micro_batches.py``). ``tp`` splits both.
With ``tensor_parallel=T`` each stage is T ranks splitting its layers as ``tp`` does
(ranks s*T .. s*T+T-1 run stage s).

    torchrun --nproc-per-node 2 my_script.py   # each rank: core.build(model, plugins=["pp"])
    torchrun --nproc-per-node 4 my_script.py   # plugins=["pp"], tensor_parallel=2: 2 x 2
    # plugins=["pp"], micro_batches=4: a step's tokens in 4 groups through the stages
    # stages=2 (a config's model_parallel_size): refused unless world / tensor_parallel is 2
"""
from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.plan import ParallelPlan

from .tensor_parallel import TensorParallelPlanner, check_divides


class PipelineParallelPlanner(TensorParallelPlanner):  # its shard / shard_style for T > 1
    name = "pp"
    # stages: the count a config asks for (model_parallel_size), checked against the world;
    # None: world_size / tensor_parallel
    options = {"tensor_parallel": 1, "micro_batches": 1, "stages": None}

    def processes(self, tensor_parallel=1, stages=None, **options):
        """The processes these options ask for (None: any number)."""
        return None if stages is None else stages * tensor_parallel

    def plan(self, spec, world_size=1, tensor_parallel=1, micro_batches=1, stages=None,
             **options):
        m, tp = micro_batches, tensor_parallel
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PlanError(f"planner 'pp': micro_batches={m!r} must be an integer >= 1 (the "
                            f"token groups of a step in flight across the stages; 1: none)")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
            raise PlanError(f"planner 'pp': tensor_parallel={tp!r} must be an integer >= 1 "
                            f"that divides world_size={world_size}")
        if stages is not None:
            if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
                raise PlanError(f"planner 'pp': stages={stages!r} must be an integer >= 1")
            if stages * tp != world_size:
                raise PlanError(f"planner 'pp': {stages} stages x tensor_parallel={tp} need "
                                f"{stages * tp} processes but this run has {world_size}: start "
                                f"it with `torchrun --nproc-per-node {stages * tp} script.py`")
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
        return ParallelPlan(world_size, tp, tuple(zip(bounds, bounds[1:])), micro_batches=m)


@hookimpl
def infergraft_register_planners(register):
    register(PipelineParallelPlanner())
