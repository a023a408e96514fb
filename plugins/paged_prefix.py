"""The paged cache's side of automatic prefix caching (``prefix_cache.PrefixIndex``).

A sequence admitted with its token ids (``allocate_cached``: the prompt, or prompt and
output after a recompute preemption) takes the cached blocks its tokens start with and
prefills only the rest; at least its last token is computed, for its logits, so a prompt
that is cached whole (a multiple of the block size) recomputes its last block. As its
steps fill blocks with known tokens, each full one is registered, chained from the one
before. Tokens sampled later are keyed when the request finishes (``key_tokens``, ids
known then): the next turn of a conversation repeats them.

Sliding windows: a cached block that left a sequence's window still holds the K/V its
tokens have after exactly that prefix, so it is shared like any other; a sequence that
hits it drops it again at its first step, as it would have.
"""
from __future__ import annotations

from .paged_checks import HOLE


class PrefixCaching:
    """Mixed into PagedCache (its allocator, tables, rows and lengths; ``self.prefix`` is
    a PrefixIndex, or None when prefix caching is off)."""

    def _init_prefix(self, index) -> None:
        self.prefix = index
        self._tokens: dict = {}  # seq id -> the token ids it was admitted with
        self._chain: dict = {}  # seq id -> identities of its leading keyed blocks

    def allocate_cached(self, seq_id, token_ids) -> int:
        """Allocate ``seq_id`` for ``token_ids`` and take the cached blocks they start
        with; returns how many leading tokens are cached (their K/V already held)."""
        if self.prefix is None:
            return super().allocate_cached(seq_id, token_ids)
        chain = self.prefix.lookup(token_ids, (len(token_ids) - 1) // self.block_size)
        self.allocate(seq_id, len(token_ids), cached=[b for b, _ in chain])
        self._tokens[seq_id], self._chain[seq_id] = list(token_ids), chain
        return len(chain) * self.block_size

    def key_tokens(self, seq_id, token_ids) -> None:
        """Key the full blocks of ``seq_id`` past those keyed already, ``token_ids`` the
        ids of its tokens (prompt, output) in order; blocks beyond its K/V stay unkeyed."""
        if self.prefix is not None and seq_id in self._chain:
            self._tokens[seq_id] = list(token_ids)
            self._register_full(seq_id)

    def _register_full(self, seq_id) -> None:
        """Key the blocks ``seq_id`` filled with known tokens since it was last asked."""
        tokens = self._tokens.get(seq_id)
        if tokens is None:
            return
        chain, table = self._chain[seq_id], self._tables[seq_id]
        full = min(self._len[seq_id], len(tokens)) // self.block_size
        for j in range(len(chain), full):
            parent = chain[j - 1] if j else None
            ident = None if table[j] == HOLE else \
                self.prefix.register(table[j], parent, self.prefix.chunk(tokens, j))
            # a collision, its parent evicted, or a block the window dropped: no keys past it
            if ident is None:
                del self._tokens[seq_id]
                return
            chain.append(ident)
        if self._len[seq_id] >= len(tokens):
            del self._tokens[seq_id]  # every known token is in: nothing more to key

    def discard(self, seq_id) -> None:
        """Free ``seq_id`` after a failed step: the blocks only it holds are unkeyed first,
        as their K/V may be half written (blocks others hold were complete before)."""
        if self.prefix is not None:
            for b in self._tables[seq_id]:
                if b != HOLE and self.allocator.refs[b] == 1 and self.prefix.holds(b):
                    self.prefix.forget(b)
        self.free(seq_id)

    def cached_tokens(self, seq_id) -> int:
        """Leading tokens of ``seq_id`` in keyed blocks (a recompute would hit them)."""
        return len(self._chain.get(seq_id, ())) * self.block_size if self.prefix else 0

    def _forget_prefix(self, seq_id) -> None:
        self._tokens.pop(seq_id, None)
        self._chain.pop(seq_id, None)

    def _fork_prefix(self, parent, child) -> None:
        if self.prefix is not None:
            self._chain[child] = list(self._chain.get(parent, ()))
            if parent in self._tokens:
                self._tokens[child] = self._tokens[parent]

    def prefix_stats(self) -> dict:
        if self.prefix is None:
            return {}
        return {"blocks_cached": len(self.prefix),
                "blocks_evictable": self.allocator.num_evictable}
