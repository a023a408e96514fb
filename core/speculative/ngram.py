"""The built-in ``ngram`` proposer: prompt lookup decoding (Saxena's "prompt lookup",
vLLM's ``ngram``). Where the output repeats what came before it (an edit, a summary, code
that quotes its input), the tokens after an earlier occurrence of the text's last few
tokens are a good guess at what comes next, and they cost no model.

``lookup`` takes the longest suffix of the request's tokens (prompt, then output) of
``min_n`` to ``max_n`` tokens that occurs earlier, at its latest earlier occurrence that
``k`` tokens follow (else its latest), and proposes the up to ``k`` tokens after it. The
search runs over the tokens as bytes (``bytes.rfind``, 4 bytes a token): a loop in C, not
in Python, however long the request, from the end back to the latest match. The drafter
keeps each request's bytes between steps and appends only the tokens it got since, so a
step's proposal costs in Python what the step added, not the length of the request.
A request's ``ahead`` tokens (a draft not verified yet) are looked up after a copy of
those bytes, never kept in them: what is kept is only ever the request's own tokens.
"""
from __future__ import annotations

from array import array

from ..errors import PlanError
from .proposer import Drafter, Proposal, Proposer

_ITEM = array("i").itemsize  # bytes a token takes in the search


def lookup(tokens, k: int, min_n: int = 1, max_n: int = 4) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix of
    ``tokens`` with ``min_n`` <= length <= ``max_n``: its latest occurrence that ``k``
    tokens follow, else its latest (in a repeating run, that one's followers reach the
    end); none: ``()``."""
    return lookup_bytes(array("i", tokens).tobytes(), k, min_n, max_n)


def lookup_bytes(data, k: int, min_n: int = 1, max_n: int = 4) -> tuple[int, ...]:
    """``lookup`` of the tokens ``data`` holds (``array("i")``'s bytes, 4 a token)."""
    n_tokens = len(data) // _ITEM
    if k < 1 or n_tokens <= min_n:
        return ()
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        needle = data[(n_tokens - n) * _ITEM:]
        # a match must end before the last token, so that at least one token follows it
        at = _rfind(data, needle, n_tokens - k) if n_tokens - k >= n else -1
        at = at if at >= 0 else _rfind(data, needle, n_tokens - 1)
        if at >= 0:
            start = (at + n) * _ITEM
            return tuple(array("i", data[start:start + k * _ITEM]))
    return ()


def _rfind(data: bytes, needle: bytes, end: int) -> int:
    """The token index of the last whole-token occurrence of ``needle`` ending at or
    before token ``end`` (-1: none); not bytes straddling two tokens."""
    end *= _ITEM
    while True:
        at = data.rfind(needle, 0, end)
        if at < 0 or at % _ITEM == 0:
            return at // _ITEM if at >= 0 else -1
        end = at + len(needle) - 1  # look before this misaligned hit


class NgramDrafter(Drafter):
    proposes_ahead = True  # a lookup on the host

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        # seq id -> [its tokens so far as bytes, how many, the last one]
        self._seen: dict = {}

    def propose(self, requests):
        return [Proposal(lookup_bytes(self._with_ahead(r), r.k, self.min_n, self.max_n))
                for r in requests]

    def _with_ahead(self, request):
        data = self._bytes(request)
        return data + array("i", request.ahead).tobytes() if request.ahead else data

    def _bytes(self, request) -> bytearray:
        """The request's tokens as bytes: those it had at its last proposal, then the
        ones since (all of them where it is new, or its tokens no longer go on from the
        last one it had there)."""
        ids, seen = request.token_ids, self._seen.get(request.seq_id)
        if seen is not None:
            since = ids[seen[1] - 1:]  # the last token it had, then the ones since
            if since and since[0] == seen[2]:
                if len(since) > 1:
                    _extend(seen, since[1:])
                return seen[0]
        if not ids:
            return bytearray()
        seen = self._seen[request.seq_id] = [bytearray(), 0, None]
        _extend(seen, ids)
        return seen[0]

    def release(self, seq_id):
        self._seen.pop(seq_id, None)


def _extend(seen: list, tokens) -> None:
    seen[0] += array("i", tokens).tobytes()
    seen[1] += len(tokens)
    seen[2] = tokens[-1]


class NgramProposer(Proposer):
    name = "ngram"
    options = {"min_n": 1, "max_n": 4}

    def check(self, options):
        for key in ("min_n", "max_n"):
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"speculative ngram: {key} must be an integer >= 1 (tokens of "
                                f"the suffix looked up), got {value!r}")
        if options["min_n"] > options["max_n"]:
            raise PlanError(f"speculative ngram: min_n={options['min_n']} is more than "
                            f"max_n={options['max_n']}; accepted: 1 <= min_n <= max_n")

    def create(self, context, min_n=1, max_n=4):
        return NgramDrafter(min_n, max_n)
