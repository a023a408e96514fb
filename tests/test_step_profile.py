"""core/tools/step_profile.py: a window of engine steps under the profiler, its kernels
put in parts, the parts set against floors counted from what the steps fed
(step_floors.py: attention span by span, the longer of its FLOPs and its K/V bytes)."""
import attrs
import pytest
import torch

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.tools import step_profile
from infergraft.core.tools.bench_cli import load_models
from infergraft.core.tools.serve_workload import make_requests
from infergraft.core.tools.shapes import shape_config
from infergraft.core.tools.step_census import StepRecord
from infergraft.core.tools.step_floors import StepFloors
from infergraft.core.tools.throughput_report import workload_flops
from infergraft.core.units import kv_bytes_per_token

MATMUL, COPY = 700e12, 3e12  # FLOP/s, bytes/s: an H100's order
# LLaMA-3-8B: 32 layers, 8 K/V heads of 128, bf16: K and V of a token, every layer
KV_TOKEN = 2 * 32 * 8 * 128 * 2
LAYER_WEIGHTS = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336


def _llama3_floors(**spec_changes) -> StepFloors:
    spec = core.get_plugin_manager().policies().get("llama").describe(shape_config("llama3-8b"))
    spec = attrs.evolve(spec, **spec_changes)
    return StepFloors(spec, MATMUL, COPY, spec.param_count * 2,
                      kv_bytes_per_token(spec, torch.bfloat16))


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
    text = step_profile.report(profiled, StepFloors.of(engine, 1e11, 1e10))
    assert f"{profiled['steps']} steps, " in text and "\ngemm " in text


def test_census_runs_the_whole_workload_and_prints_its_table(capsys):
    """--census: no window, no profiler; 4 prompts of 16 in one 64-token step, then three
    decode steps of four rows."""
    assert step_profile.main(["--model", "tiny", "--device", "cpu", "--num-prompts", "4",
                              "--prompt-len", "16", "--output-len", "4",
                              "--max-num-batched-tokens", "64", "--census"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {x.split()[0]: x.split() for x in lines if x.split()[:1] in (
        ["prefill-only"], ["mixed"], ["decode-only"], ["run"])}
    assert [rows[k][1] for k in ("prefill-only", "mixed", "decode-only", "run")] == \
        ["1", "0", "3", "4"]
    assert rows["prefill-only"][6:8] == ["64", "0"] and rows["decode-only"][6:8] == ["0", "12"]
    assert rows["run"][3] == "100.0%"


# 2) The floors (step_floors.py)
def test_a_decoding_rows_attention_floor_is_its_kv_bytes_not_its_flops():
    """256 rows at 2048 keys each, one query each: 32 GiB of K/V read for 0.27 TFLOP."""
    floors = _llama3_floors()
    spans = [(2047, 1)] * 256
    assert KV_TOKEN == floors.kv_bytes_per_token
    read = 256 * 2048 * KV_TOKEN / COPY
    flops = 256 * 4 * 4096 * 32 * 2048 / MATMUL
    assert floors.attention_bounds_s(spans) == pytest.approx((flops, read))
    assert floors.attention_s(spans) == pytest.approx(read)
    assert read > 50 * flops


def test_a_prompt_chunks_attention_floor_is_its_flops_and_a_mixed_step_adds_span_by_span():
    floors = _llama3_floors()
    chunk = [(0, 2048)]  # the causal triangle: 2048 x 2049 / 2 keys a layer
    flops = 4 * 4096 * 32 * (2048 * 2049 // 2) / MATMUL
    assert floors.attention_s(chunk) == pytest.approx(flops)
    assert flops > 10 * 2048 * KV_TOKEN / COPY
    # 255 decoding rows beside the chunk: each part at its own bound, summed; a bound over
    # the step's totals would say less (the decode rows' FLOPs hide under the chunk's)
    decode = [(2047, 1)] * 255
    both = floors.attention_s(chunk + decode)
    assert both == pytest.approx(flops + 255 * 2048 * KV_TOKEN / COPY)
    assert both > 1.05 * max(floors.attention_bounds_s(chunk + decode))


def test_a_sliding_window_bounds_the_keys_a_span_reads():
    floors = _llama3_floors(sliding_window=512)
    # a decoding row: its last 512 keys; a 100-token chunk at 1000: 512 + 99 of them
    assert floors.attention_bounds_s([(2047, 1)])[1] == pytest.approx(512 * KV_TOKEN / COPY)
    assert floors.attention_bounds_s([(1000, 100)])[1] == pytest.approx(611 * KV_TOKEN / COPY)


def test_a_few_rows_gemms_are_bound_by_reading_the_weights_a_full_step_by_its_flops():
    floors = _llama3_floors()
    assert floors.gemm_s(tokens=4, sampled=4, rows=4) == pytest.approx(
        floors.weight_bytes / COPY)
    big = (2 * 32 * LAYER_WEIGHTS * 2048 + 2 * 4096 * 128256 * 200) / MATMUL
    assert floors.gemm_s(tokens=2048, sampled=200, rows=256) == pytest.approx(big)
    assert big > floors.weight_bytes / COPY


def test_the_reports_attention_floor_of_a_decode_heavy_window_is_its_byte_floor():
    """A window of one decode step, 256 rows at context 2048: the report's attention floor
    is the K/V read at the copy rate, not the FLOPs at the matmul rate (43x less)."""
    floors = _llama3_floors()
    step = StepRecord([(2047, 1)] * 256, 0, 0, 256)
    profiled = {"wall_s": 0.040, "steps": 1, "parts_s": {"gemm": 0.012, "attention": 0.025},
                "kernels_s": {}, "records": [step], "fed": step.spans, "sampled": 256}
    line = next(x for x in step_profile.report(profiled, floors).splitlines()
                if x.startswith("attention "))
    read_ms = 256 * 2048 * KV_TOKEN / COPY * 1e3
    assert line.split()[1:] == ["25.00", "62.5%", f"{read_ms:.2f}", f"{read_ms / 25:.1%}"]
