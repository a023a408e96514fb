"""What the speculative suites share: the NaN check both run (CPU, and CUDA's replayed
verify steps), and lone requests run one at a time (the pause tests)."""
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import random_prompt


def lone_requests(engine, vocab: int, n: int = 3, new_tokens: int = 80) -> list:
    """``n`` greedy requests of 20 random prompt tokens, each run alone to its end (the
    look-ahead runs a lone request's steps): their Sequences, in order."""
    seqs = []
    for seed in range(n):
        seqs.append(engine.add_request(random_prompt(20, vocab, 30 + seed),
                                       SamplingParams(max_new_tokens=new_tokens,
                                                      ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()
    return seqs


def assert_a_nan_fails_its_drafted_request_alone(engine, prompts, params, want) -> None:
    """Run ``prompts`` on ``engine`` (speculating) with NaN put in the last row of the first
    drafted request of the first step that verifies two drafts: that request finishes with
    an error naming NaN logits and keeps only the tokens before that step; the other keeps
    ``want``'s tokens; the cache is left consistent."""
    split, sick = engine.speculation.split, []

    def poisoned(step, logits):
        out = split(step, logits)
        drafted = out[2][1]
        if not sick and len(drafted) == 2:  # the first step verifying both
            seq, proposal, row = drafted[0]
            logits[row + len(proposal.tokens)] = float("nan")  # its last row
            sick.append((seq, len(seq.output_ids)))
        return out
    engine.speculation.split = poisoned
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert sick, "no step verified both requests' drafts"
    (bad, held), = sick
    i = seqs.index(bad)
    assert bad.finish_reason == "error" and "NaN logits" in bad.error, bad.error
    assert bad.output_ids == want[i][:held]  # nothing of the sick step kept
    assert seqs[1 - i].output_ids == want[1 - i]
    engine.cache.check_invariants()
