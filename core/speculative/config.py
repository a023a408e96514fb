"""The ``speculative`` setting: ``core.build(..., speculative={...})``, the config file's
key of the same name, ``infergraft serve / generate --speculative JSON``.

    {"method": "ngram", "k": 4, "min_n": 1, "max_n": 4, "ahead": true}
    {"method": "draft", "model": "path/or/alias", "k": 4, "build": {"plugins": ["paged"]}}

``method`` names a registered proposer (``infergraft_register_proposers``; a bare string
is ``{"method": that}``), ``k`` the tokens a request proposes at most per step (its
adaptive length starts there), ``disable_by_batch_size`` the most decoding requests a step
may hold and still speculate (a larger batch is compute-bound enough that extra tokens
cost throughput), ``ahead`` whether a greedy verify step may be launched before the one
before it is read (``ahead.py``: with asynchronous steps and a proposer that proposes on
the host; false: each verify step waits for the last one's tokens); the other keys are
the proposer's own (``Proposer.options``). Every
value is checked before any weight loads: an error names the key, the value and what is
accepted.
"""
from __future__ import annotations

from typing import Any

import attrs

from ..errors import PlanError, UnknownPluginError

#: the keys every method takes, with their defaults (``method`` has none)
COMMON = {"method": None, "k": 4, "disable_by_batch_size": 32, "ahead": True}


@attrs.frozen
class SpeculativeConfig:
    method: str
    k: int
    disable_by_batch_size: int
    ahead: bool = True  # verify steps launched before the last one is read (ahead.py)
    options: dict = attrs.field(factory=dict, eq=False)  # the proposer's own, defaults filled


def parse_speculative(value, proposers) -> SpeculativeConfig | None:
    """``value`` (None, a method name or a dict) checked against the registered
    ``proposers`` (a Registry) -> SpeculativeConfig, or None for no speculation."""
    if value is None or value is False:
        return None
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, dict):
        raise PlanError(f"speculative must be an object such as {{\"method\": \"ngram\", "
                        f"\"k\": 4}} (or a method name, or None: off), got {value!r}")
    method = value.get("method")
    if method is None:
        raise PlanError(f"speculative needs a method: one of {_names(proposers)}, e.g. "
                        f"{{\"method\": \"ngram\", \"k\": 4}}; got {value!r}")
    try:
        proposer = proposers.get(method)
    except UnknownPluginError:
        raise PlanError(f"speculative method {method!r} is not a registered proposer; "
                        f"registered: {_names(proposers)}") from None
    own = dict(getattr(proposer, "options", {}) or {})
    unknown = sorted(set(value) - set(COMMON) - set(own))
    if unknown:
        raise PlanError(f"speculative {method}: unknown key(s) {unknown}; accepted: "
                        f"{', '.join([*COMMON, *own])}")
    given = {**COMMON, **own, **value}
    for key in ("k", "disable_by_batch_size"):
        _positive(method, key, given[key])
    if not isinstance(given["ahead"], bool):
        raise PlanError(f"speculative {method}: ahead must be true or false (a verify step "
                        f"launched before the last one is read), got {given['ahead']!r}")
    options = {key: given[key] for key in own}
    proposer.check(options)
    return SpeculativeConfig(method, given["k"], given["disable_by_batch_size"],
                             given["ahead"], options)


def _positive(method: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = {"k": "tokens proposed per step at most",
                "disable_by_batch_size": "decoding requests a step may hold and speculate"}[key]
        raise PlanError(f"speculative {method}: {key} must be an integer >= 1 ({what}), "
                        f"got {value!r}")


def _names(proposers) -> str:
    return ", ".join(proposers.names()) or "none (no proposer plugin is loaded)"


def draft_rows(config: SpeculativeConfig | None, max_batch_size: int) -> int:
    """Proposed tokens one step can carry at most (the mixed-step graphs' logits rows
    beyond one a sequence): ``k`` for each request that may speculate."""
    return 0 if config is None else config.k * min(config.disable_by_batch_size, max_batch_size)
