"""`infergraft bench serve`: the workloads' lengths, the arrival process, a stream's
timings, the summary's percentiles and goodput, bad flags refused before any request
(whole runs against real servers: tests/test_bench_serve_runs.py)."""
import importlib.util
import socket
import statistics

import pytest
from cli_support import assert_flag_refused

from infergraft.core.cli import main as cli_main
from infergraft.core.tools import bench_serve, serve_client
from infergraft.core.tools.serve_workload import (
    FIRST_ID, Record, is_good, make_requests, parse_sse_line, send_times, summarise)

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


# 1) The workloads
def test_fixed_prompts_are_exact_token_ids_clear_of_the_special_ones():
    reqs = make_requests("fixed", 50, 33, 7, vocab_size=100, seed=1)
    assert {len(r.prompt) for r in reqs} == {33} and {r.output_len for r in reqs} == {7}
    ids = [t for r in reqs for t in r.prompt]
    assert min(ids) == FIRST_ID and max(ids) == 99  # the whole range, nothing outside it
    assert make_requests("fixed", 50, 33, 7, 100, seed=1) == reqs
    assert make_requests("fixed", 50, 33, 7, 100, seed=2) != reqs


def test_uniform_lengths_keep_the_mean_and_spread_to_a_quarter_and_seven_quarters():
    reqs = make_requests("uniform", 4000, 200, 80, vocab_size=1000)
    prompts, outputs = [len(r.prompt) for r in reqs], [r.output_len for r in reqs]
    assert (min(prompts), max(prompts)) == (50, 350) and (min(outputs), max(outputs)) == (20, 140)
    assert statistics.mean(prompts) == pytest.approx(200, rel=0.02)
    assert statistics.mean(outputs) == pytest.approx(80, rel=0.02)


def test_sharegpt_like_lengths_have_the_asked_means_a_long_tail_and_clipped_bounds():
    reqs = make_requests("sharegpt-like", 20000, 161, 338, vocab_size=1000)
    for lens, mean in (([len(r.prompt) for r in reqs], 161), ([r.output_len for r in reqs], 338)):
        assert statistics.mean(lens) == pytest.approx(mean, rel=0.03)
        assert min(lens) >= 4 and max(lens) <= 4 * mean and max(lens) > 3 * mean
        assert statistics.median(lens) < 0.85 * mean  # skewed: most are short
        assert statistics.pstdev(lens) > 0.6 * mean
    assert max(len(r.prompt) + r.output_len for r in reqs) <= 2048


def test_prefix_prompts_share_one_system_prompt_then_differ():
    reqs = make_requests("prefix", 200, 1024, 16, vocab_size=5000)
    shared = reqs[0].prompt[:1024]
    assert all(r.prompt[:1024] == shared for r in reqs)
    questions = [r.prompt[1024:] for r in reqs]
    assert min(map(len, questions)) >= 64 and max(map(len, questions)) <= 256
    assert max(map(len, questions)) - min(map(len, questions)) > 150  # spread over the range
    assert len(set(questions)) == 200 and all(q[:4] != shared[:4] for q in questions)


# 2) The arrival process
def test_arrivals_have_mean_gap_one_over_the_rate_and_burstiness_sets_the_variance():
    for rate, b in ((4.0, 1.0), (4.0, 0.25), (50.0, 4.0)):
        t = send_times(20000, rate, b, seed=3)
        assert t[0] == 0.0 and t == sorted(t)
        gaps = [y - x for x, y in zip(t, t[1:])]
        assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.04)
        # gamma(shape b, mean 1/rate): variance 1/(rate^2 b)
        assert statistics.pvariance(gaps) == pytest.approx(1 / (rate ** 2 * b), rel=0.12)
    poisson = statistics.pvariance(send_times(5000, 2.0, 1.0))
    assert statistics.pvariance(send_times(5000, 2.0, 0.5)) != poisson
    assert send_times(7, float("inf"), 0.5) == [0.0] * 7
    assert send_times(9, 2.0, seed=5) == send_times(9, 2.0, seed=5)


# 3) One stream's timings, the summary and goodput
def test_sse_lines_and_a_stream_read_into_ttft_itl_and_tokens():
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line('data:{"a": 1}') == {"a": 1}
    assert parse_sse_line("") is None and parse_sse_line(": ping") is None
    assert parse_sse_line("event: x") is None
    with pytest.raises(ValueError, match="not JSON"):
        parse_sse_line("data: {oops")
    rec = Record(prompt_len=5, output_len=4)
    for t, text in ((0.10, "a"), (0.12, ""), (0.15, "bc"), (0.30, "d")):
        rec.on_event({"choices": [{"index": 0, "text": text}]}, t)
    assert rec.ttft == 0.10 and rec.itl == pytest.approx([0.05, 0.15]) and rec.chunks == 3
    rec.finish(0.31)
    assert rec.ok and rec.output_tokens == 3  # no usage: one a chunk with text
    assert rec.tpot == pytest.approx((0.31 - 0.10) / 2)
    rec.on_event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}, 0.31)
    assert rec.output_tokens == 4 and rec.tpot == pytest.approx(0.21 / 3)  # the server's count
    chat = Record(1, 1)
    chat.on_event({"choices": [{"delta": {"role": "assistant"}}]}, 0.01)  # no content yet
    chat.on_event({"choices": [{"delta": {"content": "hi"}}]}, 0.02)
    assert chat.ttft == 0.02
    bad = Record(1, 1)
    bad.on_event({"error": {"message": "boom", "type": "x"}}, 0.1)
    bad.finish(0.2)
    assert not bad.ok and bad.error == "boom"
    empty = Record(1, 1)
    empty.finish(0.2)
    assert not empty.ok and "without any text" in empty.error


