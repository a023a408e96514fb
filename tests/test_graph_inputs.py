"""The CUDA-graph decode path's static inputs, exercised eagerly on the CPU.

CudaGraphRunner(use_graphs=False) runs exactly the buffers a graph would replay:
bucketed batch sizes, padding rows that repeat the last live row, metadata filled in
place by the cache. Tokens must equal the ordinary path's.
"""
import pytest

from infergraft import core
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_static_decode_inputs_match_plain_decode(backend, family):
    cfg = tiny_llama_config() if family == "llama" else tiny_mistral_config(sliding_window=8)
    hf = random_model(cfg, seed=3, scale=5.0)
    plain = core.build(hf, plugins=[backend], max_seq_len=64, max_batch_size=3)
    graphed = core.build(hf, plugins=[backend], max_seq_len=64, max_batch_size=3)
    graphed.cache.device_decode = True  # contiguous: tensor-only decode metadata
    runner = CudaGraphRunner(graphed.model, graphed.cache, 3, buckets=(2,), use_graphs=False)
    runner.capture()
    graphed.decode_graphs = runner
    prompts = [random_prompt(n, cfg.vocab_size, n) for n in (4, 11, 19, 7)]
    # 4 prompts, 3 rows: continuous batching gives decode batches of 3, 2 and 1, i.e.
    # buckets 3 (exact) and 2 (one padding row when a single sequence is left)
    want = [c.token_ids for c in plain.generate(prompts, max_new_tokens=12)]
    assert [c.token_ids for c in graphed.generate(prompts, max_new_tokens=12)] == want
    assert runner.replays > 0 and runner.buckets == [2, 3]
