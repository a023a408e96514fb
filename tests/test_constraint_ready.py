"""A request whose constraint is not ready (a grammar compiling on a background thread, as
beside a GPU) is prefilled but for its prompt's last token (whose logits need the first
mask) while the others run, then sits out the steps until ready (vLLM holds such a
request in its queue, its prefill too); where nothing else can run the engine waits for
it. Its tokens are those it gets with its constraint ready from the start."""
import threading

import pytest
import torch

from infergraft import core
from infergraft.core import hookimpl
from infergraft.core.logits_processor import ConstraintState, LogitsProcessor, pack_bitmask
from infergraft.core.request import Status
from infergraft.core.runner import constrained_steps
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

VOCAB = 260
GATE = threading.Event()  # set: the "compilation" is done


class Gated(LogitsProcessor):
    """Only even token ids; ready once ``GATE`` is set (``arg`` "open": always ready)."""
    name = "gated-even"

    def start(self, arg, vocab):
        allowed = torch.zeros(vocab.size, dtype=torch.bool)
        allowed[::2] = True
        return GatedState(pack_bitmask(allowed), arg == "open")


class GatedState(ConstraintState):
    def __init__(self, row, always):
        self.row, self.always, self.waited = row, always, 0

    def ready(self):
        return self.always or GATE.is_set()

    def wait(self):
        self.waited += 1
        assert GATE.wait(10), "the gate never opened"

    def fill_bitmask(self, bitmask, row):
        assert self.ready(), "a mask was asked for before the state was ready"
        bitmask[row] = self.row


class Plugin:
    @hookimpl
    def infergraft_register_logits_processors(self, register):
        register(Gated())


def _model():
    return random_model(tiny_llama_config(vocab_size=VOCAB, eos_token_id=257), seed=5, scale=5.0)


@pytest.fixture(scope="module")
def engine():
    return core.build(_model(), plugins=[Plugin()], max_seq_len=64, max_batch_size=4)


@pytest.fixture(autouse=True)
def closed_gate():
    GATE.clear()
    yield
    GATE.set()


def _params(arg, n=8):
    return core.SamplingParams(max_new_tokens=n, ignore_eos=True,
                               logits_processors={"gated-even": arg})


def test_a_request_not_ready_waits_while_the_others_run(engine):
    a, b = random_prompt(5, 256, 1), random_prompt(6, 256, 2)
    want = engine.generate(b, max_new_tokens=8, ignore_eos=True,
                           logits_processors={"gated-even": "open"})[0].token_ids
    free_alone = engine.generate(a, max_new_tokens=8, ignore_eos=True)[0].token_ids
    held = engine.add_request(b, _params("gated"))
    free = engine.add_request(a, core.SamplingParams(max_new_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    # the unconstrained request ran past the held one, which was prefilled but for its
    # last token and then sat out the steps
    assert len(free.output_ids) >= 2 and held.status is Status.RUNNING
    assert held.output_ids == [] and held.num_computed_tokens == len(b) - 1
    GATE.set()
    while engine.has_unfinished():
        engine.step()
    assert held.output_ids == want and all(t % 2 == 0 for t in held.output_ids)
    assert free.output_ids == free_alone
    assert held.constraints[0].waited == 0  # another request was running throughout


def test_with_nothing_else_to_run_the_engine_waits_for_it(engine):
    prompt = random_prompt(7, 256, 3)
    want = engine.generate(prompt, max_new_tokens=6, ignore_eos=True,
                           logits_processors={"gated-even": "open"})[0].token_ids
    held = engine.add_request(prompt, _params("gated", 6))
    threading.Timer(0.2, GATE.set).start()
    while engine.has_unfinished():
        engine.step()
    assert held.constraints[0].waited == 1 and held.output_ids == want


def _held_beside_a_free_request(plugins, steps, **options):
    """An engine of its own; a held request (a 9-token prompt, 5 new tokens) and an
    unconstrained one run ``steps`` steps. Returns (engine, held, its tokens when ready
    from the start)."""
    eng = core.build(_model(), plugins=[*plugins, Plugin()], max_seq_len=64, max_batch_size=4,
                     **options)
    prompt = random_prompt(9, 256, 4)
    want = eng.generate(prompt, max_new_tokens=5, ignore_eos=True,
                        logits_processors={"gated-even": "open"})[0].token_ids
    held = eng.add_request(prompt, _params("gated", 5))
    free = eng.add_request(random_prompt(3, 256, 5),
                           core.SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(steps):
        eng.step()
    assert free.output_ids  # the other request ran meanwhile
    return eng, held, want


def _open_and_finish(eng):
    GATE.set()
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("budget", [4, 64], ids=["chunked", "whole"])
@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
def test_a_held_prompt_is_prefilled_in_chunks_but_for_its_last_token(budget, async_steps,
                                                                     monkeypatch):
    # asynchronous steps wait for masks only where a constrained row gets a token: not
    # for the held prompt's chunks, which get none
    masked, masks = [], constrained_steps.masks
    monkeypatch.setattr(constrained_steps, "masks",
                        lambda e, launched: masked.append(launched) or masks(e, launched))
    eng, held, want = _held_beside_a_free_request([], 8, max_num_batched_tokens=budget,
                                                  async_steps=async_steps)
    assert eng.async_steps.enabled is async_steps
    assert held.num_computed_tokens == len(held.prompt_ids) - 1 and held.output_ids == []
    assert not any(held in launched.step.seqs for launched in masked)
    _open_and_finish(eng)
    assert held.output_ids == want and held.constraints[0].waited == 0
    assert any(held in launched.step.seqs for launched in masked) is async_steps


def test_a_held_prompt_cached_but_for_its_last_token_waits_in_the_queue():
    # blocks of 4: the first generate cached the 9-token prompt's first 8
    eng, held, want = _held_beside_a_free_request(["paged"], 3, block_size=4)
    assert held.status is Status.WAITING and held.num_computed_tokens == 0
    _open_and_finish(eng)
    assert held.output_ids == want


def test_the_grammar_state_is_ready_once_compiled():
    """The built-in grammar processor on a vocabulary whose device is not the CPU (where
    it compiles on a background thread): ``wait`` returns once compiled, then ``ready``."""
    pytest.importorskip("xgrammar")
    from infergraft.core.logits_processor import Vocabulary
    from infergraft.core.structured.constraint import Constraint
    from infergraft.core.structured.grammar import GrammarProcessor
    from infergraft.core.testing.models import byte_tokenizer

    vocab = Vocabulary(VOCAB, frozenset({257}), byte_tokenizer(), "cuda")
    state = GrammarProcessor().start(Constraint("regex", "[0-9]{3}"), vocab)
    state.wait()
    assert state.ready()
