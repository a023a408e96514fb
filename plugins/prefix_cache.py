"""Automatic prefix caching for block caches (vLLM's automatic prefix caching, SGLang's
radix cache in block form).

A full block of a prompt is keyed by a hash chained from its parent block's key and its
own token ids, so equal keys mean equal token prefixes, and a later prompt that starts
with the same tokens takes the cached blocks instead of prefilling them. The hash only
finds a candidate: each entry also records its tokens and the exact parent it was
computed after (block id and registration number), and a lookup accepts a block only if
both match, so neither a hash collision nor a parent block evicted and registered again
under the same key can hand out K/V computed after other tokens.

Cached blocks are reference-counted like any other (``BlockAllocator``); one whose count
drops to zero keeps its K/V and its entry, evictable, and is only given out again (and
forgotten here) when no never-used block is left, least recently released first.
"""
from __future__ import annotations

import itertools
from typing import Callable, Hashable, Optional

import attrs

#: (block id, registration number): one registration of one block
Identity = tuple[int, int]


def chained_hash(parent_key: Optional[Hashable], tokens: tuple[int, ...]) -> Hashable:
    return hash((parent_key, tokens))


@attrs.frozen
class Entry:
    key: Hashable
    parent: Optional[Identity]  # None: the first block of a prompt
    tokens: tuple[int, ...]
    number: int  # unique per registration

    def identity(self, block: int) -> Identity:
        return block, self.number


class PrefixIndex:
    """Full blocks by key. ``hash_fn`` is replaceable (tests force collisions with it)."""

    def __init__(self, block_size: int,
                 hash_fn: Callable[[Optional[Hashable], tuple], Hashable] = chained_hash):
        self.block_size, self.hash_fn = block_size, hash_fn
        self._block_of: dict[Hashable, int] = {}
        self._entry: dict[int, Entry] = {}
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._entry)

    def holds(self, block: int) -> bool:
        return block in self._entry

    def chunk(self, tokens, j: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(tokens[j * bs:(j + 1) * bs])

    def lookup(self, tokens, max_blocks: int) -> list[Identity]:
        """The identities of the cached blocks ``tokens`` starts with (at most
        ``max_blocks``), each verified by its tokens and its parent."""
        chain, parent, parent_key = [], None, None
        for j in range(max_blocks):
            chunk = self.chunk(tokens, j)
            key = self.hash_fn(parent_key, chunk)
            b = self._block_of.get(key)
            if b is None:
                break
            e = self._entry[b]
            if e.tokens != chunk or e.parent != parent:  # a collision, or a stale child
                break
            parent, parent_key = e.identity(b), key
            chain.append(parent)
        return chain

    def register(self, block: int, parent: Optional[Identity], chunk: tuple) -> Optional[Identity]:
        """Key ``block`` (just filled with ``chunk`` after ``parent``). Returns the identity
        its children chain from: its own, or that of an equal block registered first (two
        equal prompts prefilled side by side); None when the key is taken by other tokens
        (a collision: the chain stops there)."""
        parent_key = None
        if parent is not None:
            e = self._entry.get(parent[0])
            if e is None or e.number != parent[1]:
                return None  # the parent was evicted meanwhile
            parent_key = e.key
        key = self.hash_fn(parent_key, chunk)
        other = self._block_of.get(key)
        if other is not None:
            e = self._entry[other]
            return e.identity(other) if (e.tokens, e.parent) == (chunk, parent) else None
        e = Entry(key, parent, chunk, next(self._numbers))
        self._block_of[key], self._entry[block] = block, e
        return e.identity(block)

    def forget(self, block: int) -> None:
        """``block`` is given out again: its entry goes (its children become unreachable:
        their parent identity no longer matches)."""
        e = self._entry.pop(block)
        del self._block_of[e.key]

    def check(self) -> None:
        assert len(self._block_of) == len(self._entry), "keys and entries disagree"
        for key, b in self._block_of.items():
            assert self._entry[b].key == key, f"block {b} is under key {key!r} but says otherwise"
