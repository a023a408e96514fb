"""Structured output: a request's output constrained to a JSON schema, any JSON object, a
regex, a grammar or one of a list of strings (``SamplingParams(json_schema=...,
json_object=True, regex=..., grammar=..., choice=[...])``).

``constraint``: those fields checked and turned into one ``Constraint`` (kind, text) when
the SamplingParams is made, so a bad schema, regex or grammar is an InvalidRequestError
before anything is queued; ``schema_check``: the JSON-schema keywords the output is
guaranteed to follow (others are refused by name, not silently ignored); ``grammar``:
the built-in ``grammar`` logits processor on xgrammar (the tokenizer's vocabulary
compiled once per tokenizer, each grammar once per (kind, text), in a background thread
while the request's prompt is prefilled), which ``plugins/structured_output.py`` registers
through ``infergraft_register_logits_processors`` like any other plugin; ``batch``: a
step's masks of those grammars filled in one call, across xgrammar's threads.

xgrammar is an optional dependency: ``pip install 'infergraft[structured]'``.
"""
from .constraint import KINDS, PROCESSOR, Constraint, check_constraint

__all__ = ["KINDS", "PROCESSOR", "Constraint", "check_constraint"]
