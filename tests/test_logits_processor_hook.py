"""infergraft_register_logits_processors: a third party's processor, registered inline,
named by requests through SamplingParams, applied per row by the sampler; its failures
end its own request only; completion and forced tokens (jump-forward) through the engine."""
import pytest
import torch

from infergraft import core
from infergraft.core import InvalidRequestError, RequestFailedError, hookimpl
from infergraft.core.tools.plugins_cli import plugin_rows
from infergraft.core.logits_processor import ConstraintState, LogitsProcessor, pack_bitmask
from infergraft.core.testing.logits_kit import LogitsProcessorTests
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

VOCAB = 260


class BanTokens(LogitsProcessor):
    """Never these token ids."""
    name = "ban-tokens"

    def start(self, arg, vocab):
        if not isinstance(arg, list) or not all(isinstance(t, int) and 0 <= t < vocab.size
                                                for t in arg):
            raise InvalidRequestError(f"ban-tokens takes a list of token ids in "
                                      f"[0, {vocab.size}), got {arg!r}")
        allowed = torch.ones(vocab.size, dtype=torch.bool)
        allowed[arg] = False
        return Fixed(pack_bitmask(allowed))


class Fixed(ConstraintState):
    def __init__(self, row):
        self.row = row

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = self.row


class Script(LogitsProcessor):
    """Exactly these tokens by masks ("mask") or after the first, forced ("force"); then
    complete, or (a "-then-free" arg) anything the model likes."""
    name = "script"
    tokens = [40, 41, 42, 43, 44]

    def start(self, arg, vocab):
        return ScriptState(self.tokens, vocab.size, arg.startswith("force"),
                           arg.endswith("-then-free"))


class ScriptState(ConstraintState):
    def __init__(self, tokens, size, forced, free_after):
        self.tokens, self.size, self.at = tokens, size, 0
        self.forced, self.free_after = forced, free_after

    def fill_bitmask(self, bitmask, row):
        if self.at < len(self.tokens):
            allowed = torch.zeros(self.size, dtype=torch.bool)
            allowed[self.tokens[self.at]] = True
            bitmask[row] = pack_bitmask(allowed)

    def accept(self, token):
        if self.at == len(self.tokens):
            return True
        ok = token == self.tokens[self.at]
        self.at += ok
        return ok

    def is_complete(self):
        return self.at == len(self.tokens) and not self.free_after

    def take_forced(self, limit):
        if not self.forced:
            return []
        out = self.tokens[self.at:self.at + limit]
        self.at += len(out)
        return out


class Broken(LogitsProcessor):
    """A state whose mask raises (arg "raise") or allows nothing (arg "none")."""
    name = "broken"

    def start(self, arg, vocab):
        state = ConstraintState()
        if arg == "none":
            state.fill_bitmask = lambda bitmask, row: bitmask[row].zero_()
        return state


