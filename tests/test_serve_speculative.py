"""``infergraft serve --speculative``: a request opts out with ``speculative: false``
(the openai client's ``extra_body``) and gets the same greedy text as one that speculates;
/metrics counts the drafts (vLLM's spec_decode names) only for the one that did; a bad
value is a 400 naming the parameter."""
import openai
import pytest
from serve_support import serving, tiny_model

# token ids that repeat: the n-gram lookup finds what follows
PROMPT = [100 + (7 * i) % 23 for i in range(30)] * 2
COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tiny_model(tmp_path_factory), "--speculative", '{"method": "ngram", "k": 3}',
                 "--max-seq-len", "256", "--max-batch-size", "4") as s:
        yield s


def spec_metrics(server) -> dict:
    found = {name.removeprefix("infergraft_"): v for (name, _), v in server.metrics().items()}
    return {k: found[k] for k in (*COUNTERS, "spec_decode_draft_acceptance_rate")}


def test_opting_out_changes_no_token_and_counts_no_draft(server):
    client = server.client()
    ask = dict(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
               extra_body={"ignore_eos": True})
    off = client.completions.create(**dict(ask, extra_body={"ignore_eos": True,
                                                            "speculative": False}))
    assert all(v == 0 for v in spec_metrics(server).values())
    on = client.completions.create(**ask)
    assert on.choices[0].text == off.choices[0].text and off.usage.completion_tokens == 24
    got = spec_metrics(server)
    assert got["spec_decode_num_draft_tokens_total"] > 0, got
    assert 0 <= got["spec_decode_draft_acceptance_rate"] <= 1
    assert got["spec_decode_num_accepted_tokens_total"] == pytest.approx(
        got["spec_decode_draft_acceptance_rate"] * got["spec_decode_num_draft_tokens_total"])


def test_a_bad_value_names_the_parameter(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=server.model, prompt="hi", max_tokens=2,
                                           extra_body={"speculative": "yes"})
    assert e.value.body["param"] == "speculative"
    assert "speculative must be true or false" in e.value.body["message"]
