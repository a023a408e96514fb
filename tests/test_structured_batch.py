"""A step's grammar masks filled together (``core/structured/batch.py``, through
``RowConstraints.mask``): for random schemas and regexes, every row's allowed tokens are
exactly those of the row filled on its own by an xgrammar matcher over the logits' whole
width (the path before batching), step after step, on the tiny ASCII tokenizer and on the
demo model's 49k-token one; a row that fails leaves the others as they are; on a GPU,
masking does not wait for the device."""
import json

import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from infergraft import core
from infergraft.core.logits_processor import Vocabulary, bitmask_words
from infergraft.core.runner.constraints import RowConstraints
from infergraft.core.structured import Constraint
from infergraft.core.structured.schema_check import schema_grammar
from infergraft.core.testing.strategies import kit_settings
from structured_support import EOS, ascii_tokenizer, regexes, schemas

SETTINGS = kit_settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
WIDE = 300  # the logits' width: past the ASCII tokenizer's 128 ids and its stop token 257


class Request:
    """What ``RowConstraints`` reads of a request."""

    def __init__(self, **params):
        self.params = core.SamplingParams(**params)
        self.constraints, self.error, self.output_ids = None, None, []


def reference_matcher(tok, stop: int, width: int, constraint: Constraint):
    """The matcher of the path before batching: xgrammar over the logits' whole width."""
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=width, stop_token_ids=[stop])
    compiler = xgr.GrammarCompiler(info)
    if constraint.kind == "json_schema":
        return xgr.GrammarMatcher(compiler.compile_grammar(schema_grammar(xgr, constraint.text)))
    return xgr.GrammarMatcher(compiler.compile_regex(constraint.text))


def reference_allowed(matcher, width: int) -> torch.Tensor:
    """[width] bool: the tokens ``matcher`` allows, its row filled on its own."""
    row = torch.full((1, bitmask_words(width)), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(row, 0)
    bits = (row[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:width].bool()


def walk(tok, stop: int, width: int, params: list[dict], seed: int, steps: int,
         tokenizer_words: int) -> int:
    """Walk ``params``' requests together, a random allowed token a step each, comparing
    every mask with the reference's; returns the steps walked."""
    rows = RowConstraints(Vocabulary(width, frozenset({stop}), tok, "cpu"), "cpu")
    launches = []
    op = rows.op
    rows._op = lambda logits, bitmask, index: (launches.append(bitmask.shape),
                                              op(logits, bitmask, index))
    reqs = [Request(**p) for p in params]
    for r in reqs:
        rows.start(r)
    refs = [reference_matcher(tok, stop, width, r.params.constraint) for r in reqs]
    gen = torch.Generator().manual_seed(seed)
    live = list(range(len(reqs)))
    for step in range(steps):
        if not live:
            return step
        launches.clear()
        logits = torch.zeros(len(live), width)
        assert rows.mask(logits, [reqs[i] for i in live]) == []
        # one launch for the step's rows, its bitmask as wide as the tokenizer
        assert launches == [(len(live), tokenizer_words)]
        for row, i in enumerate(list(live)):
            allowed = logits[row] > float("-inf")
            assert torch.equal(allowed, reference_allowed(refs[i], width)), (step, i)
            choice = allowed.nonzero().flatten()
            token = choice[torch.randint(len(choice), (1,), generator=gen)].item()
            assert refs[i].accept_token(token)
            reqs[i].output_ids.append(token)
            reason = rows.advance(reqs[i], token)
            if token == stop or reason == "stop":
                live.remove(i)
    return steps


@SETTINGS
@given(st.lists(st.one_of(schemas().map(lambda s: {"json_schema": s}),
                          regexes().map(lambda r: {"regex": r})), min_size=1, max_size=4),
       st.integers(0, 2 ** 16))
def test_batched_masks_are_the_rows_own_on_random_constraints(params, seed):
    # the tokenizer's ids and its stop token (257): 258 tokens, 9 words; the last word's
    # bits past 258 must be cleared, or tokens 258 and 259 of the 300 would be allowed
    walk(ascii_tokenizer(), EOS, WIDE, params, seed, steps=40, tokenizer_words=9)


def test_batched_masks_on_the_demo_tokenizer():
    from transformers import AutoTokenizer

    from infergraft.core.loading.demo import ensure_demo_model

    tok = AutoTokenizer.from_pretrained(ensure_demo_model("smollm2-135m", quiet=True))
    strings = {"type": "array", "minItems": 2, "items": {"type": "string", "maxLength": 12}}
    params = [{"json_schema": {"type": "object", "required": ["notes"],
                               "properties": {"notes": strings}}},
              {"json_schema": {"type": "object", "required": ["n", "ok"], "properties": {
                  "n": {"type": "integer", "minimum": -5, "maximum": 999},
                  "ok": {"type": "boolean"}}}},
              {"regex": r"[a-z]{2,6}-\d{1,3}( [A-Z]+)?"}]
    # logits padded past the 49,152-token vocabulary, as a model's often are
    walk(tok, tok.eos_token_id, len(tok) + 100, params, seed=1, steps=30,
         tokenizer_words=bitmask_words(len(tok)))


def test_a_failing_row_leaves_the_others_masked():
    tok = ascii_tokenizer()
    rows = RowConstraints(Vocabulary(WIDE, frozenset({EOS}), tok, "cpu"), "cpu")
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "boolean"}}}
    good = Request(json_schema=schema)
    # a constraint that was never checked, whose compilation fails
    bad = Request(logits_processors={"grammar": Constraint("json_schema", "{not json")})
    for r in (good, bad):
        rows.start(r)
    logits = torch.zeros(3, WIDE)
    plain = Request()  # unconstrained: its row untouched
    assert rows.mask(logits, [bad, plain, good]) == [0]
    assert "failed to compile" in bad.error and good.error is None
    assert torch.equal(logits[1], torch.zeros(WIDE))
    ref = reference_matcher(tok, EOS, WIDE, Constraint("json_schema", json.dumps(schema)))
    assert torch.equal(logits[2] > float("-inf"), reference_allowed(ref, WIDE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masking_does_not_wait_for_the_device():
    tok = ascii_tokenizer()
    rows = RowConstraints(Vocabulary(WIDE, frozenset({EOS}), tok, "cuda"), "cuda")
    reqs = [Request(regex="[a-c]{3}") for _ in range(4)]
    for r in reqs:
        rows.start(r)
        _ = r.constraints[0].matcher  # (compiled in the background)
    logits = torch.zeros(4, WIDE, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # the step's forward pass, still running
    assert rows.mask(logits, reqs) == []
    assert not torch.cuda.current_stream().query(), "mask waited for the device"
    torch.cuda.synchronize()
    assert (logits[:, ord("a"):ord("c") + 1] == 0).all() and (logits[:, ord("d")] < 0).all()