def _record(ttft, e2el, tokens, error=None):
    r = Record(prompt_len=10, output_len=tokens, ttft=ttft, e2el=e2el, chunks=tokens,
               error=error)
    if error is None:
        r.itl = [(e2el - ttft) / max(1, tokens - 1)] * (tokens - 1)
    return r


def test_summary_percentiles_are_nearest_rank_and_ordered():
    # TTFTs 1..101 ms: nearest rank is the ceil(q n / 100)-th, 51, 91 and 100 (101 values,
    # so that q n / 100 is never a whole number, where core.metrics rounds half to even)
    recs = [_record(i / 1000, i / 1000 + 0.5, 11) for i in range(1, 102)]
    recs.append(_record(None, None, 0, error="HTTP 503: queue full"))
    s = summarise(recs, duration=2.0)
    assert (s["completed"], s["failed"], s["first_error"]) == (101, 1, "HTTP 503: queue full")
    assert (s["ttft_ms"]["p50"], s["ttft_ms"]["p90"], s["ttft_ms"]["p99"]) == \
        pytest.approx((51, 91, 100))
    assert s["ttft_ms"]["mean"] == pytest.approx(51)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert s["tpot_ms"]["p50"] == pytest.approx(50.0)  # 500 ms over 10 tokens after the first
    assert s["request_throughput"] == 50.5 and s["output_throughput"] == 101 * 11 / 2.0
    assert s["total_token_throughput"] == (1010 + 1111) / 2.0
    assert s["goodput"] is None
    none = summarise([_record(None, None, 0, error="x")], 1.0)
    assert none["completed"] == 0 and none["ttft_ms"]["p99"] is None


def test_goodput_counts_requests_meeting_every_slo():
    recs = [_record(0.05, 0.50, 10),   # TPOT 50 ms
            _record(0.30, 0.40, 11),   # TTFT 300 ms: misses ttft:200
            _record(0.10, 2.10, 11),   # TPOT 200 ms, E2EL 2100 ms
            _record(0.10, 0.10, 1),    # one token: no TPOT, meets any TPOT SLO
            _record(None, None, 0, error="HTTP 400")]
    slos = {"ttft": 200, "tpot": 60}
    assert [is_good(r, slos) for r in recs] == [True, False, False, True, False]
    s = summarise(recs, duration=4.0, slos=slos)
    assert s["good_requests"] == 2 and s["goodput"] == 0.5
    assert summarise(recs, 4.0, {"e2el": 1000})["good_requests"] == 3
    assert summarise(recs, 4.0, {"ttft": 200, "tpot": 60, "e2el": 100})["good_requests"] == 1


# 4) Bad flags
BAD_FLAGS = [  # (flags over a good run, what the message must say)
    (["--base-url", "localhost:8000"], "http(s) URL"),
    (["--dataset", "alpaca"], "sharegpt-like"),
    (["--num-prompts", "0"], "positive integer"),
    (["--request-rate", "0"], "positive number of requests a second, or inf"),
    (["--request-rate", "fast"], "or inf"),
    (["--burstiness", "-1"], "positive number"),
    (["--max-concurrency", "0"], "positive integer"),
    (["--goodput", "ttft:500", "latency:3"], "ttft, tpot, e2el"),
    (["--goodput", "tpot:0"], "positive number of milliseconds"),
    (["--goodput", "ttft:1", "ttft:2"], "at most once"),
    (["--sweep-rates", "1,2,2"], "distinct"),
    (["--sweep-rates", "1,-4,inf"], "comma list"),
    (["--sweep-rates", "1,2", "--request-rate", "3"], "give one"),
    (["--prompt-len", "0"], "positive integer"),
    (["--output-len", "x"], "positive integer"),
    (["--vocab-size", "10"], "special ids"),
    (["--seed", "a"], "invalid int"),
    (["--out", "/dev/null/x"], "not a writable directory"),
]


@pytest.mark.parametrize("entry", ["bench_serve", "infergraft"])
@pytest.mark.parametrize("flags, says", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_before_any_request(flags, says, entry, tmp_path, capsys,
                                                  monkeypatch):
    def never(*args, **kw):
        pytest.fail("a request was sent for a bad flag")
    monkeypatch.setattr(bench_serve, "benchmark", never)
    monkeypatch.setattr(serve_client, "stream_request", never)
    argv = ["--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
            "--out", str(tmp_path / "o")] + flags
    call = bench_serve.main if entry == "bench_serve" else \
        lambda a: cli_main(["bench", "serve"] + a)
    assert_flag_refused(call, argv, flags[0], says, capsys, tmp_path / "o")


def test_an_unreachable_server_is_one_line_not_a_traceback(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model",
                     "m", "--num-prompts", "1", "--out", str(tmp_path)]) == 2
    assert "warm-up request" in capsys.readouterr().err


# 5) Whole runs over real HTTP
def test_percentiles_are_nearest_rank_on_whole_ranks():
    from infergraft.core.metrics import percentiles

    ten = percentiles([float(v) for v in range(1, 11)], qs=(50, 90, 99))
    assert ten == {"p50": 5.0, "p90": 9.0, "p99": 10.0}
    hundred = percentiles([float(v) for v in range(1, 101)], qs=(50, 99, 100))
    assert hundred == {"p50": 50.0, "p99": 99.0, "p100": 100.0}
    assert percentiles([1.0, 2.0], qs=(50,)) == {"p50": 1.0}
