"""The graph runners' eager path on an engine (CPU tests): the step and decode runners
with their static buffers and bucketing, run without capturing, as a CUDA engine uses them;
and a workload of arrivals stepped through an engine (``drive``)."""
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


def drive(engine, arrivals, abort=None, each=None) -> list:
    """``arrivals``: (step, prompt, SamplingParams), by step; each request added at its
    step, ``abort`` (step, index): that request aborted then, ``each()`` after every step.
    Steps until nothing is left, then checks nothing is in flight and the cache holds no
    sequence. Returns the sequences in arrival order."""
    pending, seqs, step = list(arrivals), [], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            seqs.append(engine.add_request(prompt, params))
        if abort is not None and abort[0] == step:
            engine.abort(seqs[abort[1]])
        engine.step()
        if each is not None:
            each()
        step += 1
    assert engine.async_steps.inflight is None
    engine.cache.check_invariants()
    assert engine.cache.stats()["sequences"] == 0
    return seqs
