"""core/tools/step_profile.py: a window of engine steps under the profiler, its kernels
put in parts, the parts set against floors counted from what the steps fed."""
import pytest
import torch

from infergraft.core.request import SamplingParams
from infergraft.core.tools import step_profile
from infergraft.core.tools.bench_cli import load_models
from infergraft.core.tools.serve_workload import make_requests
from infergraft.core.tools.throughput_report import workload_flops


@pytest.mark.parametrize("name, part", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_TNT", "gemm"),
    ("_int4_mma_kernel", "gemm"),
    ("_varlen_attention_kernel", "attention"),
    ("flash_fwd_splitkv_kernel", "attention"),  # attention before its GEMM tiles
    ("_rms_norm_fused_kernel", "norm"),
    ("_rotary_kernel", "rotary"),
    ("_silu_mul_kernel", "activation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CopyFunctor>", "copy"),
    ("_greedy_argmax_kernel", "sampling"),
    ("aten::add", "other")])
def test_each_kernel_falls_in_its_part(name, part):
    assert step_profile.part_of(name) == part


def test_a_window_over_the_whole_run_counts_the_workloads_flops():
    """Every step profiled: the tokens the steps fed and the rows they sampled give the
    FLOPs the throughput bench's floor counts from the requests alone."""
    _, engine = load_models("tiny", torch.device("cpu"), torch.float32, 6, 64,
                            max_num_batched_tokens=48)  # prompts split over steps
    requests = make_requests("uniform", 6, 24, 6, engine.spec.vocab_size, seed=5)
    for r in requests:
        engine.add_request(list(r.prompt), SamplingParams(max_new_tokens=r.output_len,
                                                          ignore_eos=True))
    profiled = step_profile.profile_steps(engine, steps=10_000)
    assert not engine.has_unfinished()
    assert sum(n for _, n in profiled["fed"]) == sum(len(r.prompt) + r.output_len - 1
                                                     for r in requests)
    assert profiled["sampled"] == sum(r.output_len for r in requests)
    want = workload_flops(engine.spec, requests)
    got = step_profile.window_flops(engine.spec, profiled["fed"], profiled["sampled"])
    assert got == {"gemm": want["matmul"] + want["lm_head"], "attention": want["attention"]}
    assert profiled["parts_s"]["gemm"] > 0 and profiled["parts_s"]["attention"] > 0
    text = step_profile.report(profiled, engine.spec, rate=1e11)
    assert f"{profiled['steps']} steps, " in text and "\ngemm " in text
