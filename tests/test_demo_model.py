"""The real demo model (SmolLM2-135M-Instruct): parity with HF and the CLI answer."""
import pytest
import torch

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.loading.demo import ensure_demo_model
from infergraft.core.testing.parity import assert_greedy_match

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def demo():
    path = ensure_demo_model("smollm2-135m")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, core.build("smollm2-135m", max_seq_len=512, max_batch_size=4)


def _chat(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=False)


def test_spec_is_smollm2(demo):
    _, engine = demo
    s = engine.spec
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (30, 9, 3, 64)
    assert s.tie_embeddings and engine.tokenizer is not None


def test_32_greedy_tokens_match_hf(demo):
    hf, engine = demo
    for text in ("Write a haiku about the sea.", "List three prime numbers and explain why."):
        ids = engine.tokenizer.encode(_chat(engine, text))
        out = assert_greedy_match(engine, hf, ids, max_new_tokens=32)
        assert len(out) == 32  # the answers are longer than 32 tokens: the full window is compared


def test_answers_paris_and_streams_the_same_text(demo):
    _, engine = demo
    prompt = _chat(engine, QUESTION)
    c = engine.generate(prompt, max_new_tokens=32)[0]
    assert c.text == "The capital of France is Paris." and c.finish_reason == "stop"
    assert "".join(engine.stream(prompt, max_new_tokens=32)) == c.text


def test_stop_string_trims_text(demo):
    _, engine = demo
    c = engine.generate(_chat(engine, QUESTION), max_new_tokens=32, stop=" is")[0]
    assert c.text == "The capital of France" and c.finish_reason == "stop"
    deltas = list(engine.stream(_chat(engine, QUESTION), max_new_tokens=32, stop=[" is"]))
    assert "".join(deltas) == "The capital of France"


def test_cli_generate_prints_paris(capsys):
    assert main(["generate", QUESTION, "--max-new-tokens", "32"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_reports_bad_input_cleanly(capsys):
    assert main(["generate", QUESTION, "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
