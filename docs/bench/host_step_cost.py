"""The host's share of an engine step at B running sequences, on the CPU, with the model
itself stubbed out (logits of zeros, no kernel): what the GPU waits for between two graph
replays when the host does not overlap them (scheduling, the graphs' inputs, sampling,
appending). The paged cache's decode and mixed-step graph inputs are filled as on CUDA
(``use_graphs=False``: the same static buffers, no replay), and the next step is scheduled
ahead as on one CUDA device: the part of the host's time that would run beside the GPU's
forward is reported apart.

    python docs/bench/host_step_cost.py [B] [STEPS] [MAX_SEQ_LEN]
"""
import random
import sys
import time

import torch

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.runner.step_graph import StepGraphRunner
from infergraft.core.testing.models import random_model, tiny_llama_config

VOCAB = 1024  # small: on a GPU the logits stay there (the argmax is a kernel)


class NullModel(torch.nn.Module):
    """Logits of zeros for the rows asked: the step's host work without its GPU work."""

    def __init__(self):
        super().__init__()
        self.register_buffer("anchor", torch.zeros(1))

    def forward(self, tokens, cache, meta, logits_index=None, greedy_out=None):
        rows = tokens.shape[0] if logits_index is None else logits_index.shape[0]
        if greedy_out is not None:
            greedy_out.zero_()
        return torch.zeros(rows, VOCAB)


def main(batch=256, steps=200, max_seq_len=1344):
    torch.set_num_threads(1)
    hf = random_model(tiny_llama_config(), seed=0)
    engine = core.build(hf, plugins=["paged"], max_seq_len=max_seq_len, max_batch_size=batch,
                        dtype="float32", device="cpu", max_num_batched_tokens=2048)
    null = NullModel()
    engine.runner.model = null
    engine.decode_graphs = CudaGraphRunner(null, engine.cache, batch, use_graphs=False)
    engine.decode_graphs.capture()
    engine.runner.step_graphs = StepGraphRunner(null, engine.cache, 2048, batch,
                                                use_graphs=False)
    engine.runner.step_graphs.capture()
    rng = random.Random(0)
    for _ in range(4 * batch):  # prompts 128..896, outputs 64..448: the uniform workload
        engine.add_request([rng.randrange(10, 200) for _ in range(rng.randrange(128, 897))],
                           SamplingParams(max_new_tokens=rng.randrange(64, 449),
                                          ignore_eos=True))
    # as on one CUDA device: the next step scheduled while this one's forward would run
    engine.schedule_ahead = True
    ahead, overlapped = engine.scheduler.schedule_ahead, []

    def timed_ahead():
        t = time.perf_counter()
        step = ahead()
        overlapped[-1] += time.perf_counter() - t
        return step
    engine.scheduler.schedule_ahead = timed_ahead
    for _ in range(20):
        overlapped.append(0.0)
        engine.step()
    times, kinds, overlapped[:] = [], [], []
    for _ in range(steps):
        overlapped.append(0.0)
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        kinds.append(engine.scheduler.last_kind)
    for kind in ("decode", "prefill"):
        ts = sorted(t for t, k in zip(times, kinds) if k == kind)
        off = sorted(t - o for t, o, k in zip(times, overlapped, kinds) if k == kind)
        if ts:
            print(f"{kind:8s} steps {len(ts):4d}: host {1e3 * ts[len(ts) // 2]:.2f} ms "
                  f"median, of which on the GPU's critical path {1e3 * off[len(off) // 2]:.2f}"
                  f" (the rest is scheduled ahead, beside the forward) "
                  f"({len(engine.scheduler.running)} running at the end)")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
