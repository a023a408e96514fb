"""Speculative decoding on the demo model (real weights): an answer that quotes its prompt
(a paragraph with its spelling fixed) comes out token for token the same with n-gram
drafts as without, in fewer steps than tokens; one engine, the request opting out for the
plain run."""
from infergraft import core
from infergraft.core.request import SamplingParams

TEXT = ("Fix the spelling mistakes in the following text. Reply with the corrected text "
        "only.\n\nText: The comittee met on tuesday to discus the new budjet. After a long "
        "debate, they agreed to fund the libary renovation.")


def test_a_quoting_answer_is_the_same_in_fewer_steps():
    engine = core.build("smollm2-135m", plugins=["paged"], max_seq_len=512, max_batch_size=1,
                        dtype="float32", device="cpu", speculative={"method": "ngram", "k": 4})
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": TEXT}],
                                                  add_generation_prompt=True, tokenize=False)
    runs = {}
    for on in (False, True):
        seq = engine.add_request(prompt, SamplingParams(max_new_tokens=40, speculative=on))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        runs[on] = (seq, steps)
    (plain, plain_steps), (spec, spec_steps) = runs[False], runs[True]
    assert spec.output_ids == plain.output_ids and len(plain.output_ids) > 10
    assert "met on tuesday to discus" in engine.tokenizer.decode(spec.output_ids).lower()  # quoted
    assert spec.metrics.num_accepted_tokens > 0 and spec_steps < plain_steps
    assert plain.metrics.num_drafts == 0
