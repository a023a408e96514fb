"""The graph runners' eager path on an engine (CPU tests): the step and decode runners
with their static buffers and bucketing, run without capturing, as a CUDA engine uses them."""
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.runner.step_graph import StepGraphRunner


def eager_graph_runners(engine, budget: int, batch: int, step_buckets=(4, 8),
                        decode_buckets=(2, 4), extra_rows: int = 0):
    """Give ``engine`` a StepGraphRunner of ``budget`` tokens (``extra_rows``: drafts'
    logits rows) and a CudaGraphRunner of ``batch`` rows, both eager; returns ``engine``."""
    steps = StepGraphRunner(engine.model, engine.cache, budget, batch, buckets=step_buckets,
                            use_graphs=False, extra_rows=extra_rows)
    steps.capture()
    engine.runner.step_graphs = steps
    decode = CudaGraphRunner(engine.model, engine.cache, batch, buckets=decode_buckets,
                             use_graphs=False)
    decode.capture()
    engine.decode_graphs = decode
    return engine
