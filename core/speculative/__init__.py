"""Speculative decoding: proposed tokens verified by the target model, several per step.

``proposer.py`` is the contract (``infergraft_register_proposers``); ``ngram.py`` and
``draft.py`` the built-in proposers (registered by ``plugins/proposers.py``);
``config.py`` the ``speculative`` setting; ``speculator.py`` the engine's side (proposals
added to a step, split from its logits, rolled back); ``verify.py`` which tokens a request
keeps (greedy match, rejection sampling); ``adaptive.py`` each request's proposal length.
"""
from .config import SpeculativeConfig, parse_speculative
from .proposer import NO_PROPOSAL, DraftRequest, Drafter, Proposal, Proposer, ProposerContext

__all__ = ["SpeculativeConfig", "parse_speculative", "Proposer", "Drafter", "DraftRequest",
           "Proposal", "ProposerContext", "NO_PROPOSAL"]
