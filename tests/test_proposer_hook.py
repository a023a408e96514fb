"""infergraft_register_proposers: a third party's proposer, registered inline, drives
speculative decoding as the built-ins do. An oracle that knows the answer has every token
kept; one that proposes nonsense (ids outside the vocabulary, more than ``k``) changes no
token; one that draws its drafts from a distribution of its own (``Proposal.probs``)
keeps sampled requests reproducible. The kit runs on it too."""
import pytest
import torch

from infergraft import core
from infergraft.core import hookimpl
from infergraft.core.errors import PlanError, PluginError
from infergraft.core.speculative.proposer import NO_PROPOSAL, Drafter, Proposal, Proposer
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.proposer_kit import ProposerTests

KW = dict(plugins=["paged"], max_seq_len=64, max_batch_size=4, block_size=4)
PROMPTS = [random_prompt(n, 256, 60 + n) for n in (4, 9)]


class Oracle(Proposer):
    """Proposes the tokens it was told the target will say (``answers``: prompt -> ids)."""
    name = "oracle"
    options = {"answers": None, "junk": False}

    def check(self, options):
        if options["answers"] is None:
            raise PlanError("oracle: give the answers")

    def create(self, context, answers=None, junk=False):
        return OracleDrafter(answers, junk, context.vocab_size)


class OracleDrafter(Drafter):
    def __init__(self, answers, junk, vocab):
        self.answers, self.junk, self.vocab = answers, junk, vocab

    def propose(self, requests):
        out = []
        for r in requests:
            if self.junk:  # too many tokens, and ids past the vocabulary
                out.append(Proposal(tuple([self.vocab + 5] * (r.k + 3))))
                continue
            for prompt, answer in self.answers:
                ids = list(r.token_ids)
                if ids[:len(prompt)] == prompt:
                    done = len(ids) - len(prompt)
                    out.append(Proposal(tuple(answer[done:done + r.k])))
                    break
            else:
                out.append(NO_PROPOSAL)
        return out


class Smeared(Proposer):
    """Draws each draft token from a random distribution it reports (``probs``)."""
    name = "smeared"

    def create(self, context):
        return SmearedDrafter(context.vocab_size)


class SmearedDrafter(Drafter):
    def __init__(self, vocab):
        self.vocab, self.g = vocab, torch.Generator().manual_seed(0)

    def propose(self, requests):
        out = []
        for r in requests:
            probs = torch.softmax(torch.randn(r.k, self.vocab, generator=self.g) * 3, -1)
            tokens = torch.multinomial(probs, 1, generator=self.g)[:, 0].tolist()
            out.append(Proposal(tuple(tokens), probs))
        return out


class Plugin:
    @hookimpl
    def infergraft_register_proposers(self, register):
        register(Oracle())
        register(Smeared())


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=5, scale=5.0)


@pytest.fixture(scope="module")
def answers(hf):
    done = core.build(hf, **KW).generate(PROMPTS, max_new_tokens=20, ignore_eos=True)
    return [(p, c.token_ids) for p, c in zip(PROMPTS, done)]


def build(hf, speculative):
    return core.build(hf, **dict(KW, plugins=["paged", Plugin()]), speculative=speculative)


def test_an_oracle_has_every_token_kept(hf, answers):
    engine = build(hf, {"method": "oracle", "k": 3, "answers": answers})
    done = engine.generate(PROMPTS, max_new_tokens=20, ignore_eos=True)
    assert [c.token_ids for c in done] == [a for _, a in answers]
    stats = engine.stats()
    assert stats["spec_decode_draft_acceptance_rate"] == 1.0 and \
        stats["spec_decode_num_draft_tokens"] > 20, stats


def test_nonsense_proposals_change_no_token(hf, answers):
    engine = build(hf, {"method": "oracle", "answers": answers, "junk": True})
    done = engine.generate(PROMPTS, max_new_tokens=20, ignore_eos=True)
    assert [c.token_ids for c in done] == [a for _, a in answers]
    assert engine.stats()["spec_decode_num_drafts"] == 0  # none was fed


def test_drafts_with_their_own_distribution_reproduce(hf):
    runs = [build(hf, {"method": "smeared", "k": 3}).generate(
        PROMPTS, max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True) for _ in range(2)]
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    assert all(c.metrics.num_drafts > 0 and len(c.token_ids) == 16 for c in runs[0])


def test_an_inline_proposers_options_are_checked(hf):
    with pytest.raises(PlanError, match="oracle: give the answers"):
        build(hf, {"method": "oracle"})
    with pytest.raises(PlanError, match="registered: draft, ngram, oracle, smeared"):
        build(hf, {"method": "orcale"})


def test_a_proposer_without_create_is_refused(infergraft_plugin_manager):
    class Broken:
        @hookimpl
        def infergraft_register_proposers(self, register):
            register(type("NoCreate", (), {"name": "nocreate"})())

    infergraft_plugin_manager.register(Broken(), name="broken-proposer")
    with pytest.raises(PluginError, match=r"proposer 'nocreate' lacks required attribute\(s\) "
                                          r"\['create'\]"):
        infergraft_plugin_manager.proposers()


class TestOracleKit(ProposerTests):
    @pytest.fixture
    def proposer(self):
        return Oracle()

    @pytest.fixture
    def proposer_options(self):
        return {"answers": [([5, 6], [7, 8, 9, 10])]}

    @pytest.fixture
    def bad_options(self):
        return {"answers": None}
