"""Structured output on the real demo model (SmolLM2-135M-Instruct, a 49k-token byte-level
BPE vocabulary, ``slow``): every output under a random JSON schema or regex is accepted by
it, several constraints in one batch, greedy and sampled."""
import pytest
from hypothesis import HealthCheck, assume, given
from hypothesis import strategies as st

from infergraft import core
from infergraft.core.testing.strategies import kit_settings
from structured_support import check_json, check_regex, max_chars, regexes, schemas

pytestmark = pytest.mark.slow
MAX_NEW = 120  # tokens: at least the characters of any output kept (a token is >= 1 char)
SETTINGS = kit_settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
PROMPTS = ["Give the answer as JSON:", "Reply:", "What is the capital of France?"]


@pytest.fixture(scope="module")
def engine():
    return core.build("smollm2-135m", max_seq_len=256, max_batch_size=4, dtype="float32",
                      device="cpu")


def _run(engine, temperature, seed, constraints):
    seqs = [engine.add_request(PROMPTS[i % len(PROMPTS)], core.SamplingParams(
        max_new_tokens=MAX_NEW, temperature=temperature, seed=seed + i, **c))
        for i, c in enumerate(constraints)]
    while engine.has_unfinished():
        engine.step()
    return seqs


@SETTINGS
@given(st.lists(schemas(), min_size=1, max_size=3), st.sampled_from([0.0, 1.0]),
       st.integers(0, 2 ** 16))
def test_demo_outputs_validate_against_their_schemas(engine, batch, temperature, seed):
    assume(all(max_chars(s) <= MAX_NEW for s in batch))
    seqs = _run(engine, temperature, seed, [dict(json_schema=s) for s in batch])
    for seq, schema in zip(seqs, batch):
        assert seq.finish_reason == "stop", (schema, seq.text)
        check_json(seq.text, schema)


@SETTINGS
@given(st.lists(regexes(), min_size=1, max_size=3), st.sampled_from([0.0, 1.0]),
       st.integers(0, 2 ** 16))
def test_demo_outputs_match_their_regexes(engine, batch, temperature, seed):
    seqs = _run(engine, temperature, seed, [dict(regex=r) for r in batch])
    for seq, pattern in zip(seqs, batch):
        # a finished output matches whole, one cut by max_new_tokens starts a match
        check_regex(seq.text, pattern, finished=seq.finish_reason == "stop")
