"""The built-in ``grammar`` logits processor: structured output (a JSON schema, any JSON
object, a regex, a grammar, a choice of strings) through xgrammar, registered like any
third-party processor. Its implementation lives in ``core/structured/``, beside the
SamplingParams fields that name it; xgrammar is imported when a request first needs it."""
from infergraft.core.hookspecs import hookimpl
from infergraft.core.structured.grammar import GrammarProcessor


@hookimpl
def infergraft_register_logits_processors(register):
    register(GrammarProcessor())
