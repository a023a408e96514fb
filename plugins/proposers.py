"""The built-in proposers of speculative decoding, ``ngram`` (prompt lookup) and ``draft``
(a smaller model), registered like any third party's; their implementations live in
``core/speculative/``, beside the engine's side of the verification."""
from infergraft.core.hookspecs import hookimpl
from infergraft.core.speculative.draft import DraftProposer
from infergraft.core.speculative.ngram import NgramProposer


@hookimpl
def infergraft_register_proposers(register):
    register(NgramProposer())
    register(DraftProposer())
