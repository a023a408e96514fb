"""The fused decode layer across ranks (`tp`, `pp`), and tp's decode / mixed-step graph
path: two gloo ranks on the CPU run the Triton kernels in the interpreter (float16) and
must give the tokens and logits of the same fused layer in one process. The graph
runners run eagerly through their static buffers (``use_graphs=False``: gloo cannot be
captured), the greedy look-ahead feeding each rank the argmax the group's rank 0 chose.
On two GPUs the same over NCCL with the graphs captured (bf16 and fp32)."""
import pytest
import torch

from infergraft.core.testing.distributed import run_ranks
from infergraft.kernels._triton import HAVE_TRITON, interpreting

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 33, 7], [1, 200, 3]]
NEW_TOKENS = 6
CASES = {  # name -> (plugins, the graph runners' path)
    "tp-contiguous": (["tp"], False),
    "tp-paged-graph-path": (["tp", "paged"], True),
    "pp-paged": (["pp", "paged"], False),
    "pp-micro-batches": (["pp", "paged"], False),
}


def fused_cases(cases: list[dict]) -> list[dict]:
    if interpreting():  # as tests/conftest.py does in the test process
        import interpreter_support

        interpreter_support.install()
    return [fused_case(**case) for case in cases]


def fused_case(name: str, device: str = "cpu", dtype: str = "float16") -> dict:
    from infergraft import core
    from infergraft.core.testing.models import (random_model, tiny_llama_config,
                                                with_random_norm_weights)
    from infergraft.core.testing.parity import relative_error

    plugins, graph_path = CASES[name]
    config = tiny_llama_config(hidden_size=128, intermediate_size=128)
    hf = with_random_norm_weights(random_model(config, seed=4, scale=2.0))  # same on each rank
    kw = dict(max_seq_len=48, max_batch_size=2, dtype=dtype, device=device,
              kernels="triton")
    if device == "cuda":
        hf = hf.to(torch.device("cuda", torch.cuda.current_device()))
    extra = {"micro_batches": 2} if name == "pp-micro-batches" else {}
    ours = core.build(hf, plugins=plugins, **kw, **extra)
    if graph_path and device == "cpu":
        _graph_path(ours)
    calls = _count(ours.model.ops, "linear_residual")
    logits = [ours.logits(p).float() for p in PROMPTS]
    tokens = [c.token_ids for c in ours.generate(PROMPTS, max_new_tokens=NEW_TOKENS)]
    result = {"ours": tokens, "logits": [t.tolist() for t in logits],
              "fused": [ours.model.norms_folded, len(calls)],
              "replays": [getattr(getattr(ours.runner, r), "replays", None)
                          for r in ("decode_graphs", "step_graphs")]}
    if torch.distributed.get_rank() == 0:  # one process's engine, on one rank: the reference
        alone = _alone(hf, [p for p in plugins if p not in ("tp", "pp")], graph_path, kw)
        result.update(alone=alone["tokens"], alone_folded=alone["folded"],
                      errors=[relative_error(a, b) for a, b in zip(logits, alone["logits"])])
    return result


_ALONE = {}  # (plugins, graph path, dtype, device) -> what one process's engine gave


def _alone(hf, plugins: list, graph_path: bool, kw: dict) -> dict:
    """The reference engine's logits, tokens and folding, once a rank for the cases that
    share it (pp's two: the same plugins in one process); every case builds ``hf`` alike."""
    key = (tuple(plugins), graph_path, kw["dtype"], kw["device"])
    if key not in _ALONE:
        from infergraft import core

        engine = core.build(hf, plugins=plugins, **kw)
        if graph_path and kw["device"] == "cpu":
            _graph_path(engine)
        _ALONE[key] = {"logits": [engine.logits(p).float() for p in PROMPTS],
                       "tokens": [c.token_ids for c in engine.generate(
                           PROMPTS, max_new_tokens=NEW_TOKENS)],
                       "folded": engine.model.norms_folded}
    return _ALONE[key]


def _graph_path(engine) -> None:
    """The decode and mixed-step graph runners, run through their static buffers."""
    from infergraft.core.runner.cuda_graph import CudaGraphRunner
    from infergraft.core.runner.step_graph import StepGraphRunner

    model, cache = engine.model, engine.cache
    engine.decode_graphs = CudaGraphRunner(model, cache, 2, buckets=(1, 2), use_graphs=False)
    engine.runner.step_graphs = StepGraphRunner(model, cache, 16, 2, buckets=(16,),
                                                use_graphs=False)
    engine.decode_graphs.capture()
    engine.runner.step_graphs.capture()


