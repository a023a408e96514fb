"""Conformance state machine for prefix caching (``KVCache.allocate_cached``).

It extends the cache machine (``cache_machine.CacheBackendMachine``) with an ``admit``
rule: a sequence admitted with token ids drawn from a three-token vocabulary, so that
prompts share prefixes often. The K/V written at a position of such a sequence are a
function of the tokens up to it (as a model's are), so a cached prefix a later
sequence takes must read back exactly what a fresh prefill of its tokens writes; every
read and every attention output is checked against that reference, after every step the
backend's invariants (reference counts balance, no cached or shared block written), and
a block still in use that eviction gave away shows up as another sequence's K/V in a read.

``collide=True`` replaces the cache's key function with one that maps many different
blocks to the same key (a cache with ``prefix.hash_fn``): the token comparison must
catch every such collision.

    from infergraft.core.testing.prefix_machine import make_prefix_cache_test
    TestMine = make_prefix_cache_test(cache_factory("paged", block_size=4, num_blocks=16))
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ..cache import CacheFullError
from .cache_machine import CacheBackendMachine, make_cache_test

VOCAB = 3


def colliding_hash(parent_key, tokens) -> int:
    """A key function with collisions everywhere: many prefixes share each key."""
    return (sum(tokens) + (parent_key or 0)) % 4


class PrefixCacheMachine(CacheBackendMachine):
    collide = False

    def __init__(self):
        super().__init__()
        # seq id -> the ids it was admitted with (kept after free: later prompts reuse them)
        self.tokens: dict[int, list[int]] = {}
        if self.collide:
            self.cache.prefix.hash_fn = colliding_hash

    def _kv_at(self, tokens, layer):
        """K and V ([Hkv, D] each) of the last of ``tokens`` in ``layer``."""
        g = torch.Generator().manual_seed(hash((tuple(tokens), layer)) % 2**31)
        shape = (self.spec.num_kv_heads, self.spec.head_dim)
        return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)

    def _new_kv(self, ids, counts, layer, rand):
        ks, vs = [], []
        for sid, n in zip(ids, counts):
            start, tokens = self.cache.length(sid) - n, self.tokens.get(sid)
            if tokens is not None and len(tokens) < start + n:  # decoded: ids of its own
                tokens = self.tokens[sid] = tokens + [
                    hash((sid, p)) % VOCAB for p in range(len(tokens), start + n)]
            for p in range(start, start + n):
                k, v = (rand(*self.shape1), rand(*self.shape1)) if tokens is None else \
                    self._kv_at(tokens[:p + 1], layer)
                ks.append(k)
                vs.append(v)
        return torch.stack(ks).to(self.dtype), torch.stack(vs).to(self.dtype)

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def finish(self, data):
        """A request ends: the ids of its tokens handed over (``key_tokens``), then freed;
        a later prompt starting with them must read back what a fresh prefill writes."""
        sid = self._live(data)
        key_tokens = getattr(self.cache, "key_tokens", None)  # (a third party's may lack it)
        if key_tokens is not None and sid in self.tokens:
            key_tokens(sid, self.tokens[sid])
        self.cache.free(sid)
        del self.ref[sid]

    @property
    def shape1(self):
        return self.spec.num_kv_heads, self.spec.head_dim

    @rule(data=st.data())
    def admit(self, data):
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                    max_size=self.max_seq_len + 2), label="token ids")
        if self.tokens and data.draw(st.booleans(), label="reuse"):  # an earlier prompt's start
            old = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)), label="from")]
            keep = data.draw(st.integers(0, len(old)), label="kept")
            tokens = (old[:keep] + tokens)[:self.max_seq_len + 2]
        sid, before = self.next_id, self._snapshot()
        self.next_id += 1
        try:
            cached = self.cache.allocate_cached(sid, tokens)
        except CacheFullError:
            return self._refused(before, "allocate_cached")
        n = len(tokens)
        assert n <= self.max_seq_len, f"allocate_cached accepted {n} > max_seq_len tokens"
        assert 0 <= cached < n, f"{cached} of {n} tokens cached: the last one must be fed"
        assert self.cache.length(sid) == cached, (self.cache.length(sid), cached)
        self.tokens[sid] = tokens
        # what a fresh prefill of the cached tokens writes, stored as the cache stores it
        ref = self._empty()
        for layer in range(self.spec.num_layers if cached else 0):
            kv = [self._kv_at(tokens[:p + 1], layer) for p in range(cached)]
            ref[layer] = [self.stored(torch.stack([x[i] for x in kv]).to(self.dtype))
                          for i in (0, 1)]
        self.ref[sid] = ref
        for layer in range(self.spec.num_layers if cached else 0):
            self._check_read(sid, layer)  # the hit holds what a fresh prefill writes
        left, chunk = n - cached, data.draw(st.integers(1, n), label="chunk")
        while left > 0 and sid in self.ref:  # the prompt's rest, in chunks
            step = min(chunk, left)
            if not self.cache.can_append([sid], [step]):
                break
            self._append([sid], [step], data)
            left -= step

    def _forked(self, parent, child):
        super()._forked(parent, child)
        if parent in self.tokens:  # the child continues its parent's ids
            self.tokens[child] = self.tokens[parent]


def make_prefix_cache_test(factory, *, max_examples: int = 200, step_count: int = 25,
                           collide: bool = False, **kwargs):
    """A ``unittest.TestCase`` running the prefix machine on caches from ``factory()``
    (``make_cache_test``'s arguments)."""
    return make_cache_test(factory, max_examples=max_examples, step_count=step_count,
                           name="PrefixCacheMachine", machine=PrefixCacheMachine,
                           collide=collide, **kwargs)
