"""`infergraft bench throughput`'s K/V memory side on the CPU with the tiny random shape:
--compare-options runs the same requests with build options changed, each run set against
the base run; every run of ours records engine.stats() over its requests; an
oversubscribed pool with --check-alone reruns requests alone; bad options are refused
before any model is built. What holds with prefix caching on or off alike."""
import json
from types import SimpleNamespace

import pytest
from cli_support import assert_flag_refused

from infergraft import core
from infergraft.core.cli import main as cli_main
from infergraft.core.testing.models import random_model, tiny_llama_config
from infergraft.core.tools import bench_kv, bench_throughput
from infergraft.core.tools.bench_variants import parse_option_variants, spell
from infergraft.core.tools.serve_workload import make_requests

TINY = ["bench", "throughput", "--model", "tiny", "--device", "cpu", "--no-hf"]
KV_KEYS = {"prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
           "num_preemptions", "num_swapped_out", "num_recomputed", "kv_blocks_total",
           "kv_blocks_free", "num_running", "num_waiting"}


def _run(tmp_path, capsys, *flags) -> tuple[dict, str]:
    rc = cli_main(TINY + [*flags, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads((tmp_path / "throughput.json").read_text()), out


# 1) Whole runs
def test_compare_options_sets_each_variant_against_the_base_run(tmp_path, capsys):
    data, out = _run(tmp_path, capsys, "--plugins", "paged", "--dataset", "prefix",
                     "--prompt-len", "32", "--output-len", "4", "--num-prompts", "4",
                     "--block-size", "8", "--compare-options", "prefix_caching=false")
    for line in ("infergraft+prefix_caching=false", "Output tok/s / infergraft",
                 "P50 TTFT / infergraft", "P99 TTFT / infergraft", "P50 TPOT / infergraft",
                 "Prefix cache hit rate", "Prefix cache hits / queries (tok)",
                 "Preemptions (swapped, recomputed)", "K/V blocks total",
                 "Every output its full length"):
        assert line in out, line
    base, (off,) = data["infergraft"], data["variants"]
    assert data["args"]["compare_options"] == [{"plugins": [], "options":
                                                {"prefix_caching": False}}]
    assert (off["name"], off["plugins"], off["options"], off["build_plugins"]) == (
        "infergraft+prefix_caching=false", [], {"prefix_caching": False}, ["paged"])
    # the base run's --block-size reaches both builds, the variant's option its own only
    assert off["build_options"] == {"block_size": 8, "prefix_caching": False}
    assert base["engine_config"]["plugin_options"] == {"block_size": 8}
    assert off["engine_config"]["plugin_options"] == {"block_size": 8,
                                                      "prefix_caching": False}
    assert off["total_input_tokens"] == base["total_input_tokens"]
    for key, get in (("output_throughput", lambda s: s["output_throughput"]),
                     ("ttft_p50", lambda s: s["ttft_ms"]["p50"]),
                     ("ttft_p99", lambda s: s["ttft_ms"]["p99"]),
                     ("tpot_p50", lambda s: s["tpot_ms"]["p50"])):
        assert off["vs_base"][key] == pytest.approx(get(off) / get(base)), key
    assert off["output_throughput_vs_base"] == off["vs_base"]["output_throughput"]
    for s in (base, off):
        kv = s["kv"]
        assert set(kv) == KV_KEYS and s["full_length"] is True
        # every prompt looked up once (the warm-up's not counted); all blocks free after
        assert kv["prefix_cache_queries"] == s["total_input_tokens"]
        assert kv["prefix_cache_hit_rate"] == kv["prefix_cache_hits"] / kv[
            "prefix_cache_queries"]
        assert kv["kv_blocks_total"] == kv["kv_blocks_free"] > 0
        assert (kv["num_running"], kv["num_waiting"]) == (0, 0)
        # on the CPU every step ran eagerly, and there is no CUDA allocator to count
        assert s["device"] == {"decode_graph_replays": 0, "step_graph_replays": 0,
                               "prefill_graph_replays": 0}
    assert off["kv"]["prefix_cache_hits"] == 0  # caching off: nothing found
    assert 0 <= base["kv"]["prefix_cache_hit_rate"] <= 1


def test_an_oversubscribed_pool_finishes_every_request_with_its_tokens_alone(tmp_path,
                                                                            capsys):
    # 4 requests of 16 + 16 tokens want 4 x 2 blocks of 16 at their longest; 2 hold one
    data, out = _run(tmp_path, capsys, "--plugins", "paged", "--num-prompts", "4",
                     "--prompt-len", "16", "--output-len", "16", "--num-blocks", "2",
                     "--check-alone", "3")
    assert "Tokens as alone (greedy)" in out
    ours = data["infergraft"]
    assert ours["completed"] == 4 and ours["full_length"] is True
    assert ours["total_output_tokens"] == 4 * 16
    kv = ours["kv"]
    assert kv["kv_blocks_total"] == 2 and kv["num_preemptions"] > 0
    assert kv["num_preemptions"] == kv["num_swapped_out"] + kv["num_recomputed"]
    assert ours["alone"] == {"checked": 3, "equal": 3, "requests": [0, 2, 3],
                             "mismatches": []}
    assert data["args"]["num_blocks"] == 2 and data["args"]["check_alone"] == 3


def test_a_row_cache_records_its_stats_without_blocks(tmp_path, capsys):
    data, out = _run(tmp_path, capsys, "--num-prompts", "3", "--prompt-len", "8",
                     "--output-len", "3")
    kv = data["infergraft"]["kv"]
    assert kv["kv_blocks_total"] == 0 and kv["prefix_cache_hits"] == 0
    assert kv["prefix_cache_queries"] == 3 * 8 and "Tokens as alone" not in out


# 2) The pieces
def test_option_variants_parse_as_typed_and_spell_back():
    text = ("prefix_caching=false,int8+num_blocks=512,gpu_memory_utilization=0.5+"
            "preemption=swap+device_memory=80GiB+swap_space=none")
    variants = parse_option_variants(text)
    assert variants == [
        {"plugins": [], "options": {"prefix_caching": False}},
        {"plugins": ["int8"], "options": {"num_blocks": 512}},
        {"plugins": [], "options": {"gpu_memory_utilization": 0.5, "preemption": "swap",
                                    "device_memory": "80GiB", "swap_space": None}}]
    assert ",".join(spell(v["plugins"], v["options"]) for v in variants) == \
        text.replace("none", "null")


def test_run_stats_count_from_the_warm_up_and_the_alone_check_finds_a_difference():
    before = {"prefix_cache_queries": 10, "prefix_cache_hits": 4, "num_preemptions": 1,
              "kv_blocks_total": 8}
    after = dict(before, prefix_cache_queries=30, prefix_cache_hits=14, kv_blocks_free=8)
    got = bench_kv.run_stats(before, after)
    assert (got["prefix_cache_queries"], got["prefix_cache_hits"]) == (20, 10)
    assert got["prefix_cache_hit_rate"] == 0.5 and got["num_preemptions"] == 0
    assert (got["kv_blocks_total"], got["kv_blocks_free"], got["num_swapped_out"]) == (8, 8, 0)
    assert bench_kv.run_stats({}, {})["prefix_cache_hit_rate"] is None

    engine = core.build(random_model(tiny_llama_config(), seed=1, scale=5.0),
                        max_seq_len=32, max_batch_size=2)
    requests = make_requests("fixed", 3, 5, 4, 256, seed=1)
    seqs = []
    for r in requests:  # each request's own tokens, then a changed or cut copy
        seq = engine.add_request(list(r.prompt), core.SamplingParams(
            max_new_tokens=r.output_len, ignore_eos=True))
        while not seq.finished:
            engine.step()
        seqs.append(SimpleNamespace(output_ids=list(seq.output_ids)))
    seqs[1].output_ids[2] += 1
    seqs[2].output_ids.pop()
    got = bench_kv.alone(engine, requests, seqs, 5)
    assert got == {"checked": 3, "equal": 1, "requests": [0, 1, 2],
                   "mismatches": [{"request": 1, "position": 2},
                                  {"request": 2, "position": 3}]}


# 3) Bad flags, refused before any model is built
BAD = [  # (flags over a good tiny run, what the message must say)
    (["--compare-options", "prefix_caching=false"], "unknown option(s) ['prefix_caching']"),
    (["--num-blocks", "8"], "unknown option(s) ['num_blocks']; with plugins (defaults)"),
    (["--compare-options", "nope=1", "--plugins", "paged"], "unknown option(s) ['nope']"),
    (["--compare-options", "dtype=float16"], "dtype is set by --dtype"),
    (["--compare-options", "num_blocks=1+num_blocks=2"], "distinct variants"),
    (["--compare-options", "=1"], "distinct variants"),
    (["--compare-options", "cuda_graphs=false,cuda_graphs=false"], "distinct variants"),
    (["--compare-options", "max_seq_len=10"], "max_seq_len 10 is shorter"),
    (["--compare-options", "bogus+prefix_caching=false"], "unknown plugin 'bogus'"),
    (["--compare-options", "int8+fp8"], "two weights quantizers"),
    (["--compare-options", "cuda_graphs=false", "--max-num-batched-tokens", "8,64"],
     "with the --max-num-batched-tokens sweep 8,64"),
    (["--gpu-memory-utilization", "1.5"], "fraction in (0, 1]"),
    (["--preemption", "never"], "invalid choice"),
    (["--check-alone", "0"], "positive integer"),
    (["--block-size", "x"], "positive integer"),
]


@pytest.mark.parametrize("flags, says", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_a_bad_option_is_refused_before_any_model_is_built(flags, says, tmp_path, capsys,
                                                           monkeypatch):
    def never(*args, **kw):
        pytest.fail("a model was built or timed for a bad flag")
    monkeypatch.setattr(bench_throughput, "load_models", never)
    monkeypatch.setattr(bench_throughput, "matmul_rate", never)
    argv = TINY[2:] + ["--num-prompts", "2", "--prompt-len", "16", "--output-len", "8",
                       "--out", str(tmp_path / "o")] + flags
    assert_flag_refused(bench_throughput.main, argv, flags[0], says, capsys, tmp_path / "o")