def _count(ops, name: str) -> list:
    calls, op = [], getattr(ops, name)
    setattr(ops, name, lambda *a, **k: calls.append(a[0].shape[0]) or op(*a, **k))
    return calls


# (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU; on one the GPU tests run)
@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="runs where Triton interprets")
def test_the_fused_layer_across_ranks_matches_one_process():
    """Every case in one pair of ranks (one test: xdist would start a pair a case)."""
    r0s, r1s = run_ranks(fused_cases, 2, [dict(name=n) for n in CASES], timeout=900)
    for name, r0, r1 in zip(CASES, r0s, r1s):
        (folded, calls), alone_folded = r0["fused"], r0["alone_folded"]
        assert folded and alone_folded and calls > 0, (name, r0["fused"])  # the fused layer ran
        assert r0["ours"] == r0["alone"] == r1["ours"], (name, r0["alone"], r1["ours"])
        assert max(r0["errors"]) < 1e-2, (name, r0["errors"])
        assert r0["logits"] == r1["logits"], name  # the ranks agree bit for bit
        if CASES[name][1]:  # every step went through the graph runners' buffers
            decode, steps = r0["replays"]
            assert decode >= NEW_TOKENS - 1 and steps >= 1, (name, r0["replays"])
            assert r1["replays"] == r0["replays"], name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_two_gpus_replay_graphs_with_the_all_reduces_in_them(dtype):
    """tp 2 over NCCL: the fused layer (bf16) or the plain one (fp32) under captured decode
    and mixed-step graphs gives one GPU's tokens."""
    cases = [dict(name="tp-paged-graph-path", device="cuda", dtype=dtype)]
    (r0,), (r1,) = run_ranks(fused_cases, 2, cases, backend="nccl", timeout=600)
    assert r0["ours"] == r0["alone"] == r1["ours"], (r0["ours"], r0["alone"], r1["ours"])
    assert max(r0["errors"]) < (1e-2 if dtype == "bfloat16" else 1e-4), r0["errors"]
    assert r0["fused"][0] == (dtype == "bfloat16") and all(r0["replays"]), r0["fused"]


def one_rank_group_in_graphs() -> dict:
    """One GPU, a NCCL group of one: the same engine, its layers and head told they are
    tp's rank 0 of 1, so every step runs the all-reduces, the head's gather and the
    argmax broadcast through NCCL, captured in its decode and mixed-step graphs."""
    from infergraft import core
    from infergraft.core.distributed.collectives import TensorParallelGroup
    from infergraft.core.distributed.vocab import VocabParallel
    from infergraft.core.runner.cuda_graph import CudaGraphRunner
    from infergraft.core.runner.step_graph import StepGraphRunner
    from infergraft.core.testing.models import random_model, tiny_llama_config

    hf = random_model(tiny_llama_config(hidden_size=256, intermediate_size=512), seed=4,
                      scale=2.0).cuda()
    kw = dict(plugins=["paged"], max_seq_len=48, max_batch_size=2, dtype="bfloat16",
              device="cuda")
    alone, grouped = core.build(hf, **kw), core.build(hf, cuda_graphs=False, **kw)
    net, tp = grouped.model, TensorParallelGroup(1, 0)
    net.tp, net.vocab = tp, VocabParallel(net.spec.vocab_size, tp)
    for layer in net.layers:
        layer.tp = tp
    grouped.decode_graphs = CudaGraphRunner(net, grouped.cache, 2)
    grouped.runner.step_graphs = StepGraphRunner(net, grouped.cache, 16, 2, buckets=(16,))
    grouped.decode_graphs.capture()
    grouped.runner.step_graphs.capture()
    got = [e.generate(PROMPTS, max_new_tokens=NEW_TOKENS) for e in (grouped, alone)]
    return {"tokens": [[c.token_ids for c in g] for g in got], "fused": net.norms_folded,
            "replays": [grouped.decode_graphs.replays, grouped.runner.step_graphs.replays]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_captures_the_nccl_collectives_in_its_graphs():
    (got,) = run_ranks(one_rank_group_in_graphs, 1, backend="nccl", timeout=300)
    ours, alone = got["tokens"]
    assert ours == alone and got["fused"] and min(got["replays"]) >= 1, got
