"""The ``speculative`` setting in its three spellings (core/speculative/config.py): build's
argument, the config file's key, ``--speculative`` on generate and serve; every bad value
refused before any weight loads, naming the key, the value and what is accepted; the
n-gram lookup itself against a plain search; the per-request proposal length."""
import json

import pytest
from hypothesis import given, strategies as st

from infergraft import core
from infergraft.core import cli
from infergraft.core.errors import ConfigError, PlanError
from infergraft.core.speculative.adaptive import MISSES_BEFORE_PAUSE, AdaptiveK
from infergraft.core.speculative.ngram import lookup
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

KW = dict(max_seq_len=64, max_batch_size=2)


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=5, scale=5.0)


@pytest.mark.parametrize("value, match", [
    ({"method": "eagle"}, r"method 'eagle' is not a registered proposer; registered: draft, ngram"),
    ({"k": 4}, "needs a method: one of draft, ngram"),
    ({"method": "ngram", "k": 0}, r"k must be an integer >= 1 \(tokens proposed per step"),
    ({"method": "ngram", "k": True}, "k must be an integer >= 1"),
    ({"method": "ngram", "k": "4"}, "k must be an integer >= 1"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ({"method": "ngram", "kk": 4}, r"unknown key\(s\) \['kk'\]; accepted: method, k, "
                                   r"disable_by_batch_size, ahead, min_n, max_n"),
    ({"method": "ngram", "min_n": 3, "max_n": 2}, "min_n=3 is more than max_n=2"),
    ({"method": "ngram", "max_n": 0}, "max_n must be an integer >= 1"),
    (5, "speculative must be an object"),
])
def test_bad_values_are_refused_before_the_weights_load(value, match, monkeypatch):
    import importlib

    build_module = importlib.import_module("infergraft.core.build")  # (core.build: the function)

    def no_loading(*a, **k):
        raise AssertionError("weights loaded before the setting was checked")
    monkeypatch.setattr(build_module, "resolve_source", no_loading)
    with pytest.raises(PlanError, match=match):
        core.build("unused", **KW, speculative=value)


def test_a_method_name_alone_and_none(hf):
    engine = core.build(hf, **KW, speculative="ngram")
    assert engine.speculation.config.k == 4 and engine.speculation.config.method == "ngram"
    assert core.build(hf, **KW, speculative=None).speculation is None
    assert "spec_decode_num_drafts" not in core.build(hf, **KW).stats()


def test_the_config_files_key(hf, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"speculative": {"method": "ngram", "k": 2, "max_n": 3}}))
    engine = core.build(hf, config=str(path), **KW)
    assert (engine.speculation.config.k, engine.speculation.config.options) == \
        (2, {"min_n": 1, "max_n": 3})
    path.write_text(json.dumps({"speculative": {"method": "ngram", "k": -1}}))
    with pytest.raises(ConfigError, match=r"config key speculative=\{\"method\": \"ngram\", "
                                          r"\"k\": -1\} is not valid: .*k must be"):
        core.build(hf, config=str(path), **KW)


def test_generate_takes_the_flag(capsys, tmp_path):
    from cli_support import tiny_chat_model

    model = str(tiny_chat_model(tmp_path / "tiny"))
    argv = ["generate", "say it again and again", "--model", model, "--max-seq-len", "96",
            "--max-new-tokens", "24", "--raw", "-v"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr()
    assert cli.main([*argv, "--speculative", '{"method": "ngram", "k": 3}']) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out
    assert "tokens per verify step" in spec.err and "of proposed kept" in spec.err, spec.err
    assert cli.main([*argv, "--speculative", '{"method": "nope"}']) == 2
    assert "method 'nope' is not a registered proposer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--speculative", '{"method": "ngram"'])
    assert exit_.value.code == 2 and "--speculative: not JSON" in capsys.readouterr().err


def naive_lookup(tokens, k, min_n, max_n):
    n_tokens = len(tokens)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        suffix = tokens[n_tokens - n:]
        found = [p for p in range(n_tokens - n) if tokens[p:p + n] == suffix]
        if found:
            full = [p for p in found if p + n + k <= n_tokens]
            p = (full or found)[-1]
            return tuple(tokens[p + n:p + n + k])
    return ()


@given(st.lists(st.sampled_from([0, 1, 257, 65536, 2 ** 24 + 1, 49151]), max_size=24),
       st.integers(1, 5), st.integers(1, 3), st.integers(0, 3))
def test_lookup_finds_what_a_plain_search_finds(tokens, k, min_n, extra):
    # ids sharing bytes across token boundaries: a match must be whole tokens
    assert lookup(tokens, k, min_n, min_n + extra) == naive_lookup(tokens, k, min_n, min_n + extra)


def test_lookup_proposes_what_followed_the_latest_occurrence():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == (4, 5, 1)
    assert lookup([9, 1, 7, 8, 1, 7, 6, 5, 4, 1, 7], 2) == (6, 5)  # the latest "1 7"
    assert lookup([1, 2, 3, 4, 5], 3) == ()
    long = random_prompt(4000, 49152, 1)
    assert lookup(long + long[:10], 4) == tuple(long[10:14])


def test_the_proposal_length_follows_acceptance():
    a = AdaptiveK(4)
    a.update(4, 4)
    assert a.take() == 4  # capped at k
    a.update(4, 0)
    assert a.take() == 3  # a draft wholly refused costs a token
    a.update(3, 1)
    assert a.take() == 4  # any kept token earns one back
    for _ in range(MISSES_BEFORE_PAUSE):
        a.update(a.k, 0)
    assert not a.active
    first = [a.take() for _ in range(a.pause)]
    assert first and set(first) == {0} and a.active and a.take() >= 1  # then it tries again
    for _ in range(MISSES_BEFORE_PAUSE):
        a.update(a.k, 0)
    assert a.pause == 2 * len(first)  # a second pause without a kept token: twice as long
    a.pause = 0
    a.update(1, 1)
    assert a.take() == 2 and a.next_pause == len(first)  # kept: it grows, pauses reset


def test_several_ranks_are_refused():
    """tp / pp: each rank would verify on its own; speculation runs on one device."""
    from types import SimpleNamespace

    from infergraft.core.speculative.config import SpeculativeConfig
    from infergraft.core.speculative.speculator import speculation_for

    plan = SimpleNamespace(parallel=SimpleNamespace(world_size=2), cache_backend="paged")
    engine = SimpleNamespace(plan=plan, cache=SimpleNamespace(supports_truncate=True))
    with pytest.raises(PlanError, match="runs on one device; this plan has 2 ranks"):
        speculation_for(engine, SpeculativeConfig("ngram", 4, 32), None, None)