class TestThirdPartyProcessor:
    class Plugin:
        @hookimpl
        def infergraft_register_logits_processors(self, register):
            for processor in (BanTokens(), Script(), Broken()):
                register(processor)

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls):
        hf = random_model(tiny_llama_config(vocab_size=VOCAB, eos_token_id=257), seed=5,
                          scale=5.0)
        return core.build(hf, plugins=[cls.Plugin()], max_seq_len=64, max_batch_size=4)

    def test_banned_tokens_never_come_and_the_others_are_unchanged(self, engine):
        a, b = random_prompt(5, 256, 1), random_prompt(6, 256, 2)
        alone = engine.generate(b, max_new_tokens=12)[0].token_ids
        free = engine.generate(a, max_new_tokens=12)[0].token_ids
        banned = sorted(set(free))
        done = engine.generate([a, b], max_new_tokens=12,
                               logits_processors={"ban-tokens": banned})
        assert not set(done[0].token_ids) & set(banned) and len(done[0].token_ids) == 12
        # one request's processor in a batch: the unconstrained one gets its own tokens
        both = [engine.add_request(a, core.SamplingParams(
            max_new_tokens=12, logits_processors={"ban-tokens": banned})),
            engine.add_request(b, core.SamplingParams(max_new_tokens=12))]
        while engine.has_unfinished():
            engine.step()
        assert both[1].output_ids == alone
        assert both[0].output_ids == done[0].token_ids

    def test_sampled_rows_draw_among_the_allowed_tokens(self, engine):
        banned = list(range(0, 250))
        done = engine.generate(random_prompt(4, 256, 3), max_new_tokens=10, temperature=1.5,
                               seed=4, logits_processors={"ban-tokens": banned})[0]
        assert done.token_ids and set(done.token_ids) <= set(range(250, VOCAB))

    def test_complete_finishes_with_stop_masked_or_forced(self, engine):
        prompt = random_prompt(4, 256, 6)
        masked = engine.generate(prompt, max_new_tokens=20, logits_processors={"script": "mask"})
        forced = engine.generate(prompt, max_new_tokens=20, logits_processors={"script": "force"},
                                 jump_forward=True)
        off = engine.generate(prompt, max_new_tokens=20, logits_processors={"script": "force"})
        for done in masked + forced + off:
            assert done.token_ids == Script.tokens and done.finish_reason == "stop"
        # forced after the first token: one step for the first, none for the rest; without
        # jump_forward (the default) a step each
        assert len(forced[0].metrics.token_times) == 5
        assert len(set(forced[0].metrics.token_times)) == 1
        assert len(set(off[0].metrics.token_times)) == 5

    def test_forced_tokens_are_fed_before_the_next_sample(self, engine):
        # 40 sampled under a mask, 41..44 forced, then the model is free: what it says next
        # is what it says after those tokens, as if they had been in the prompt
        prompt = random_prompt(4, 256, 8)
        then = engine.generate(prompt + Script.tokens, max_new_tokens=4)[0].token_ids
        for how in ("mask-then-free", "force-then-free"):
            done = engine.generate(prompt, max_new_tokens=9, logits_processors={"script": how},
                                   jump_forward=True)
            assert done[0].token_ids == Script.tokens + then, how

    def test_forced_tokens_stop_at_max_new_tokens(self, engine):
        done = engine.generate(random_prompt(4, 256, 12), max_new_tokens=3,
                               logits_processors={"script": "force"}, jump_forward=True)[0]
        assert done.token_ids == Script.tokens[:3] and done.finish_reason == "length"

    def test_unknown_names_and_bad_arguments_are_refused_before_queueing(self, engine):
        prompt = random_prompt(3, 256, 7)
        with pytest.raises(InvalidRequestError, match=r"unknown logits processor 'nope'.*"
                                                      r"ban-tokens.*grammar"):
            engine.generate(prompt, logits_processors={"nope": 1})
        with pytest.raises(InvalidRequestError, match=r"ban-tokens takes a list of token ids"):
            engine.add_request(prompt, core.SamplingParams(logits_processors={"ban-tokens": 3}))
        with pytest.raises(InvalidRequestError, match="must map registered processor names"):
            core.SamplingParams(logits_processors=[("ban-tokens",)])
        assert not engine.has_unfinished()

    @pytest.mark.parametrize("how", ["raise", "none"])
    def test_a_failing_processor_ends_its_request_only(self, engine, how):
        a, b = random_prompt(5, 256, 9), random_prompt(4, 256, 10)
        alone = engine.generate(b, max_new_tokens=8)[0].token_ids
        bad = engine.add_request(a, core.SamplingParams(max_new_tokens=8,
                                                        logits_processors={"broken": how}))
        good = engine.add_request(b, core.SamplingParams(max_new_tokens=8))
        while engine.has_unfinished():
            engine.step()
        assert bad.finish_reason == "error" and "logits processor failed" in bad.error
        assert ("allows no token" in bad.error) == (how == "none")
        assert good.output_ids == alone and good.finish_reason == "length"
        with pytest.raises(RequestFailedError, match="logits processor failed"):
            engine.generate(a, max_new_tokens=4, logits_processors={"broken": how})


class TestBanTokensKit(LogitsProcessorTests):
    """A third party's processor passes the same kit as the built-in one."""

    @pytest.fixture
    def processor(self):
        return BanTokens()

    @pytest.fixture
    def processor_arg(self):
        return [0, 1, 31, 32, 63, 200]

    @pytest.fixture
    def bad_arg(self):
        return [VOCAB]


def test_registered_on_the_process_wide_manager_it_serves_any_engine(
        infergraft_plugin_manager, tiny_llama):
    infergraft_plugin_manager.register(TestThirdPartyProcessor.Plugin(), name="toy")
    assert "ban-tokens" in infergraft_plugin_manager.logits_processors()
    rows = {(r["kind"], r["name"], r["plugin"]) for r in plugin_rows(infergraft_plugin_manager)}
    assert {("logits processor", "ban-tokens", "toy"),  # what `infergraft plugins` lists
            ("logits processor", "grammar", "structured_output")} <= rows
    engine = core.build(tiny_llama, max_seq_len=32)
    done = engine.generate(random_prompt(3, 256, 11), max_new_tokens=6,
                           logits_processors={"ban-tokens": list(range(128))})[0]
    assert set(done.token_ids) <= set(range(128, 256))
