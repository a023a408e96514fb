"""Running a ParallelPlan across torch.distributed processes: each rank's spec, weight
pieces and groups (``ranks``), pipeline stages (``stages``) and the collectives the model
and engine call (``collectives``)."""
